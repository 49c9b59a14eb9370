"""Multi-LoRA: one PEFT model holding N adapters, each trained on its own task's samples only.

`train.lora.adapters: [a, b, ...]` gives the policy one adapter per name (`lora.apply_lora`), all on the
same frozen base. Each prompt names its adapter in `metadata["adapter"]` (`data.mix`); the rollout
generates it with that adapter (`lora_path`, `rollout/generate.py`) and the trainer groups by it.

One RL step, per adapter in turn: `set_adapter(name)` makes it the only active and the only trainable
adapter (PEFT sets `requires_grad` on it alone), then the ordinary `train_rollout` runs on that adapter's
samples — old/reference log-probs, advantages, the loss, one optimiser step. Why this is exact, i.e. the
same as N separate one-adapter runs sharing the base:

- the forward of adapter a's samples is base + adapter a (the others are inactive), so the loss depends on
  a's parameters alone; its normalisers (`totals`), advantages and the grad clip see a's samples alone;
- the optimiser is one AdamW over every adapter, but `zero_grad(set_to_none=True)` leaves the others'
  gradients None and AdamW skips a parameter whose grad is None: no moment, step count or weight-decay
  update, so a's step leaves b bit-identical (tests/unit/test_multi_lora.py);
- the schedule advances once per RL step: every adapter's pass but the last sees it held (`_Held`), so
  each adapter's k-th step runs at the lr of step k; the trainer's step counter is likewise one per RL step.

The reference model is the base without adapters (`disable_adapter`), as for one adapter: no copy.
Each sync sends every adapter under its own name (`sync_names`), each resident in the engine.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from torch import nn

from furlong.core.sample import SampleError
from furlong.train.batch import TrainBatch

if TYPE_CHECKING:
    from furlong.train.trainer import Trainer

COUNTS = ("samples", "tokens")  # summed over adapters in the step's top-level metrics; "step" is shared


class _Held:
    """A scheduler that does not advance: the lr of this RL step, for every adapter's pass but the last."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()


class MultiLora:
    """The adapters of one policy, and the per-adapter RL step over a mixed batch."""

    def __init__(self, policy: nn.Module, names: list[str], steps_per_rollout: int = 1):
        if steps_per_rollout != 1:
            raise ValueError("train.num_steps_per_rollout must be 1 with train.lora.adapters")
        self.names = list(names)
        self.active: str | None = None  # the adapter whose pass is running
        # Every adapter trainable now, so the optimiser (built over requires_grad params) holds them all;
        # set_adapter then narrows requires_grad to the active one for each pass.
        for n, p in policy.named_parameters():
            if any(f".lora_{x}.{a}." in n for x in "AB" for a in self.names):
                p.requires_grad_(True)

    @classmethod
    def attach(cls, policy: nn.Module, lora: Any, steps_per_rollout: int) -> MultiLora | None:
        return cls(policy, lora.adapters, steps_per_rollout) if lora.enabled and lora.adapters else None

    def sync_names(self) -> dict[str, str]:
        """PEFT adapter -> engine adapter name for `lora.adapter_items`: the same name on both sides."""
        return {n: n for n in self.names}

    def split(self, batch: TrainBatch) -> dict[str, list[int]]:
        """Sample indices per adapter, in adapter order; a sample naming no configured adapter is an error."""
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(batch.samples):
            name = s.metadata.get("adapter")
            if name not in self.names:
                raise SampleError(
                    f"sample {s.index}: metadata adapter={name!r} is not one of train.lora.adapters={self.names} "
                    "(tag prompts with data.mix[].adapter)"
                )
            groups.setdefault(name, []).append(i)
        return {n: groups[n] for n in self.names if n in groups}

    def train_rollout(self, trainer: Trainer, samples: Any) -> dict[str, Any]:
        """One RL step: each adapter, active alone, trains on its own samples; one merged step record."""
        batch = samples if isinstance(samples, TrainBatch) else trainer.convert(samples)
        groups = self.split(batch)
        step0, scheduler = trainer.step, trainer.scheduler
        parts: dict[str, tuple[list[int], dict[str, Any]]] = {}
        try:
            for k, (name, idx) in enumerate(groups.items()):
                trainer.step = step0
                trainer.scheduler = scheduler if k == len(groups) - 1 else _Held(scheduler)
                self.active = name
                trainer.policy.set_adapter(name)
                parts[name] = (idx, trainer.train_rollout(batch.select(idx)))
        finally:
            self.active, trainer.scheduler = None, scheduler
        return merge(parts, batch, len(batch))


def merge(parts: dict[str, tuple[list[int], dict[str, Any]]], batch: TrainBatch, n: int) -> dict[str, Any]:
    """The per-adapter step records as one: `lora/<adapter>/<metric>` for each (and its `reward_mean`), top-level
    metrics sample-weighted over adapters (counts summed), provenance back in the batch's sample order."""
    top: dict[str, float] = defaultdict(float)
    weight: dict[str, float] = defaultdict(float)
    out: dict[str, float] = {}
    for name, (idx, rec) in parts.items():
        (m,) = rec["metrics"]
        rewards = [batch.samples[i].reward for i in idx]
        out[f"lora/{name}/reward_mean"] = sum(rewards) / len(rewards)
        w = float(len(idx))
        for k, v in m.items():
            out[f"lora/{name}/{k}"] = v
            if k in COUNTS or k == "step":
                top[k] = top[k] + v if k in COUNTS else v
            else:
                top[k] += v * w
                weight[k] += w
    metrics = {k: (v / weight[k] if k in weight else v) for k, v in top.items()} | out
    rec: dict[str, Any] = {
        "metrics": [metrics],
        "span": (min(r["span"][0] for _, r in parts.values()), max(r["span"][1] for _, r in parts.values())),
    }
    for key in ("advantages", "train_logprobs"):
        if parts and all(key in r for _, r in parts.values()):
            rows: list[Any] = [None] * n
            for idx, r in parts.values():
                for i, row in zip(idx, r[key]):
                    rows[i] = row
            rec[key] = rows
    return rec
