"""The `furlong` command: a thin dispatcher.

Each sub-command lives in the module that owns it and exposes `main(argv) -> int`.
Imports are lazy so `furlong doctor` does not pay for torch, and one broken
sub-system cannot stop the others from running.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

# name -> ("module:function", one-line help). Order is the order shown in --help.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("furlong.demo:main", "build a small model and show it learning (what `make demo` runs)"),
    "train": ("furlong.driver.cli:main", "run a recipe: furlong train RECIPE [key=value ...]"),
    "serve": ("furlong.engine.cli:main", "start the built-in engine HTTP server"),
    "router": ("furlong.router.cli:main", "start the router in front of engine servers"),
    "dashboard": ("furlong.dashboard.cli:main", "serve the dashboard of a run directory"),
    "bench": ("furlong.bench:main", "run a benchmark from benchmarks/"),
    "profile": ("furlong.profile:main", "furlong profile RECIPE: a few steps under torch.profiler, one trace"),
    "doctor": ("furlong.doctor:main", "check versions, threads, devices and the run directory"),
    "config": ("furlong.config.cli:main", "furlong config show RECIPE [key=value ...]"),
    "plugins": ("furlong.config.cli:plugins_main", "list every plug point with its signature"),
    "models": ("furlong.models.cli:main", "furlong models create --arch A --size S --out DIR"),
    "tito": ("furlong.models.tito_check:main", "furlong tito check MODEL_DIR: does the chat template continue TITO"),
    "export": ("furlong.train.export:main", "furlong export RUN_DIR --hf OUT"),
    "envs": ("furlong.envs.cli:main", "manage agent-environment connectors"),
}


def _available() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (target, help_) in COMMANDS.items():
        try:
            found = importlib.util.find_spec(target.split(":")[0]) is not None
        except ModuleNotFoundError:  # the parent package is not there yet
            found = False
        if found:
            out[name] = (target, help_)
    return out


def usage() -> str:
    lines = ["usage: furlong COMMAND [args]", "", "commands:"]
    for name, (_, help_) in _available().items():
        lines.append(f"  {name:<10} {help_}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from furlong import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    available = _available()
    if name not in available:
        import difflib

        hint = difflib.get_close_matches(name, list(available), n=1)
        print(f"furlong: unknown command {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""), file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    module, func = available[name][0].split(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
