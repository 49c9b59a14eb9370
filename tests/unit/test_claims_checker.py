"""The claims checker fails on each kind of drift, naming the file and line.

Each test builds a small fake repository in a temporary directory (README, docs, manifest,
recipes, a JUnit report), checks it passes, then breaks one thing and checks the exact
problem reported. The last test runs the checker on the real repository.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tools.claims import Problem
from tools.claims.check import run_checks
from tools.claims.manifest import load, with_table

ROOT = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="0" skipped="1" tests="3">
<testcase classname="tests.unit.test_thing" name="test_works" time="0.1"/>
<testcase classname="tests.unit.test_thing" name="test_param[a]" time="0.1"/>
<testcase classname="tests.unit.test_thing" name="test_skipped" time="0.0"><skipped message="no"/></testcase>
</testsuite></testsuites>
"""

MANIFEST = """\
features:
  - id: thing
    name: The thing
    status: working
    doc: guide.md#the-thing
    example: recipes/thing.yaml
    tests:
      - tests/unit/test_thing.py::test_works
      - tests/unit/test_thing.py::test_param
  - id: later
    name: Later
    status: planned
    doc: guide.md#later
    example: null
    tests: []
"""


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A fake repository on which every check passes."""
    _write(tmp_path, "recipes/thing.yaml", "name: thing\n")
    _write(tmp_path, "recipes/other.yaml", "name: other\n")
    _write(
        tmp_path,
        "tests/unit/test_thing.py",
        """\
        import pytest
        def test_works(): pass
        @pytest.mark.parametrize("x", ["a"])
        def test_param(x): pass
        def test_skipped(): pass
        """,
    )
    _write(tmp_path, ".reports/junit.xml", JUNIT)
    _write(tmp_path, "docs/features.yaml", MANIFEST)
    _write(
        tmp_path,
        "docs/guide.md",
        """\
        # Guide

        ## The thing

        Status: <!-- status:thing -->working<!-- /status -->. We ship
        <!-- count:recipes -->2<!-- /count --> recipe files. See [later](#later).

        ```text
        [not a link](nowhere.md) and 99 recipes in a code block are not claims
        ```

        ## Later

        Back to the [index](index.md#furlong).
        """,
    )
    _write(tmp_path, "docs/index.md", "# furlong\n\n<!-- features:begin -->\n<!-- features:end -->\n")
    _write(
        tmp_path,
        "README.md",
        "# furlong\n\nRead the [guide](docs/guide.md#the-thing).\n\n<!-- features:begin -->\n<!-- features:end -->\n",
    )
    _write(
        tmp_path,
        "benchmarks/RESULTS.md",
        """\
        ## Recorded results

        | id | result | command | machine | date | commit |
        |---|---|---|---|---|---|
        | speed | 1.8× | `furlong bench speed` | laptop | 2025-01-01 | abc |
        """,
    )
    _regenerate_tables(tmp_path)
    return tmp_path


def _regenerate_tables(root: Path) -> None:
    features, problems = load(root)
    assert problems == []
    for rel, for_docs in (("README.md", False), ("docs/index.md", True)):
        p = root / rel
        p.write_text(with_table(p.read_text(), features, for_docs))


def check(root: Path, **kw) -> list[Problem]:
    return run_checks(root, references=False, **kw)


def _append(path: Path, text: str) -> int:
    """Append `text` as a new paragraph; returns the line number it starts on."""
    old = path.read_text()
    path.write_text(old + "\n" + text + "\n")
    return old.count("\n") + 2


def _only(problems: list[Problem], path: str, line: int, *words: str) -> None:
    assert len(problems) == 1, problems
    p = problems[0]
    assert (p.path, p.line) == (path, line), p
    for w in words:
        assert w in p.message, p


def test_fake_repo_passes(repo: Path) -> None:
    assert check(repo) == []


def test_broken_link_names_file_and_line(repo: Path) -> None:
    line = _append(repo / "docs/guide.md", "A [broken link](missing.md) here.")
    _only(check(repo), "docs/guide.md", line, "missing.md", "does not exist")


def test_dead_anchor_in_readme_names_file_and_line(repo: Path) -> None:
    line = _append(repo / "README.md", "See [the guide](docs/guide.md#no-such-section).")
    _only(check(repo), "README.md", line, "no anchor #no-such-section")


def test_anchor_of_duplicate_heading_follows_mkdocs(repo: Path) -> None:
    _append(repo / "docs/guide.md", "## Later\n\nSecond [one](#later_1) and [none](#later_2).")
    problems = check(repo)
    assert [p.message for p in problems] == ["link '#later_2': no anchor #later_2 in this file"]


def test_docs_link_outside_docs_fails(repo: Path) -> None:
    line = _append(repo / "docs/guide.md", "The [recipe](../recipes/thing.yaml).")
    _only(check(repo), "docs/guide.md", line, "outside docs/")


def test_stale_count_names_file_and_line(repo: Path) -> None:
    _write(repo, "recipes/third.yaml", "name: third\n")
    _only(check(repo), "docs/guide.md", 6, "count recipes is written '2' but the code has 3")


def test_unmarked_count_fails(repo: Path) -> None:
    line = _append(repo / "docs/guide.md", "furlong ships 12 recipes.")
    _only(check(repo), "docs/guide.md", line, "'12 recipes'", "<!-- count:recipes -->")


def test_unknown_count_fails(repo: Path) -> None:
    line = _append(repo / "README.md", "There are <!-- count:widgets -->3<!-- /count --> widgets.")
    _only(check(repo), "README.md", line, "unknown count 'widgets'")


def test_unlisted_feature_in_readme_fails(repo: Path) -> None:
    readme = repo / "README.md"
    lines = readme.read_text().splitlines()
    at = lines.index("<!-- features:end -->")
    lines.insert(at, "| Teleportation | working | — | — |")
    readme.write_text("\n".join(lines) + "\n")
    _only(check(repo), "README.md", at + 1, "feature table differs from docs/features.yaml", "Teleportation")


def test_working_feature_without_tests_fails(repo: Path) -> None:
    manifest = repo / "docs/features.yaml"
    manifest.write_text(
        manifest.read_text()
        .replace("      - tests/unit/test_thing.py::test_works\n      - tests/unit/test_thing.py::test_param\n", "")
        .replace("    tests:\n  - id: later", "    tests: []\n  - id: later")
    )
    _regenerate_tables(repo)
    _only(check(repo), "docs/features.yaml", 7, "working feature must name the tests")


def test_working_feature_with_missing_test_fails(repo: Path) -> None:
    manifest = repo / "docs/features.yaml"
    manifest.write_text(manifest.read_text().replace("::test_works", "::test_gone"))
    _only(check(repo), "docs/features.yaml", 8, "defines no test test_gone")


def test_working_feature_with_skipped_test_fails(repo: Path) -> None:
    manifest = repo / "docs/features.yaml"
    manifest.write_text(manifest.read_text().replace("::test_works", "::test_skipped"))
    _only(check(repo), "docs/features.yaml", 8, "test_skipped skipped")


def test_test_absent_from_report_fails_unless_partial_run(repo: Path) -> None:
    report = repo / ".reports/junit.xml"
    report.write_text(JUNIT.replace('name="test_works"', 'name="test_other"'))
    _only(check(repo), "docs/features.yaml", 8, "test_works did not run")
    assert check(repo, partial_run=True) == []


def test_failed_test_fails(repo: Path) -> None:
    report = repo / ".reports/junit.xml"
    report.write_text(
        JUNIT.replace('name="test_param[a]" time="0.1"/>', 'name="test_param[a]"><failure message="x"/></testcase>')
    )
    _only(check(repo), "docs/features.yaml", 9, "test_param failed")


def test_missing_example_fails(repo: Path) -> None:
    (repo / "recipes/thing.yaml").unlink()
    (repo / "recipes/extra.yaml").write_text("x: 1\n")  # keep the recipe count at 2
    problems = check(repo)
    assert (
        Problem("docs/features.yaml", 6, "feature thing (working): example recipes/thing.yaml does not exist")
        in problems
    )
    assert Problem("README.md", 8, "link 'recipes/thing.yaml': recipes/thing.yaml does not exist") in problems
    assert len(problems) == 2, problems


def test_no_report_fails_without_no_evidence(repo: Path) -> None:
    (repo / ".reports/junit.xml").unlink()
    _only(check(repo), ".reports/junit.xml", 0, "no JUnit report")
    assert check(repo, evidence=False) == []


def test_status_marker_disagreeing_with_manifest_fails(repo: Path) -> None:
    guide = repo / "docs/guide.md"
    guide.write_text(guide.read_text().replace("status:thing -->working", "status:thing -->planned"))
    _only(check(repo), "docs/guide.md", 5, "says feature thing is 'planned'", "says 'working'")


def test_bad_manifest_status_names_line(repo: Path) -> None:
    manifest = repo / "docs/features.yaml"
    manifest.write_text(manifest.read_text().replace("status: planned", "status: someday"))
    problems = check(repo)
    assert (
        Problem("docs/features.yaml", 12, "feature later: status 'someday' is not one of working, partial, planned")
        in problems
    )


def test_perf_figure_must_match_results_and_name_command(repo: Path) -> None:
    guide = repo / "docs/guide.md"
    ok = _append(guide, "It is <!-- perf:speed -->1.8×<!-- /perf --> faster (`furlong bench speed`).")
    assert check(repo) == []
    guide.write_text(guide.read_text().replace(">1.8×<", ">2.5×<"))
    _only(check(repo), "docs/guide.md", ok, "written '2.5×'", "benchmarks/RESULTS.md:5 records '1.8×'")
    guide.write_text(guide.read_text().replace(">2.5×<", ">1.8×<").replace(" (`furlong bench speed`)", ""))
    _only(check(repo), "docs/guide.md", ok, "must name its benchmark command `furlong bench speed`")


def test_unmarked_perf_figure_fails(repo: Path) -> None:
    line = _append(repo / "README.md", "furlong is 3× faster and generates 900 tok/s.")
    problems = check(repo)
    assert {(p.path, p.line) for p in problems} == {("README.md", line)}
    assert len(problems) == 2, problems


def test_real_repository_claims_hold() -> None:
    """Links, anchors, counts, figures and the manifest of this repository (test outcomes are
    checked by scripts/run-tests.sh after the suite, from the report it writes)."""
    problems = run_checks(ROOT, evidence=False, references=False)
    assert problems == [], "\n".join(map(str, problems))
