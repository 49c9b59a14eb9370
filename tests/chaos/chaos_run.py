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

# Short health checks so hung engines are found quickly; one trainer rank, tiny model, no TensorBoard; every
# sync (and every re-sync of a replaced engine) verified by checksum against the trainer's weights.
BASE = [
    "weights.verify=true",
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


FIGURES = ROOT / ".reports" / "chaos"  # `python -m tools.reliability --write` turns these into docs/reliability.md


def record(name: str, result: dict[str, Any], **extra: Any) -> None:
    """Keep a chaos run's figures (the supervisor's fault log, the rollout accounting) for the reliability page.

    Written under `.reports/` (not tracked): a test never edits the docs; the tool does, on request.
    """
    FIGURES.mkdir(parents=True, exist_ok=True)
    keep = {
        "steps": result.get("steps"),
        "supervisor": result.get("supervisor"),
        "rollout": result.get("rollout_stats"),
    }
    (FIGURES / f"{name}.json").write_text(json.dumps({**keep, **extra}, indent=1, default=str))


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def trained_groups(run_dir: Path) -> dict[tuple[int, int], list[int]]:
    """The trained samples (`samples/step_*.jsonl`) by group: (prompt index, draw sequence) -> sample indices."""
    groups: dict[tuple[int, int], list[int]] = {}
    for f in sorted((run_dir / "samples").glob("step_*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                meta = json.loads(line)["metadata"]
                groups.setdefault((meta["prompt_index"], meta["seq"]), []).append(meta["sample_index"])
    return groups


def assert_each_group_trained_once(run_dir: Path, n_groups: int, n_per_group: int, one_epoch: bool = True) -> None:
    """Per-group accounting: `n_groups` distinct groups, each trained once with every sample index exactly once.

    Totals alone would pass a group trained twice and another never; this compares group by group.
    `one_epoch`: the run drew fewer prompts than the dataset holds, so no prompt may be trained twice either.
    """
    groups = trained_groups(run_dir)
    assert len(groups) == n_groups, f"{len(groups)} distinct groups trained, expected {n_groups}"
    twice = {g: idx for g, idx in groups.items() if sorted(idx) != list(range(n_per_group))}
    assert not twice, f"groups trained twice or incomplete (prompt index, seq) -> sample indices: {twice}"
    prompts = [p for p, _ in groups]
    assert not one_epoch or len(set(prompts)) == len(prompts), "a prompt was trained in two groups"
