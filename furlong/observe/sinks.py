"""Metric sinks: where each step's scalars go besides the event store.

A sink is anything with `log(step, metrics)` and `close()` (the `logging_sink` plug
point's `LoggingSink` protocol). The built-ins are console, JSONL and TensorBoard;
W&B and MLflow are built only when their package is installed — `build_sinks`
skips them with a log line otherwise (the config check already rejects
`observe.wandb=true` without wandb, so a skip here only happens when called directly).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from furlong.config.schema import ObserveConfig

log = logging.getLogger("furlong.observe")


class ConsoleSink:
    """One line per logged step (every `every` steps), most useful keys first."""

    FIRST = ("rollout/reward_mean", "reward", "loss/total", "policy/kl_ref", "policy/entropy")

    def __init__(self, every: int = 1, stream: TextIO | None = None, max_keys: int = 8):
        self.every, self.stream, self.max_keys = every, stream, max_keys

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if step % self.every or not metrics:
            return
        keys = [k for k in self.FIRST if k in metrics] + sorted(k for k in metrics if k not in self.FIRST)
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys[: self.max_keys])
        more = f" (+{len(keys) - self.max_keys})" if len(keys) > self.max_keys else ""
        print(f"step {step} | {shown}{more}", file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass


class JsonlSink:
    """`metrics.jsonl`: one JSON object per call, `{"step", "time", **metrics}`; easy to grep, and to load in pandas."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # imported only when asked for: it pulls in torch

        self._w = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: Mapping[str, Any] | None = None):
        import wandb

        self._run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=dict(config or {}))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    def __init__(self, experiment: str, run_dir: Path):
        import mlflow

        mlflow.set_experiment(experiment)
        self._mlflow = mlflow
        self._run = mlflow.start_run(run_name=run_dir.name)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        # MLflow metric names may not hold some characters furlong uses; '/' is allowed.
        self._mlflow.log_metrics(dict(metrics), step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def build_sinks(
    observe: ObserveConfig, run_dir: str | Path, *, console: bool = True, config: Mapping[str, Any] | None = None
) -> list[Any]:
    """The sinks an `observe` config section asks for (plug-point sinks in `observe.sinks` are the caller's)."""
    run_dir = Path(run_dir)
    sinks: list[Any] = [ConsoleSink(every=observe.log_every)] if console else []
    if observe.jsonl:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
    if observe.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    for flag, wanted, make in (
        ("wandb", observe.wandb, lambda: WandbSink(observe.project, run_dir, config)),
        ("mlflow", observe.mlflow, lambda: MlflowSink(observe.project, run_dir)),
    ):
        if not wanted:
            continue
        if importlib.util.find_spec(flag) is None:
            log.warning("observe.%s=true but %s is not installed: skipped", flag, flag)
        else:
            sinks.append(make())
    return sinks
