"""`python -m tools.claims`: check every README/docs claim, or regenerate what is generated.

Exit status 0 when every claim holds, 1 otherwise (one `file:line: message` per problem).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.claims.check import run_checks
from tools.claims.manifest import TABLES, load, with_table


def _write_readme(root: Path) -> int:
    features, problems = load(root)
    if problems:
        print("\n".join(map(str, problems)), file=sys.stderr)
        return 1
    for rel, for_docs in TABLES.items():
        path = root / rel
        if path.exists():
            path.write_text(with_table(path.read_text(encoding="utf-8"), features, for_docs), encoding="utf-8")
            print(f"wrote the feature table of {rel} ({len(features)} features)")
    return 0


def _write_reference(root: Path) -> int:
    from tools.claims.reference import ReferenceError, pages

    try:
        generated = pages(root)
    except ReferenceError as e:
        print(f"cannot generate the reference pages: {e}", file=sys.stderr)
        return 1
    for path, text in generated.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(root)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.claims", description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path.cwd(), help="repository root (default: current directory)")
    p.add_argument("--junit", type=Path, default=None, help="pytest JUnit XML (default: ROOT/.reports/junit.xml)")
    p.add_argument("--no-evidence", action="store_true", help="do not read test outcomes (no suite has run)")
    p.add_argument(
        "--partial-run", action="store_true", help="the report covers part of the suite: absent tests are fine"
    )
    p.add_argument("--no-references", action="store_true", help="skip the staleness check of generated reference pages")
    p.add_argument(
        "--write-readme",
        action="store_true",
        help="regenerate the feature tables of README.md and docs/index.md from docs/features.yaml",
    )
    p.add_argument("--write-reference", action="store_true", help="regenerate docs/reference/cli.md and config.md")
    args = p.parse_args(argv)
    root = args.root.resolve()
    if args.write_readme or args.write_reference:
        rc = 0
        if args.write_readme:
            rc |= _write_readme(root)
        if args.write_reference:
            rc |= _write_reference(root)
        return rc
    problems = run_checks(
        root,
        junit=args.junit,
        evidence=not args.no_evidence,
        partial_run=args.partial_run,
        references=not args.no_references,
    )
    for problem in problems:
        print(problem)
    if problems:
        print(f"claims check FAILED: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("claims check OK: links, anchors, counts, figures, features and generated pages hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
