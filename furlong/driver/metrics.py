"""What the driver shows and records each step: a progress bar, a one-line summary, metrics.

Recording goes through the event store (`furlong.observe`): metrics reach its
sinks (`metrics.jsonl`, TensorBoard, W&B, MLflow as `observe` asks), spans and
samples with per-token provenance go to `events.sqlite` for the dashboard.
Rollout-side metrics (reward, lengths, staleness, statuses) are computed here
from the batch the trainer saw.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from furlong.config.schema import ObserveConfig


def rollout_metrics(batch: list[Any], version: int | None = None) -> dict[str, float]:
    rewards = [s.scalar_reward for s in batch if s.reward is not None]
    lengths = [s.response_length for s in batch]
    out = {
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
        "rollout/response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "rollout/samples": float(len(batch)),
        "rollout/truncated_frac": sum(str(getattr(s.status, "value", s.status)) == "truncated" for s in batch)
        / max(1, len(batch)),
    }
    parts: dict[str, list[float]] = {}
    for s in batch:  # a dict reward's other components (e.g. `used_tool`), averaged over the samples that have them
        if isinstance(s.reward, dict):
            for k, v in s.reward.items():
                if k != "score":
                    parts.setdefault(k, []).append(float(v))
    out.update({f"rollout/reward/{k}": statistics.fmean(v) for k, v in sorted(parts.items())})
    if version is not None:
        olds = [s.oldest_version() for s in batch if s.oldest_version() is not None]
        if olds:
            out["rollout/staleness_max"] = float(version - min(olds))
            out["rollout/staleness_mean"] = float(version - statistics.fmean(olds))
    return out


class MetricLog:
    """The driver's console and records: notes, progress, per-step metrics, trained samples.

    `observe` is the config's `observe` section, `config` the whole resolved config as a plain
    dict (what TensorBoard/W&B/MLflow store with the run), `extra_sinks` the sinks built from the
    `observe.sinks` plug point by the composition root.
    """

    def __init__(
        self,
        run_dir: Path,
        observe: ObserveConfig,
        config: dict[str, Any],
        tokenizer: Any = None,
        extra_sinks: list[Any] | None = None,
    ):
        from furlong.observe.sinks import build_sinks
        from furlong.observe.store import EventStore

        self.run_dir = Path(run_dir)
        sinks = build_sinks(observe, self.run_dir, console=False, config=config)
        sinks += list(extra_sinks or [])
        self.store = EventStore(self.run_dir, tokenizer=tokenizer, sinks=sinks, enabled=observe.event_store)
        self.tokens = 0
        self.console = None
        try:
            from rich.console import Console

            self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        except ImportError:
            pass

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.print(f"[dim]furlong[/] {text}")
        else:
            print(f"furlong {text}", file=sys.stderr)

    @contextlib.contextmanager
    def progress(self, title: str, total: int, start: int = 0) -> Iterator[Callable[[str], None]]:
        """A progress bar when on a terminal; one line per advance otherwise (CI logs stay readable)."""
        if self.console is not None and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(
                TextColumn(f"[bold]{title}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=self.console,
                transient=False,
            ) as bar:
                task = bar.add_task("", total=total, completed=start)
                yield lambda text="": bar.update(task, advance=1, description=text)
            return
        state = {"i": start}

        def advance(text: str = "") -> None:
            state["i"] += 1
            self.note(f"{title} {state['i']}/{total} {text}")

        yield advance

    def step_metrics(
        self, batch: list[Any], per_opt: list[dict[str, float]], stats: dict[str, Any], trained_version: int
    ) -> dict[str, float]:
        """`trained_version`: the policy version the batch was trained on (staleness is measured against it)."""
        out = rollout_metrics(batch, trained_version)
        for k in per_opt[-1] if per_opt else {}:
            vals = [m[k] for m in per_opt if k in m and isinstance(m[k], (int, float))]
            if vals:
                out[f"train/{k}" if "/" not in k else k] = float(statistics.fmean(vals))
        self.tokens += sum(s.response_length for s in batch)
        for k, v in stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("_"):
                out[f"rollout_stats/{k}"] = float(v)
        return out

    def summary(self, step: int, m: dict[str, float]) -> str:
        def f(key: str, fmt: str = ".3f") -> str:
            v = m.get(key)
            return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

        parts = [
            f"reward {f('rollout/reward_mean')}",
            f"loss {f('train/loss')}",
            f"kl {f('policy/approx_kl', '.4f')}",
            f"len {f('rollout/response_len_mean', '.1f')}",
            f"step {f('time/step_s', '.1f')}s",
        ]
        if "eval/greedy_accuracy" in m:
            parts.append(f"eval acc {f('eval/greedy_accuracy')}")
        return " | ".join(parts)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.store.metrics(step, {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})

    def samples(self, step: int, batch: list[Any], trained: dict[str, Any], version: int) -> None:
        """The trained samples of a step: `samples/step_<n>.jsonl` (exact tokens, one JSON per line)
        and the event store (with the trainer's log-probs and advantages per token).

        `step` counts from 0 (the file names); the store numbers the step `step + 1`, as
        `metrics.jsonl` and the driver's spans do, so the dashboard sees one step number."""
        out = self.run_dir / "samples"
        out.mkdir(exist_ok=True)
        with open(out / f"step_{step}.jsonl", "w") as f:
            for s in batch:
                f.write(s.to_json() + "\n")
        self.store.samples(
            step + 1,
            batch,
            train_logprobs=trained.get("train_logprobs"),
            advantages=trained.get("advantages"),
            version=version,
        )

    def flush(self) -> None:
        """Everything recorded so far on disk (a checkpoint marks its step done only after this)."""
        from furlong.driver.rundir import fsync_file

        self.store.flush()
        for name in ("metrics.jsonl", "events.sqlite", "events.sqlite-wal"):
            fsync_file(self.run_dir / name)

    def rewind(self, step: int) -> None:
        """Forget every step after `step` (a resumed run records them again): `metrics.jsonl`, `samples/`, the store."""
        from furlong.driver.rundir import rewind_files

        self.store.rewind(step)
        rewind_files(self.run_dir, step)

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens = int(state.get("tokens", 0))

    def close(self) -> None:
        self.store.close()
