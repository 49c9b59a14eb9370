"""Helpers for the chaos tests. Chaos runs: real `furlong train` runs (Ray, trainer actor, engine processes, router) driven in-process.

Each test builds a config from recipes/debug.yaml plus overrides, runs it with
`run_with_restarts` (what `furlong train` runs), and injects faults through the
plug points in `chaos_plugins.py` or from outside.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The trainer's Ray workers import `chaos_plugins` (before_train_step) too: they inherit this environment.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)

# Short health checks so hung engines are found quickly; one trainer rank, tiny model, no TensorBoard.
BASE = [
    "router.health_interval_s=0.5",
    "router.health_timeout_s=3",
    "router.unhealthy_after=2",
    "observe.tensorboard=false",
    "data.n_eval=2",
    "cluster.threads_per_process=1",
]


def chaos_config(run_dir: Path, *overrides: str) -> Any:
    from furlong.config import load_config

    return load_config(str(ROOT / "recipes" / "debug.yaml"), [*BASE, f"run_dir={run_dir}", *overrides])


def run(cfg: Any, side: Any = None) -> dict[str, Any]:
    """Run to the end (through the same restart wrapper as `furlong train`); `side(run)` runs alongside."""
    from furlong.driver.restarts import run_with_restarts
    from furlong.driver.run import Run

    async def main() -> dict[str, Any]:
        r = Run(cfg, progress=False)
        task = asyncio.create_task(side(r)) if side else None
        try:
            return await run_with_restarts(r)
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    return asyncio.run(main())


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
