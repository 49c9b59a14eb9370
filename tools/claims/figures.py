"""Numbers the docs state: counts computed from code, performance figures from benchmarks.

Counts are written `<!-- count:NAME -->N<!-- /count -->` (NAME in `counts.COUNTERS`).
Performance figures are written `<!-- perf:ID -->VALUE<!-- /perf -->`, where ID is a row of
the results table in `benchmarks/RESULTS.md`; VALUE must equal that row's `result`, and the
row's benchmark command must be written in backticks on the same table row or in the same
paragraph, so every reader sees how to reproduce the figure. A number that looks like a count
("12 recipes") or a speed ("1.8× faster", "900 tok/s") outside these markers is an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools.claims import Problem
from tools.claims.counts import COUNTERS, UNMARKED, CountUnavailable
from tools.claims.markdown_scan import marked, prose_lines, strip_markers

RESULTS = "benchmarks/RESULTS.md"
RESULTS_HEADER = ["id", "result", "command", "machine", "date", "commit"]

_WORDS = "two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty"
_UNMARKED_COUNT = [
    (re.compile(rf"(?<![\w.])(\d+|{_WORDS})\s+(?:[\w-]+\s+)?({noun})\b", re.IGNORECASE), name)
    for noun, name in UNMARKED.items()
]
_UNMARKED_PERF = re.compile(
    r"\d[\d,]*(?:\.\d+)?\s*[kM]?\s*(?:tok(?:ens)?/s|tokens? per second|samples?/s|steps?/s|s/step|"
    r"seconds? per step|s per step|it/s|[GM]B/s)(?![\w/])"
    r"|\d+(?:\.\d+)?\s*[×x]\s*(?:faster|slower|speed-?ups?|higher|lower|more|fewer|less)\b"
    r"|\d+(?:\.\d+)?×(?!\s*\d)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Result:
    line: int
    result: str
    command: str


def read_results(root: Path) -> tuple[dict[str, Result], list[Problem]]:
    """The rows of the results table, by id, and any malformed rows."""
    path = root / RESULTS
    if not path.exists():
        return {}, [Problem(RESULTS, 0, "missing: performance figures need it (see docs/benchmarks.md)")]
    rows: dict[str, Result] = {}
    problems: list[Problem] = []
    in_table = False
    text = path.read_text(encoding="utf-8")
    prose = {n for n, _ in prose_lines(text)}  # a row shown inside a code block is an example, not a result
    for n, line in enumerate(text.splitlines(), 1):
        if n not in prose:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if cells is None:
            in_table = False
            continue
        if [c.lower() for c in cells] == RESULTS_HEADER:
            in_table = True
            continue
        if not in_table or set("".join(cells)) <= set("-: "):
            continue
        if len(cells) != len(RESULTS_HEADER):
            problems.append(Problem(RESULTS, n, f"row has {len(cells)} cells, the header has {len(RESULTS_HEADER)}"))
            continue
        rid, result, command = cells[0], cells[1], cells[2]
        cmd = re.fullmatch(r"`([^`]+)`", command)
        if not re.fullmatch(r"[\w.-]+", rid):
            problems.append(Problem(RESULTS, n, f"id {rid!r} must be letters, digits, '.', '_' or '-'"))
        elif rid in rows:
            problems.append(Problem(RESULTS, n, f"id {rid!r} repeats line {rows[rid].line}"))
        elif not result:
            problems.append(Problem(RESULTS, n, f"row {rid!r} has no result"))
        elif cmd is None:
            problems.append(Problem(RESULTS, n, f"row {rid!r}: command must be one `command` in backticks"))
        else:
            rows[rid] = Result(n, result, cmd.group(1).strip())
    return rows, problems


def check_counts(root: Path, files: list[Path], counters: dict[str, Callable[[Path], int]] = COUNTERS) -> list[Problem]:
    problems: list[Problem] = []
    cache: dict[str, int | str] = {}
    for path in files:
        rel, text = path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")
        for m in marked(text, "count"):
            if m.name not in counters:
                problems.append(Problem(rel, m.line, f"unknown count {m.name!r}; known: {', '.join(sorted(counters))}"))
                continue
            if m.name not in cache:
                try:
                    cache[m.name] = counters[m.name](root)
                except CountUnavailable as e:
                    cache[m.name] = str(e)
            actual = cache[m.name]
            if isinstance(actual, str):
                problems.append(
                    Problem(rel, m.line, f"count {m.name} cannot be computed ({actual}); do not state it yet")
                )
            elif m.value != str(actual):
                problems.append(
                    Problem(rel, m.line, f"count {m.name} is written {m.value!r} but the code has {actual}")
                )
        for n, line in prose_lines(text):
            line = strip_markers(line, "count")
            for pattern, name in _UNMARKED_COUNT:
                for hit in pattern.finditer(line):
                    problems.append(
                        Problem(
                            rel,
                            n,
                            f"count {hit.group(0)!r} is not backed by code; "
                            f"write <!-- count:{name} -->N<!-- /count --> instead",
                        )
                    )
    return problems


def check_perf(root: Path, files: list[Path]) -> list[Problem]:
    rows, problems = read_results(root)
    for path in files:
        rel, text = path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for m in marked(text, "perf"):
            row = rows.get(m.name)
            if row is None:
                problems.append(Problem(rel, m.line, f"figure {m.name!r} has no row in {RESULTS}"))
                continue
            if m.value != row.result:
                problems.append(
                    Problem(
                        rel,
                        m.line,
                        f"figure {m.name} is written {m.value!r} but {RESULTS}:{row.line} records {row.result!r}",
                    )
                )
            if f"`{row.command}`" not in _context(lines, m.line):
                problems.append(
                    Problem(
                        rel,
                        m.line,
                        f"figure {m.name} must name its benchmark command `{row.command}` on the same row or paragraph",
                    )
                )
        for n, line in prose_lines(text):
            for hit in _UNMARKED_PERF.finditer(strip_markers(line, "perf")):
                problems.append(
                    Problem(
                        rel,
                        n,
                        f"performance figure {hit.group(0)!r} is not backed by {RESULTS}; "
                        f"write <!-- perf:ID -->VALUE<!-- /perf --> with its command",
                    )
                )
    return problems


def _context(lines: list[str], line: int) -> str:
    """A table row on its own, otherwise the paragraph (non-blank lines) around `line`."""
    i = line - 1
    if lines[i].lstrip().startswith("|"):
        return lines[i]
    lo, hi = i, i
    while lo > 0 and lines[lo - 1].strip():
        lo -= 1
    while hi + 1 < len(lines) and lines[hi + 1].strip():
        hi += 1
    return "\n".join(lines[lo : hi + 1])
