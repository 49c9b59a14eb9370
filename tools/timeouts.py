"""Audit: every test's pytest timeout covers the waits it hands its subprocesses and servers.

Why: pytest-timeout counts a test's fixtures and body together; when a test gives `furlong train` 900 s
(`subprocess.run(..., timeout=900)`) but runs under the global 300 s limit, a slow, loaded machine kills
the test from outside, with a thread dump instead of the subprocess's own clear error, and the failure
looks like a hang. This check reads the test files (no import, no run) and, per test function, adds up
the literal `timeout=` waits (≥ `MIN_WAIT` s: shorter ones are per-request HTTP timeouts) of

- the test body,
- module-level helper functions the body calls by name (one level, each call site once),
- the fixtures it takes by name that are defined in the same module (their setup runs inside the test's
  timeout; a module- or session-scoped fixture only for its first test, which is the one that matters),

and compares the sum with the test's effective limit: its own `@pytest.mark.timeout(N)`, else the module's
`pytestmark` timeout, else the global one in pyproject.toml. A wait inside a loop counts once (loops that
repeat a bounded wait say so with their own marker). `timeout=` values that are names bound to constants at
module level are resolved; anything else is skipped.

    python -m tools.timeouts [paths...]     # exit 1 and one line per test whose waits exceed its limit
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_WAIT = 30.0


@dataclass(frozen=True)
class Finding:
    path: Path
    test: str
    waits: float
    limit: float

    def __str__(self) -> str:
        return (
            f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}::{self.test}: "
            f"waits up to {self.waits:.0f} s but its pytest timeout is {self.limit:.0f} s "
            "(raise @pytest.mark.timeout to cover them)"
        )


def global_timeout(pyproject: Path = ROOT / "pyproject.toml") -> float:
    return float(tomllib.loads(pyproject.read_text())["tool"]["pytest"]["ini_options"].get("timeout", 0) or 0)


def _number(node: ast.AST, consts: dict[str, float]) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        a, b = _number(node.left, consts), _number(node.right, consts)
        if a is not None and b is not None:
            return a + b if isinstance(node.op, ast.Add) else a * b
    return None


def _marker_timeout(decorators: Iterable[ast.AST], consts: dict[str, float]) -> float | None:
    """N of `pytest.mark.timeout(N)` among decorators / a pytestmark value (a list or one marker)."""
    for d in decorators:
        if isinstance(d, ast.List | ast.Tuple):
            found = _marker_timeout(d.elts, consts)
            if found is not None:
                return found
        if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "timeout" and d.args:
            return _number(d.args[0], consts)
    return None


def _waits(fn: ast.AST, consts: dict[str, float], ms_methods: bool) -> tuple[float, list[str]]:
    """(sum of literal timeout= waits in `fn`, names of the functions it calls).

    `ms_methods`: the file drives Playwright, whose methods take milliseconds."""
    total, calls = 0.0, []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name):
            calls.append(node.func.id)
        for kw in node.keywords:
            if kw.arg == "timeout":
                v = _number(kw.value, consts)
                if v is not None and ms_methods and isinstance(node.func, ast.Attribute):
                    v /= 1000.0
                if v is not None and v >= MIN_WAIT:
                    total += v
    return total, calls


def audit_file(path: Path, default: float) -> list[Finding]:
    tree = ast.parse(path.read_text(), filename=str(path))
    consts: dict[str, float] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            v = _number(node.value, consts)
            if v is not None:
                consts[node.targets[0].id] = v
    module_limit = default
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_limit = _marker_timeout([node.value], consts) or default
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    fixtures = {
        name
        for name, fn in funcs.items()
        if any("fixture" in ast.unparse(d) for d in fn.decorator_list) and not name.startswith("test_")
    }
    ms = "playwright" in ast.unparse(tree)
    own = {name: _waits(fn, consts, ms) for name, fn in funcs.items()}
    shared = {name for name in fixtures if "scope=" in ast.unparse(funcs[name].decorator_list[0])}
    first_use: set[str] = set()  # a module/session fixture's setup runs inside its first test only

    def cost(name: str, seen: frozenset[str]) -> float:
        """Waits of `name`, the helpers it calls, and (for fixtures) the fixtures they take, recursively."""
        waits, calls = own[name]
        seen = seen | {name}
        for c in calls:
            if c in own and c not in seen and c not in fixtures:
                waits += cost(c, seen)
        for arg in funcs[name].args.args:
            if arg.arg in fixtures and arg.arg not in seen and arg.arg not in first_use:
                if arg.arg in shared:
                    first_use.add(arg.arg)
                waits += cost(arg.arg, seen)
        return waits

    findings = []
    for name, fn in funcs.items():
        if not name.startswith("test_"):
            continue
        limit = _marker_timeout(fn.decorator_list, consts) or module_limit
        total = cost(name, frozenset())
        if limit and total >= limit:
            findings.append(Finding(path, name, total, limit))
    return findings


def audit(paths: Iterable[Path], default: float | None = None) -> list[Finding]:
    default = global_timeout() if default is None else default
    out: list[Finding] = []
    for p in paths:
        files = sorted(p.rglob("test_*.py")) if p.is_dir() else [p]
        for f in files:
            out.extend(audit_file(f, default))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    findings = audit([Path(a) for a in args] or [ROOT / "tests"])
    for f in findings:
        print(f)
    print(f"{len(findings)} test(s) whose waits exceed their pytest timeout", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
