"""Run every claim check over a repository tree and collect the problems."""

from __future__ import annotations

from pathlib import Path

from tools.claims import Problem
from tools.claims.evidence import JUNIT, read_junit
from tools.claims.figures import check_counts, check_perf
from tools.claims.links import check_links
from tools.claims.manifest import README, check_features, check_status_markers, check_tables, load
from tools.claims.prose import check_prose


def markdown_files(root: Path) -> list[Path]:
    """README.md and every page under docs/: the text a reader takes as furlong's claims."""
    files = [root / README] if (root / README).exists() else []
    return files + sorted((root / "docs").rglob("*.md"))


def run_checks(
    root: Path,
    *,
    junit: Path | None = None,
    evidence: bool = True,
    partial_run: bool = False,
    references: bool = True,
) -> list[Problem]:
    """All problems found under `root`, sorted by file and line.

    evidence: check that the tests of working/partial features passed in the JUnit report
    (`junit`, default `.reports/junit.xml`); off when no suite has run (e.g. inside pytest).
    partial_run: the report covers part of the suite; tests absent from it are not errors.
    references: compare the generated CLI and config pages with what the code produces.
    """
    root = root.resolve()
    files = markdown_files(root)
    problems = check_links(root, files, root / "docs")
    problems += check_counts(root, files)
    problems += check_perf(root, files)
    features, found = load(root)
    problems += found
    cases = None
    if evidence:
        report = junit or root / JUNIT
        if not report.exists():
            problems.append(
                Problem(JUNIT, 0, "no JUnit report: run the suite first (`make test` or scripts/run-tests.sh)")
            )
        else:
            try:
                cases = read_junit(report)
            except ValueError as e:
                problems.append(Problem(JUNIT, 0, str(e)))
    problems += check_features(root, features, cases, partial_run)
    if not any(p.path == "docs/features.yaml" and p.line <= 1 for p in found):  # a manifest was read
        problems += check_tables(root, features)
        problems += check_status_markers(root, features, files)
        problems += check_prose(root, features, files, cases)
    if references:
        problems += check_references(root)
    return sorted(set(problems))


def check_references(root: Path) -> list[Problem]:
    from tools.claims.reference import ReferenceError, pages

    try:
        generated = pages(root)
    except ReferenceError as e:
        return [Problem("furlong/cli.py", 0, f"cannot generate the reference pages: {e}")]
    out = []
    for path, text in generated.items():
        rel = path.relative_to(root).as_posix()
        if not path.exists():
            out.append(Problem(rel, 0, "missing; run `python -m tools.claims --write-reference`"))
            continue
        have, want = path.read_text(encoding="utf-8").splitlines(), text.splitlines()
        diff = next((n for n, (a, b) in enumerate(zip(have, want), 1) if a != b), None)
        if diff is None and len(have) != len(want):
            diff = min(len(have), len(want)) + 1
        if diff is not None:
            out.append(
                Problem(
                    rel,
                    diff,
                    "stale: differs from what the code generates now; run `python -m tools.claims --write-reference`",
                )
            )
    return out
