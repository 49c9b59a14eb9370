"""The floor plan of DESIGN §4, measured from the source: imports between folders, sizes, dead settings.

Everything here reads `furlong/` with `ast` (nothing of furlong is imported), so a violation is found
even in a module that cannot be imported yet. `tests/unit/test_architecture.py` asserts on these
lists; `python -m tools.layout` prints them all, with the settings nothing reads
(`tools/schema_readers.py`), for a person fixing them.

Units: each folder of `furlong/` (`core`, `config`, ...) is one unit; each top-level module
(`cli.py`, `demo.py`, ...) is a unit of its own on the top floor; `furlong/__init__.py` is the unit
`furlong`, the package root below every floor (it holds the version and imports nothing).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "furlong"

# DESIGN §4, from the ground up: a unit may import only units on a lower floor.
FLOORS = (
    "core",
    "config",
    "data",
    "models",
    "weights",
    "engine",
    "router",
    "train",
    "rollout",
    "envs",
    "rewards",
    "cluster",
    "observe",
    "dashboard",
    "driver",
)
TOP_FLOOR = len(FLOORS)  # the top-level modules: cli.py, demo.py, doctor.py, bench.py
ROOT_UNIT = "furlong"  # furlong/__init__.py
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100
BANNED_TEXT = 'acall("'  # string RPCs to the trainer; replaced by the typed TrainerGroup


@dataclass(frozen=True)
class Import:
    """One `import` statement naming a furlong module, wherever it sits (module level or in a function)."""

    file: str  # path relative to the repository, e.g. furlong/rollout/manager.py
    line: int
    source: str  # the importing unit
    target: str  # the imported unit
    module: str  # the imported module, dotted
    type_only: bool  # inside an `if TYPE_CHECKING:` block

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.source} -> {self.target} ({self.module})"


# ---------------------------------------------------------------- walking the package
def modules(package: Path = PACKAGE) -> Iterator[Path]:
    """Every Python file of the package, in a stable order."""
    yield from sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """`furlong.rollout.manager` -> `rollout`; `furlong.cli` -> `cli`; `furlong` -> `furlong`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_UNIT


def floor_of(unit: str, package: Path = PACKAGE) -> int | None:
    """The unit's floor; None for a folder DESIGN §4 does not place."""
    if unit == ROOT_UNIT:
        return -1
    if unit in FLOORS:
        return FLOORS.index(unit)
    if (package / f"{unit}.py").is_file():
        return TOP_FLOOR
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_only: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node below `node`, with whether it sits in the body of an `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield child.test, type_only
            for stmt in child.body:
                yield stmt, True
                yield from _walk(stmt, True)
            for stmt in child.orelse:
                yield stmt, type_only
                yield from _walk(stmt, type_only)
            continue
        yield child, type_only
        yield from _walk(child, type_only)


def _resolve_from(node: ast.ImportFrom, current: str, is_package: bool, package: Path) -> list[str]:
    """The furlong modules a `from X import a, b` names (`from furlong import cli` names furlong.cli)."""
    if node.level:
        base = current.split(".") if is_package else current.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    if stem.split(".")[0] != package.name:
        return []
    if stem != package.name:
        return [stem]
    out = []
    for alias in node.names:  # `from furlong import x`: a submodule when one exists, else the root
        sub = package / alias.name
        out.append(f"{stem}.{alias.name}" if sub.is_dir() or sub.with_suffix(".py").is_file() else stem)
    return out


def imports_of(path: Path, package: Path = PACKAGE) -> list[Import]:
    """Every import of a furlong module in one file, including imports inside functions."""
    current = module_name(path, package)
    source = unit_of(current)
    rel = path.relative_to(package.parent).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node, type_only in _walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == package.name]
        elif isinstance(node, ast.ImportFrom):
            names = _resolve_from(node, current, path.name == "__init__.py", package)
        else:
            continue
        for name in names:
            out.append(Import(rel, node.lineno, source, unit_of(name), name, type_only))
    return out


def all_imports(package: Path = PACKAGE) -> list[Import]:
    return [imp for path in modules(package) for imp in imports_of(path, package)]


# ---------------------------------------------------------------- rules on the import graph
def cycles(imports: Iterable[Import]) -> list[list[Import]]:
    """Groups of units that import each other (run-time imports only), each as the imports that close it.

    Strongly connected components of the unit graph (Tarjan); one list per component of two or more.
    """
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if not imp.type_only and imp.source != imp.target:
            edges.setdefault(imp.source, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for nxt in edges.get(unit, {}):
            if nxt not in index:
                visit(nxt)
                low[unit] = min(low[unit], low[nxt])
            elif nxt in stack:
                low[unit] = min(low[unit], index[nxt])
        if low[unit] == index[unit]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in sorted(edges):
        if unit not in index:
            visit(unit)
    return [[imp for src in comp for dst, imp in sorted(edges[src].items()) if dst in comp] for comp in found]


def leaf_violations(imports: Iterable[Import]) -> list[Import]:
    """core imports nothing else of furlong; config imports only core. Type-only imports count too."""
    allowed = {"core": {"core"}, "config": {"config", "core"}}
    return [imp for imp in imports if imp.source in allowed and imp.target not in allowed[imp.source]]


def floor_violations(imports: Iterable[Import], package: Path = PACKAGE) -> list[str]:
    """Imports of a unit on the same or a higher floor, and units DESIGN §4 does not place.

    Type-only imports count too: a lower floor that names an upper floor's types depends on it.
    """
    out = []
    for imp in imports:
        if imp.source == imp.target:
            continue
        src, dst = floor_of(imp.source, package), floor_of(imp.target, package)
        if src is None or dst is None:
            unplaced = imp.source if src is None else imp.target
            out.append(f"{imp}: folder {unplaced!r} has no floor in DESIGN §4")
        elif dst >= src:
            where = "the same floor as" if dst == src else "a floor above"
            out.append(f"{imp}: {imp.target} is on {where} {imp.source}")
    return out


# ---------------------------------------------------------------- sizes and banned text
def size_violations(package: Path = PACKAGE) -> list[str]:
    """Modules over MAX_MODULE_LINES lines and functions over MAX_FUNCTION_LINES (def line to last line)."""
    out = []
    for path in modules(package):
        rel = path.relative_to(package.parent).as_posix()
        text = path.read_text(encoding="utf-8")
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            out.append(f"{rel}: module has {n} lines (max {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(
                        f"{rel}:{node.lineno}: function {node.name} has {length} lines (max {MAX_FUNCTION_LINES})"
                    )
    return out


def banned_text(package: Path = PACKAGE, needle: str = BANNED_TEXT) -> list[str]:
    """`file:line` of each occurrence of `needle` in any text file of the package (like grep -rn)."""
    out = []
    for path in sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:  # a binary file
            continue
        rel = path.relative_to(package.parent).as_posix()
        out += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(lines, 1) if needle in line]
    return out


def report(package: Path = PACKAGE) -> dict[str, list[str]]:
    """Every rule's violations, by rule; each list empty when the layout holds."""
    from tools.schema_readers import unread_fields

    imps = all_imports(package)
    return {
        "import cycles between units": [" | ".join(map(str, c)) for c in cycles(imps)],
        "core / config importing other folders": list(map(str, leaf_violations(imps))),
        "floor order (DESIGN §4)": floor_violations(imps, package),
        "sizes": size_violations(package),
        f"{BANNED_TEXT!r} in furlong/": banned_text(package),
        "settings nothing reads": unread_fields(package=package),  # see tools/schema_readers.py
    }


def main() -> int:
    problems = 0
    for title, found in report().items():
        print(f"{title}: {len(found)}")
        print("".join(f"  {line}\n" for line in found), end="")
        problems += len(found)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
