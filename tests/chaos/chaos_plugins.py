"""Plug points that inject faults into a real run; the chaos tests name them in the run's config.

They run where furlong calls them: the rewards in the driver (the test's own process,
so they can reach the run through `STATE`), the before-train-step hooks inside the
trainer's Ray actor.
"""

from __future__ import annotations

import asyncio
import math
import os
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
    call, plan = STATE["calls"], STATE["plan"]
    if plan and call >= plan[0][0]:
        async with STATE.setdefault("lock", asyncio.Lock()):  # one injection at a time, in plan order
            while plan and call >= plan[0][0]:
                _, action, engine = plan.pop(0)
                sup = STATE["run"].supervisor
                await sup.wait_all_serving()  # the last fault has been repaired
                if action == "wait":
                    continue
                before = len(sup.faults)
                sig = signal.SIGKILL if action == "kill" else signal.SIGSTOP
                await STATE["run"].top.engines[engine].kill.remote(int(sig))
                STATE["injected"].append((action, engine, before))
                while len(sup.faults) == before:  # until the supervisor has seen it
                    await asyncio.sleep(0.05)
    return raising_reward(sample)


def _poison(batch: Any) -> None:
    batch.advantages = batch.advantages.clone().fill_(math.nan)


def nan_at_1_and_from_3(step: int, batch: Any) -> None:
    """A NaN loss at optimiser step 1, then at every step from 3 on."""
    if step == 1 or step >= 3:
        _poison(batch)


def varied_reward(sample: Any) -> float:
    """A deterministic reward that differs within groups (the tiny model rarely solves a task), so weights move."""
    return (sum(sample.tokens[-sample.response_length :]) % 7) / 7


async def patient_reward(sample: Any) -> float:
    """`varied_reward`, once no engine is being restarted: the run cannot end before a replacement is done."""
    from furlong.cluster.supervisor import RESTARTING

    sup = STATE["run"].supervisor
    while any(s.state == RESTARTING for s in sup.slots):
        await asyncio.sleep(0.05)
    return varied_reward(sample)


async def trainer_killing_reward(sample: Any) -> float:
    """`varied_reward`; while RL step 2 is generated (checkpoint step_2 is complete), SIGKILL the trainer once."""
    run = STATE["run"]
    if not STATE.get("trainer_killed") and run.step == 2:
        STATE["trainer_killed"] = True
        pid = await run.trainers.actors[0].pid.remote()
        os.kill(pid, signal.SIGKILL)
    return varied_reward(sample)
