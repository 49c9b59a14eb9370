"""Reward invocation: per sample and per group, sync or async, never fatal to the run.

Plug points (dotted paths `package.module:function` in `rollout.reward_fn` and
`rollout.group_reward_fn`, or callables):

    reward_fn(sample: Sample) -> float | dict            (may be async)
    group_reward_fn(samples: list[Sample]) -> list[float | dict]   (may be async)

A dict reward must hold a `score` key (what advantages use); other keys are logged.
The default per-sample reward is the synthetic task's rule,
`TASKS[sample.metadata["task"]].score(response_text, sample.label)`.

A reward that raises, returns a non-finite number or the wrong shape marks the
sample(s) `failed` with the error as the reason; the run goes on and the manager
drops that group with the reason `reward_error`, counted. Sync functions run on the
event loop: a slow one should be async (or hand itself to a thread) so generation
is not starved.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from typing import Any

from furlong.core import spans
from furlong.core.sample import Sample, Status

Reward = float | dict[str, float]
SCORABLE = (Status.COMPLETED, Status.TRUNCATED)


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a sync or async function alike."""
    out = fn(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out


def task_reward(sample: Sample) -> float:
    """The default reward: the synthetic task named in the sample's metadata scores the response."""
    from furlong.data.tasks import get_task

    task = sample.metadata.get("task")
    if task is None:
        raise ValueError(
            "sample metadata has no 'task'; set rollout.reward_fn for prompts that are not synthetic tasks"
        )
    return float(get_task(task).score(sample.metadata.get("response_text", ""), sample.label))


def check_reward(value: Any) -> Reward:
    """A reward as the Sample holds it, or ValueError saying what is wrong with it."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward dict has no 'score' key: {sorted(value)}")
        out = {str(k): float(v) for k, v in value.items()}
        bad = [k for k, v in out.items() if not math.isfinite(v)]
    elif isinstance(value, (int, float)):
        out = float(value)
        bad = [] if math.isfinite(out) else ["value"]
    else:
        raise ValueError(f"reward must be a number or a dict with 'score', got {type(value).__name__}")
    if bad:
        raise ValueError(f"reward is not finite: {value!r}")
    return out


def _fail(sample: Sample, where: str, e: BaseException) -> None:
    sample.status = Status.FAILED
    sample.status_reason = f"{where}: {type(e).__name__}: {e}"
    sample.metadata["reward_error"] = True
    sample.reward = None


async def score_sample(sample: Sample, reward_fn: Callable[..., Any]) -> bool:
    """Set `sample.reward`; False (and the sample failed, with the reason) if the reward raised."""
    t0 = time.time()
    try:
        sample.reward = check_reward(await call(reward_fn, sample))
        spans.record("driver", "reward", t0, time.time(), merge=True, samples=1)  # contiguous calls fold into one
        return True
    except Exception as e:  # noqa: BLE001 - any user error becomes the sample's failure reason
        _fail(sample, "reward_fn", e)
        return False


async def score_group(samples: list[Sample], group_reward_fn: Callable[..., Any]) -> bool:
    """Set every sample's reward from one group call; on error every sample fails with the reason."""
    t0 = time.time()
    try:
        rewards = await call(group_reward_fn, samples)
        spans.record("driver", "reward", t0, time.time(), merge=True, samples=len(samples))
        if len(rewards) != len(samples):
            raise ValueError(f"returned {len(rewards)} rewards for a group of {len(samples)}")
        checked = [check_reward(r) for r in rewards]
    except Exception as e:  # noqa: BLE001
        for s in samples:
            _fail(s, "group_reward_fn", e)
        return False
    for s, r in zip(samples, checked):
        s.reward = r
    return True
