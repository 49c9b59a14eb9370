"""`docs/features.yaml`: the one file that says what furlong can do, and where it is proven.

Each feature has a status (working | partial | planned), a doc page and anchor, an example
(a recipe or an examples/ folder) and the tests that prove it. The README feature table is
generated from this file, so a status changes in exactly one place. Loaded with line numbers
so every complaint points at the line to edit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tools.claims import Problem
from tools.claims.evidence import Case, exists, outcome
from tools.claims.markdown_scan import anchors_of_file, marked

MANIFEST = "docs/features.yaml"
README = "README.md"
BEGIN, END = "<!-- features:begin -->", "<!-- features:end -->"
TABLES = {README: False, "docs/index.md": True}  # file -> rendered for the docs site
REGENERATE = "edit the manifest and run `python -m tools.claims --write-readme`"
STATUSES = ("working", "partial", "planned")
KEYS = {"id", "name", "status", "doc", "example", "tests"}


@dataclass
class Feature:
    line: int
    id: str
    name: str
    status: str
    doc: str
    example: str | None
    tests: list[str] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)  # key (or a test id) -> line of its value

    def at(self, key: str) -> int:
        return self.lines.get(key, self.line)


def load(root: Path) -> tuple[list[Feature], list[Problem]]:
    """Parse the manifest; structural problems are returned, not raised."""
    path = root / MANIFEST
    if not path.exists():
        return [], [Problem(MANIFEST, 0, "missing")]
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        return [], [Problem(MANIFEST, mark.line + 1 if mark else 0, f"not valid YAML: {e}")]
    top = _mapping(node)
    if top is None or "features" not in top or not isinstance(top["features"][1], yaml.SequenceNode):
        return [], [Problem(MANIFEST, 1, "must be a mapping with a `features:` list")]
    features: list[Feature] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for item in top["features"][1].value:
        line = item.start_mark.line + 1
        entry = _mapping(item)
        if entry is None:
            problems.append(Problem(MANIFEST, line, "each feature must be a mapping"))
            continue
        for key in sorted(set(entry) - KEYS):
            problems.append(
                Problem(MANIFEST, entry[key][0], f"unknown key {key!r}; allowed: {', '.join(sorted(KEYS))}")
            )
        values = {k: yaml.safe_load(yaml.serialize(v)) for k, (_, v) in entry.items()}
        f = Feature(
            line=line,
            id=str(values.get("id") or ""),
            name=str(values.get("name") or ""),
            status=str(values.get("status") or ""),
            doc=str(values.get("doc") or ""),
            example=values.get("example") or None,
            tests=values.get("tests") or [],
            lines={k: v.start_mark.line + 1 for k, (_, v) in entry.items()},
        )
        tests_node = entry.get("tests", (0, None))[1]
        if isinstance(tests_node, yaml.SequenceNode):
            f.lines.update(
                {str(t.value): t.start_mark.line + 1 for t in tests_node.value if isinstance(t, yaml.ScalarNode)}
            )
        for key in ("id", "name", "status", "doc"):
            if not values.get(key):
                problems.append(Problem(MANIFEST, line, f"feature {f.id or f.name or '?'}: `{key}` is required"))
        if f.id and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", f.id):
            problems.append(Problem(MANIFEST, f.at("id"), f"id {f.id!r} must be lower-case words joined by '-'"))
        if f.id in seen:
            problems.append(Problem(MANIFEST, f.at("id"), f"id {f.id!r} repeats line {seen[f.id]}"))
        seen.setdefault(f.id, f.line)
        if f.status and f.status not in STATUSES:
            problems.append(
                Problem(
                    MANIFEST, f.at("status"), f"feature {f.id}: status {f.status!r} is not one of {', '.join(STATUSES)}"
                )
            )
        if not isinstance(f.tests, list) or not all(isinstance(t, str) for t in f.tests):
            problems.append(
                Problem(MANIFEST, f.at("tests"), f"feature {f.id}: `tests` must be a list of pytest node ids or files")
            )
            f.tests = []
        features.append(f)
    return features, problems


def _mapping(node: yaml.Node) -> dict[str, tuple[int, yaml.Node]] | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    return {str(k.value): (k.start_mark.line + 1, v) for k, v in node.value}


def check_features(
    root: Path, features: list[Feature], cases: list[Case] | None, partial_run: bool = False
) -> list[Problem]:
    """Doc anchors, examples and tests of every feature; test outcomes when `cases` is given.

    `partial_run`: the JUnit report covers only part of the suite, so a test absent from it
    is not an error (one that ran must still have passed).
    """
    problems: list[Problem] = []
    for f in features:

        def bad(key: str, msg: str, f: Feature = f) -> None:
            problems.append(Problem(MANIFEST, f.at(key), f"feature {f.id} ({f.status}): {msg}"))

        if f.doc:
            page, _, anchor = f.doc.partition("#")
            target = root / "docs" / page
            if not anchor:
                bad("doc", f"doc {f.doc!r} must name an anchor: page.md#section")
            elif not target.is_file():
                bad("doc", f"doc page docs/{page} does not exist")
            elif anchor not in anchors_of_file(target):
                bad("doc", f"doc docs/{page} has no anchor #{anchor}")
        if f.example and not (root / f.example).exists():
            bad("example", f"example {f.example} does not exist")
        for test in f.tests:
            why = exists(root, test)
            if why:
                bad(test, why)
            elif cases is not None and f.status != "planned":
                result = outcome(cases, test)
                if result == "absent" and partial_run:
                    continue
                if result != "passed":
                    bad(
                        test,
                        f"test {test} {'did not run' if result == 'absent' else result} in this suite's JUnit report",
                    )
        if f.status == "working":
            if not f.example:
                bad("example", "a working feature must name an example (a recipe or an examples/ folder)")
            if not f.tests:
                bad("tests", "a working feature must name the tests that prove it")
    return problems


def render_table(features: list[Feature], for_docs: bool = False) -> str:
    """The feature table, generated from the manifest.

    The README's table links the doc section, the example and the test files; the docs
    index (`for_docs`) links only doc sections, since the site holds nothing outside docs/.
    """
    if for_docs:
        rows = ["| feature | status |", "|---|---|"]
        rows += [f"| [{f.name}]({f.doc}) | {f.status} |" for f in features]
        return "\n".join(rows)
    rows = ["| feature | status | example | tests |", "|---|---|---|---|"]
    for f in features:
        example = f"[`{f.example}`]({f.example})" if f.example else "—"
        files = list(dict.fromkeys(t.split("::", 1)[0] for t in f.tests))
        tests = ", ".join(f"[`{Path(t).name}`]({t})" for t in files) or "—"
        rows.append(f"| [{f.name}](docs/{f.doc}) | {f.status} | {example} | {tests} |")
    return "\n".join(rows)


def with_table(text: str, features: list[Feature], for_docs: bool = False) -> str:
    """`text` with the block between the feature markers regenerated."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + render_table(features, for_docs) + "\n" + text[end:]


def check_tables(root: Path, features: list[Feature]) -> list[Problem]:
    """The generated tables in README.md and docs/index.md equal what the manifest gives."""
    problems = []
    for rel, for_docs in TABLES.items():
        path = root / rel
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
            problems.append(Problem(rel, 0, f"needs the generated feature table between {BEGIN} and {END}"))
            continue
        have, want = text.splitlines(), with_table(text, features, for_docs).splitlines()
        diff = next((n for n, (a, b) in enumerate(zip(have, want), 1) if a != b), None)
        if diff is not None:
            problems.append(
                Problem(
                    rel,
                    diff,
                    f"feature table differs from {MANIFEST}: found {have[diff - 1]!r}, "
                    f"expected {want[diff - 1]!r}; {REGENERATE}",
                )
            )
        elif len(have) != len(want):
            n = min(len(have), len(want)) + 1
            problems.append(
                Problem(rel, n, f"feature table differs from {MANIFEST} in its number of rows; {REGENERATE}")
            )
    return problems


def check_status_markers(root: Path, features: list[Feature], files: list[Path]) -> list[Problem]:
    """`<!-- status:ID -->planned<!-- /status -->` in a page must equal the manifest's status."""
    by_id = {f.id: f for f in features}
    problems = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        for m in marked(path.read_text(encoding="utf-8"), "status"):
            f = by_id.get(m.name)
            if f is None:
                problems.append(Problem(rel, m.line, f"status of unknown feature {m.name!r}: not in {MANIFEST}"))
            elif m.value != f.status:
                problems.append(
                    Problem(
                        rel,
                        m.line,
                        f"says feature {m.name} is {m.value!r} but {MANIFEST}:{f.at('status')} says {f.status!r}",
                    )
                )
    return problems
