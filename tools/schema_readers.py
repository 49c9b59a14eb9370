"""Which settings of the config schema something in furlong reads, found from the source with `ast`.

A setting nobody reads is a knob that silently does nothing; `tests/unit/test_schema_readers.py`
fails on any. `python -m tools.schema_readers` prints the unread ones (`--by-name` with the looser
rule below, for comparison).

What counts as a read of `section.field`, in any module of furlong/ outside furlong/config/ (config
declares and validates the fields; it does not use them):

- `x.field` or `getattr(x, "field")` where `x` *is* that section: a name or attribute annotated with
  the section's class (`cfg: EngineConfig`, `self.algo: AlgoConfig`), one assigned from such a value
  (`ro = cfg.rollout`, `self.algo = algo_cfg`), the section reached from a whole config
  (`cfg.engine`, where `cfg: Config` or `cfg = load_config(...)`), or a call of a function whose
  return annotation is the section's class. Aliases are followed within one module.
- the dotted path itself as a string constant (`loaded["train.loss_fn"]`), as plug points are looked
  up in the result of `registry.load_all`.

Two tables of `furlong/config/checks.py`, read from its source (module-level literals, found with
`ast`; no list of names is kept here), count too, though config/ is otherwise no reader:

- `NOT_BUILT`: a field whose feature is not built yet is refused at start, naming it. It is no silent
  knob (the user is told), so each field a row names counts as read; delete the row when the
  feature lands and the scan then asks for a real reader.
- `DEFAULTS_FROM`: `(field, source)`, where an unset `field` takes `source`'s value in `resolve`
  (`model.dtype` gives `train.dtype` and `engine.dtype`). `source` counts as read when `field` is:
  what reads the field reads the source through it.

Matching the field's name on *any* object (`--by-name`) is too loose: the engine's own attributes
`max_context` and `prefix_cache` would hide that `engine.max_context` never reaches an engine.
A section (`train`, `train.lora`) counts as read when one of its fields is.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "furlong"
NOT_READERS = ("config",)  # folders of furlong/ whose mentions of a field do not count
CHECKS = ("config", "checks.py")  # where NOT_BUILT and DEFAULTS_FROM live, under the package


def sections(model: Any, prefix: str = "") -> dict[str, type]:
    """Dotted prefix -> section class, the root (`""`) included, for `model` and every nested section."""
    from furlong.config.schema import section_type

    out = {prefix: model}
    for name, info in model.model_fields.items():
        sub = section_type(info.annotation)
        if sub is not None:
            out.update(sections(sub, f"{prefix}{name}."))
    return out


def _python_files(package: Path, exclude: tuple[str, ...]) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts or path.relative_to(package).parts[0] in exclude:
            continue
        yield path, _parse(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _parse(path: Path, mtime_ns: int) -> ast.Module:
    """Parsed once per version of a file (the trees are only read)."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _terminal(node: ast.AST) -> str | None:
    """The last name of a receiver: `cfg` -> cfg, `self.algo` -> algo."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _named_classes(annotation: ast.AST | None, by_class: dict[str, list[str]]) -> set[str]:
    """Prefixes whose section class an annotation names (`EngineConfig | None`, `"AlgoConfig"`)."""
    found: set[str] = set()
    for node in ast.walk(annotation) if annotation is not None else ():
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                found |= _named_classes(ast.parse(node.value, mode="eval"), by_class)
            except SyntaxError:
                pass
        name = _terminal(node)
        if name in by_class:
            found.update(by_class[name])
    return found


class _Scan:
    """Aliases of each section, found to a fixed point over every module, and the fields read through them.

    Plain names (`ro`, a parameter `cfg`) are aliases within their module; attributes (`self.algo`, a
    dataclass field `config: RolloutConfig`) are aliases in every module, since objects travel.
    """

    def __init__(self, trees: list[ast.Module], tables: dict[str, Any]):
        self.trees, self.t = trees, tables
        self.bindings = [list(self._bindings(tree)) for tree in trees]
        self.local: list[dict[str, set[str]]] = [{} for _ in trees]  # per module: name -> prefixes
        self.attrs: dict[str, set[str]] = {}  # attribute name -> prefixes, package-wide
        self.names: dict[str, set[str]] = {}  # the module being walked's `local`

    def denotes(self, node: ast.AST) -> set[str]:
        """The section prefixes an expression stands for."""
        if isinstance(node, ast.Name):
            return set(self.names.get(node.id, ()))
        found: set[str] = set()
        if isinstance(node, ast.Attribute):
            found |= self.attrs.get(node.attr, set())
            found |= {f"{p}{node.attr}." for p in self.denotes(node.value) if f"{p}{node.attr}." in self.t["all"]}
        elif isinstance(node, ast.Call):
            callee = _terminal(node.func) or ""
            found |= self.t["returns"].get(callee, set()) | set(self.t["by_class"].get(callee, ()))
            if callee in ("from_dict", "model_validate", "model_copy") and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                found |= self.denotes(owner) | set(self.t["by_class"].get(_terminal(owner) or "", ()))
        return found

    def _bind(self, target: ast.AST, prefixes: set[str], attribute: bool) -> bool:
        if isinstance(target, ast.Attribute):
            table, name = self.attrs, target.attr
        elif isinstance(target, ast.Name):
            table, name = (self.attrs if attribute else self.names), target.id
        else:
            return False
        if not prefixes or prefixes <= table.get(name, set()):
            return False
        table.setdefault(name, set()).update(prefixes)
        return True

    def _bindings(self, tree: ast.Module) -> Iterator[tuple[ast.AST, ast.AST | None, ast.AST | None, bool]]:
        """(target, value, annotation, is an attribute) of each assignment, annotated name and parameter."""
        in_class = {id(stmt) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for stmt in node.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        yield from ((t, v, None, False) for t, v in zip(target.elts, node.value.elts))
                    else:
                        yield target, node.value, None, id(node) in in_class
            elif isinstance(node, ast.AnnAssign):
                yield node.target, node.value, node.annotation, id(node) in in_class
            elif isinstance(node, ast.NamedExpr):
                yield node.target, node.value, None, False
            elif isinstance(node, ast.arg):
                yield ast.Name(id=node.arg), None, node.annotation, False

    def find_aliases(self) -> None:
        changed = True
        while changed:  # to a fixed point: `a = cfg.rollout; b = a` binds b too, in any module order
            changed = False
            for bindings, names in zip(self.bindings, self.local):
                self.names = names
                for target, value, annotation, attribute in bindings:
                    prefixes = _named_classes(annotation, self.t["by_class"])
                    if value is not None:
                        prefixes |= self.denotes(value)
                    changed |= self._bind(target, prefixes, attribute)

    def reads(self) -> set[str]:
        out: set[str] = set()
        for tree, names in zip(self.trees, self.local):
            self.names = names
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute):
                    out |= {p + node.attr for p in self.denotes(node.value)}
                elif (
                    isinstance(node, ast.Call)
                    and _terminal(node.func) == "getattr"
                    and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)
                ):
                    out |= {p + node.args[1].value for p in self.denotes(node.args[0])}
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in self.t["fields"]:
                    out.add(node.value)
        return out


def _tables(model: Any, package: Path) -> dict[str, Any]:
    """What the scan matches against: section prefixes, class names, dotted fields, functions' returns."""
    from pydantic import BaseModel

    from furlong.config.schema import Section, all_paths

    by_prefix = sections(model)
    by_class: dict[str, list[str]] = {}  # class name -> prefixes; a subclass's readers annotate its base too
    for prefix, cls in by_prefix.items():
        for klass in cls.__mro__:
            if klass in (Section, BaseModel) or not issubclass(klass, BaseModel):
                break
            by_class.setdefault(klass.__name__, []).append(prefix)
    t: dict[str, Any] = {"all": set(by_prefix), "by_class": by_class, "fields": set(all_paths(model))}
    returns: dict[str, set[str]] = {}  # function name -> sections its return annotation names
    for _, tree in _python_files(package, ()):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
                found = _named_classes(node.returns, by_class)
                if found:
                    returns.setdefault(node.name, set()).update(found)
    t["returns"] = returns
    return t


def _table(package: Path, name: str) -> list[tuple[Any, ...]]:
    """The rows of a module-level tuple/list literal `name` in config/checks.py (a row's non-constants are None)."""
    path = package.joinpath(*CHECKS)
    if not path.is_file():
        return []
    for node in _parse(path, path.stat().st_mtime_ns).body:
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            else (node.target if isinstance(node, ast.AnnAssign) else None)
        )
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Tuple | ast.List):
            return [
                tuple(e.value if isinstance(e, ast.Constant) else None for e in row.elts)
                for row in node.value.elts
                if isinstance(row, ast.Tuple | ast.List)
            ]
    return []


def _told_or_derived(found: set[str], package: Path, fields: set[str]) -> set[str]:
    """`found` plus the fields `NOT_BUILT` refuses and the `DEFAULTS_FROM` sources of read fields."""
    out = found | {row[0] for row in _table(package, "NOT_BUILT") if row and row[0] in fields}
    pairs = [(row[0], row[1]) for row in _table(package, "DEFAULTS_FROM") if len(row) == 2 and row[1] in fields]
    size = -1
    while size != len(out):  # to a fixed point: a source may itself be another field's source
        size = len(out)
        out |= {source for field, source in pairs if field in out}
    return out


def unread_fields(model: Any = None, package: Path = PACKAGE, exclude: tuple[str, ...] = NOT_READERS) -> list[str]:
    """Dotted fields of the schema (default `furlong.config.schema.Config`) that nothing reads, in schema order."""
    from furlong.config.schema import Config, all_paths

    model = model or Config
    tables = _tables(model, package)
    scan = _Scan([tree for _, tree in _python_files(package, exclude)], tables)
    scan.find_aliases()
    found = _told_or_derived(scan.reads(), package, tables["fields"])
    for path in list(found):  # a section is read when one of its fields is
        parts = path.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return [p for p in all_paths(model) if p not in found]


def unread_by_name(model: Any = None, package: Path = PACKAGE, exclude: tuple[str, ...] = NOT_READERS) -> list[str]:
    """The looser rule, for comparison: a field is read when any `x.<name>` or `getattr(x, "<name>")` exists."""
    from furlong.config.schema import Config, all_paths

    names: set[str] = set()
    for _, tree in _python_files(package, exclude):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and _terminal(node.func) == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                names.add(node.args[1].value)
    return [p for p in all_paths(model or Config) if p.rsplit(".", 1)[-1] not in names]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    unread = unread_by_name() if "--by-name" in argv else unread_fields()
    print(f"{len(unread)} setting(s) nothing reads" + (":" if unread else ""))
    print("".join(f"  {p}\n" for p in unread), end="")
    return 1 if unread else 0


if __name__ == "__main__":
    sys.exit(main())
