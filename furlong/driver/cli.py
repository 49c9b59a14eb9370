"""`furlong train RECIPE [key=value ...]` and `furlong train --resume RUN_DIR`: the RL driver.

The command line only: it loads the config, builds a `Run` and runs it under the restart policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any


def load_run_config(run_dir: str | Path, overrides: list[str]) -> Any:
    """The resolved config a run directory was started with, plus `overrides`."""
    from furlong.config import load_config

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise SystemExit(f"--resume: {path} does not exist (not a furlong run directory)")
    return load_config(str(path), overrides)


def main(argv: list[str]) -> int:
    from furlong.config import ConfigError, load_config
    from furlong.driver.restarts import RunStopped, run_with_restarts
    from furlong.driver.run import Run

    p = argparse.ArgumentParser(prog="furlong train", description=__doc__.split("\n")[0])
    p.add_argument("recipe", nargs="?", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n_samples_per_prompt=8")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its directory alone")
    args = p.parse_args(argv)
    overrides = list(args.overrides)
    if args.recipe and "=" in args.recipe:
        overrides.insert(0, args.recipe)
        args.recipe = None
    try:
        cfg = load_run_config(args.resume, overrides) if args.resume else load_config(args.recipe, overrides)
    except ConfigError as e:
        print(f"furlong train: {e}", file=sys.stderr)
        return 2
    run = Run(cfg, resume=bool(args.resume))

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        result = asyncio.run(run_with_restarts(run))  # a dead trainer: clean stop, or auto-restart
    except ConfigError as e:  # a plug point that does not load or fit, found when the run starts
        print(f"furlong train: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:
        print(f"furlong train: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("furlong train: interrupted; the run can continue with --resume " + str(run.run_dir), file=sys.stderr)
        return 130
    print(json.dumps({k: result[k] for k in ("steps", "before", "after", "minutes", "run_dir")}, default=str))
    return 0
