"""`furlong bench NAME [args...]`: run one of the repository's benchmarks by name.

A benchmark is a script `benchmarks/NAME.py` that runs two systems side by side and prints
ratios (DESIGN §5); `furlong bench NAME --flag` is `python benchmarks/NAME.py --flag` run from
the repository root with this Python, so it measures the furlong that is installed here.
`furlong bench --list` names them with their first docstring line.

The benchmarks live in the source repository, not in the wheel: they are looked for next to the
package (a clone, or an editable install of one), then in the current directory. Without either,
the error says so instead of failing on a missing file.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import subprocess
import sys
from pathlib import Path

FOLDER = "benchmarks"


class BenchError(Exception):
    """No benchmarks folder, or no benchmark of that name; the message says which and what exists."""


def candidates() -> list[Path]:
    """Where a benchmarks folder may be, in order: beside the package's source tree, then the current directory."""
    return [Path(__file__).resolve().parents[1] / FOLDER, Path.cwd() / FOLDER]


def find_folder(places: list[Path] | None = None) -> Path:
    places = candidates() if places is None else places
    for place in places:
        if place.is_dir():
            return place
    looked = ", ".join(str(p) for p in places)
    raise BenchError(
        f"no {FOLDER}/ folder (looked in {looked}): the benchmarks ship with the source "
        "repository, not the installed package; run `furlong bench` from a clone of furlong"
    )


def _tree(script: Path) -> ast.Module | None:
    try:
        return ast.parse(script.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _is_script(tree: ast.Module | None) -> bool:
    """Has a module-level `if __name__ == "__main__":`; the folder's shared helpers (rl_bench.py) do not."""
    return tree is not None and any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        for node in tree.body
    )


def available(folder: Path) -> dict[str, Path]:
    """Benchmark name -> script: every runnable `*.py` of the folder (not `_private`, not a shared helper)."""
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    return {p.stem: p for p in scripts if _is_script(_tree(p))}


def summary(script: Path) -> str:
    """The first line of a script's docstring, read without running it."""
    tree = _tree(script)
    doc = ast.get_docstring(tree) if tree is not None else None
    return doc.strip().splitlines()[0] if doc else ""


def script_for(name: str, folder: Path) -> Path:
    """The script of benchmark `name` (`name.py` accepted); BenchError naming the known ones otherwise."""
    known = available(folder)
    stem = name[: -len(".py")] if name.endswith(".py") else name
    if stem in known:
        return known[stem]
    hint = difflib.get_close_matches(stem, list(known), n=1)
    raise BenchError(
        f"no benchmark {name!r} in {folder}"
        + (f" (did you mean {hint[0]!r}?)" if hint else "")
        + f"; known: {', '.join(known) or 'none'}"
    )


def listing(folder: Path) -> str:
    scripts = available(folder)
    width = max((len(n) for n in scripts), default=0)
    lines = [f"benchmarks in {folder} (run one with `furlong bench NAME [args...]`):"]
    lines += [f"  {name:<{width}}  {summary(path)}".rstrip() for name, path in scripts.items()]
    return "\n".join(lines)


def run(name: str, args: list[str], folder: Path) -> int:
    """Run benchmark `name` with `args` in a child of this Python, from the repository root; its exit status."""
    script = script_for(name, folder)
    try:
        return subprocess.run([sys.executable, str(script), *args], cwd=folder.parent).returncode
    except KeyboardInterrupt:  # the child got the same Ctrl-C; do not print a traceback of our own
        return 130


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="furlong bench",
        description="Run a benchmark from the repository's benchmarks/ folder by name; "
        "arguments after NAME go to the benchmark (`furlong bench NAME --help` shows its own).",
    )
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("name", nargs="?", metavar="NAME", help="a benchmark: benchmarks/NAME.py")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="...", help="passed to the benchmark")
    return p


def main(argv: list[str] | None = None, places: list[Path] | None = None) -> int:
    """`places`: where to look for the benchmarks folder (default `candidates()`)."""
    opts = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        folder = find_folder(places)
        if opts.list or opts.name is None:
            print(listing(folder), file=sys.stdout if opts.list else sys.stderr)
            return 0 if opts.list else 2
        return run(opts.name, opts.args, folder)
    except BenchError as e:
        print(f"furlong bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
