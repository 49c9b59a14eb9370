"""The claims checker: every claim the README and docs make is tied to something that proves it.

Front pages drift from code: a count of plug points typed by hand, an anchor that broke
when a page was renamed, a feature called "working" whose test was deleted, a speed-up
nobody can reproduce. `python -m tools.claims` fails on each of these, naming the file
and line, and `make test` runs it after pytest so drift is a red build, not a surprise.

What is checked (see `check.run_checks`):
- links and `#anchors` in README.md and docs/**/*.md resolve (anchors as MkDocs makes them);
- `docs/features.yaml` is well formed and the README feature table is generated from it;
- a feature marked `working` names an existing example and existing tests that ran and
  passed in the suite's JUnit report (`.reports/junit.xml`);
- counts are written `<!-- count:NAME -->N<!-- /count -->` and equal the count computed
  from the code (`counts.COUNTERS`); a bare "12 recipes" is an error;
- performance figures are written `<!-- perf:ID -->VALUE<!-- /perf -->`, equal the row ID of
  `benchmarks/RESULTS.md` and sit next to that row's benchmark command;
- generated reference pages (CLI, config) are up to date.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Problem:
    """One failed claim, located so an editor can jump to it."""

    path: str  # relative to the repository root
    line: int  # 1-based; 0 when the problem concerns the whole file
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}" if self.line else f"{self.path}: {self.message}"
