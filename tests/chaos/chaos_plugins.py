"""Plug points that inject faults into a real run; the chaos tests name them in the run's config.

They run where furlong calls them: the rewards in the driver (the test's own process,
so they can reach the run through `STATE`), the before-train-step hooks inside the
trainer's Ray actor.
"""

from __future__ import annotations

import math
import signal
import zlib
from typing import Any

from furlong.rollout.rewards import task_reward

STATE: dict[str, Any] = {}  # the test sets "run" and "plan"; the reward records what it did


def reset(run: Any, plan: list[tuple[int, str, int]]) -> None:
    """`plan`: (reward call number, "kill" | "stop" | "wait", engine index), in order."""
    STATE.clear()
    STATE.update(run=run, plan=list(plan), calls=0, raised=[], injected=[])


def explodes(sample: Any) -> bool:
    """One sample in ten, by a hash of (prompt, sample index): the same ones in every run."""
    key = f"{sample.metadata.get('prompt_index')}-{sample.metadata.get('sample_index')}".encode()
    return zlib.crc32(key) % 10 == 0


def raising_reward(sample: Any) -> float:
    """The task's reward, except that it raises on 10% of the samples."""
    if explodes(sample):
        STATE.setdefault("raised", []).append(sample)
        raise RuntimeError("chaos: reward exploded")
    return task_reward(sample)


async def chaos_reward(sample: Any) -> float:
    """`raising_reward`, and on the planned calls a signal to an engine (after the previous fault healed)."""
    STATE["calls"] += 1
    plan = STATE["plan"]
    while plan and STATE["calls"] >= plan[0][0]:
        _, action, engine = plan.pop(0)
        run = STATE["run"]
        await run.supervisor.wait_all_serving()  # one fault at a time: the last one has been repaired
        if action != "wait":
            sig = signal.SIGKILL if action == "kill" else signal.SIGSTOP
            faults_before = len(run.supervisor.faults)
            await run.top.engines[engine].kill.remote(int(sig))
            STATE["injected"].append((action, engine, faults_before))
    return raising_reward(sample)


def _poison(batch: Any) -> None:
    batch.advantages = batch.advantages.clone().fill_(math.nan)


def nan_at_1_and_from_3(step: int, batch: Any) -> None:
    """A NaN loss at optimiser step 1, then at every step from 3 on."""
    if step == 1 or step >= 3:
        _poison(batch)
