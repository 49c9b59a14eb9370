"""Tests as evidence: does a named test exist, and did it run and pass in this suite?

A feature names its tests as pytest node ids (`tests/unit/test_x.py::test_y`, with an
optional class, or a parametrised id `test_y[a]`) or as whole files (`tests/unit/test_x.py`).
Whether they passed is read from the JUnit XML that `scripts/run-tests.sh` writes, so the
claim is proven by the very run that `make test` just did, not by a run someone remembers.
"""

from __future__ import annotations

import ast
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

JUNIT = ".reports/junit.xml"


@dataclass(frozen=True)
class Case:
    classname: str
    name: str
    outcome: str  # passed | failed | skipped


def read_junit(path: Path) -> list[Case]:
    """Every testcase in a pytest JUnit report. Raises ValueError naming the file if unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        raise ValueError(f"{path}: cannot read JUnit XML: {e}") from e
    cases = []
    for tc in root.iter("testcase"):
        if tc.find("failure") is not None or tc.find("error") is not None:
            outcome = "failed"
        elif tc.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        cases.append(Case(tc.get("classname", ""), tc.get("name", ""), outcome))
    return cases


def split_node_id(test: str) -> tuple[str, list[str]]:
    """`tests/unit/test_x.py::C::t[p]` -> ("tests/unit/test_x.py", ["C", "t[p]"])."""
    file, *rest = test.split("::")
    return file, rest


def exists(root: Path, test: str) -> str | None:
    """None when the file (and the named class/function) exists, else why not."""
    file, rest = split_node_id(test)
    path = root / file
    if not file.endswith(".py") or not path.is_file():
        return f"test file {file} does not exist"
    if not rest:
        return None
    names = _defined(path, path.stat().st_mtime_ns)
    want = "::".join(r.split("[", 1)[0] for r in rest)
    return None if want in names else f"{file} defines no test {want}"


@lru_cache(maxsize=512)
def _defined(path: Path, _mtime: int) -> frozenset[str]:
    """Top-level functions and classes, and `Class::method`, defined in a Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(
                f"{node.name}::{m.name}" for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
    return frozenset(names)


def outcome(cases: list[Case], test: str) -> str:
    """passed | failed | skipped | absent, for a node id or a whole file.

    Every matching case must pass: one skipped or failed case makes the claim unproven.
    """
    file, rest = split_node_id(test)
    module = file[: -len(".py")].replace("/", ".")
    if rest:
        cls = ".".join([module, *rest[:-1]])
        name = rest[-1]
        hits = [
            c
            for c in cases
            if c.classname == cls and (c.name == name or ("[" not in name and c.name.startswith(name + "[")))
        ]
    else:
        hits = [c for c in cases if c.classname == module or c.classname.startswith(module + ".")]
    if not hits:
        return "absent"
    for bad in ("failed", "skipped"):
        if any(c.outcome == bad for c in hits):
            return bad
    return "passed"
