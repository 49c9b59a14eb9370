"""Group filters (dynamic sampling) and sample filters, each decision with a counted reason.

Dynamic sampling (DAPO): a group whose rewards all agree has zero advantage under
every group-normalised estimator, so it costs a training slot and teaches nothing.
The manager over-samples prompts (`rollout.over_sampling`) so that enough groups
survive, and drops the rest with a reason it counts.

Plug points:

    dynamic_filter_fn(samples: list[Sample]) -> str | bool | None   (may be async)
        a drop reason (str), False (drop, reason "dynamic_filter"), or None/True (keep)
    sample_filter_fn(sample: Sample) -> str | bool | None           (may be async)
        a reason (str) or False masks the sample out of the loss (loss_mask all 0)
        while keeping it in its group, so the batch keeps its shape

A group that holds a failed sample never reaches the filters: it is dropped as
`failed` (generation gave up) or `reward_error` (the reward raised).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from furlong.core import spans
from furlong.core.sample import Sample, Status
from furlong.rollout.rewards import call

if TYPE_CHECKING:
    from furlong.config.schema import RolloutConfig


def zero_variance(samples: list[Sample]) -> str | None:
    """The default dynamic filter: drop a group (of 2 or more) whose rewards are all equal."""
    if len(samples) < 2:
        return None
    rewards = [s.scalar_reward for s in samples]
    return "zero_variance" if max(rewards) == min(rewards) else None


def _reason(verdict: Any, default: str) -> str | None:
    if verdict is None or verdict is True:
        return None
    if verdict is False:
        return default
    if isinstance(verdict, str) and verdict:
        return verdict
    raise TypeError(f"a filter must return None, a bool or a non-empty reason string, got {verdict!r}")


async def group_drop_reason(samples: list[Sample], dynamic_filter_fn: Callable[..., Any] | None) -> str | None:
    """Why this finished group is not trained, or None to train it."""
    failed = [s for s in samples if Status(s.status) == Status.FAILED]
    if failed:
        return "reward_error" if any(s.metadata.get("reward_error") for s in failed) else "failed"
    if dynamic_filter_fn is None:
        return None
    t0 = time.time()
    verdict = await call(dynamic_filter_fn, samples)
    spans.record("driver", "filter", t0, time.time(), merge=True, samples=len(samples))
    return _reason(verdict, "dynamic_filter")


async def apply_sample_filter(samples: list[Sample], sample_filter_fn: Callable[..., Any] | None) -> Counter[str]:
    """Mask filtered samples out of the loss; returns the count of masked samples by reason."""
    counts: Counter[str] = Counter()
    if sample_filter_fn is None:
        return counts
    t0 = time.time()
    for s in samples:
        reason = _reason(await call(sample_filter_fn, s), "sample_filter")
        if reason is not None:
            s.loss_mask[:] = [0] * len(s.loss_mask)
            s.metadata["filtered"] = reason
            counts[reason] += 1
    spans.record("driver", "filter", t0, time.time(), merge=True, samples=len(samples))
    return counts


class RolloutStalled(RuntimeError):
    """Every group drawn for `rollout.max_dropped_batches` batches in a row was dropped: no batch can be made."""


def check_stalled(dropped: Counter[str], config: RolloutConfig, step: int, accepted: int) -> None:
    """Stop, naming why, once `rollout.max_dropped_batches` batches' worth of groups in a row were dropped.

    Why: dynamic sampling (and any drop filter) draws new prompts for each group it drops; once the reward
    saturates, every group agrees and a batch never fills. verl bounds the same loop (`max_num_gen_batches`).
    """
    limit = config.max_dropped_batches * config.rollout_batch_size
    if sum(dropped.values()) >= limit:
        reasons = ", ".join(f"{n} {r}" for r, n in dropped.most_common())
        raise RolloutStalled(
            f"step {step}: the last {limit} groups drawn were all dropped ({reasons}; {accepted} of "
            f"{config.rollout_batch_size} accepted): rollout.max_dropped_batches={config.max_dropped_batches}. "
            "With zero_variance the reward has saturated (every group agrees): the run has learned what this "
            "reward can teach, or its learning rate is too high"
        )
