"""Advisories from the workers' timeline: who waited on whom, which rank or engine lagged, how stale the data was.

Busy time of a lane in a step is the union of its work spans (`ENGINE_WORK`, `TRAINER_WORK`) inside
the step's wall-clock extent (the first to the last span of that step, any lane):

- **engine-idle**: engines busy less than `IDLE_FRACTION` of the step while the trainer ranks are
  busy more than `BUSY_FRACTION` of it, in at least half the steps: generation waits for training.
  Overlap them (`rollout.mode: overlap` or `async`) or share the devices (`cluster.colocate`).
- **trainer-idle**: the other way round: the ranks wait for rollouts. Use `rollout.mode: async`
  and more engines, or fewer / shorter samples per step.
- **straggler**: in a step, the busiest trainer rank's (or engine's) busy time exceeds `STRAGGLER_FACTOR`
  × the median of the others of its kind, in at least half the steps: an unbalanced shard,
  a slow device or a noisy neighbour; the message names the lane.
- **staleness**: the mean staleness of the trained samples of a step exceeds `STALENESS_MEAN`
  versions: async training off a policy that has moved on (see `rollout.max_staleness`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

ENGINE_WORK = ("prefill", "decode")
TRAINER_WORK = ("forward-backward", "optimiser", "old-logprob", "ref-logprob")
IDLE_FRACTION = 0.2
BUSY_FRACTION = 0.4
STRAGGLER_FACTOR = 1.5
STALENESS_MEAN = 1.5


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def busy_by_step(timeline: dict[str, Any]) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """({step: wall seconds}, {step: {lane: busy seconds}}) from `RunReader.timeline()`."""
    wall = {s["step"]: s["end"] - s["start"] for s in timeline["steps"]}
    spans: dict[int, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for lane in timeline["lanes"]:
        worker = lane["worker"]
        work = ENGINE_WORK if worker.startswith("engine/") else TRAINER_WORK if worker.startswith("trainer/") else ()
        for sp in lane["spans"]:
            if sp["phase"] in work and sp["step"] is not None:
                spans[sp["step"]][worker].append((sp["start"], sp["end"]))
    return wall, {step: {w: _union(iv) for w, iv in lanes.items()} for step, lanes in spans.items()}


def balance(timeline: dict[str, Any], series: dict[str, list], adv: Any) -> list[dict[str, Any]]:
    """The advisories above; `adv` is `advisories._adv` (kind, severity, message, steps, value)."""
    wall, busy = busy_by_step(timeline)
    out: list[dict[str, Any]] = []
    engine_idle, trainer_idle, straggle = [], [], defaultdict(list)
    for step, lanes in busy.items():
        w = wall.get(step) or 0.0
        engines = [v for k, v in lanes.items() if k.startswith("engine/")]
        ranks = [v for k, v in lanes.items() if k.startswith("trainer/")]
        if w <= 0 or not engines or not ranks:
            continue
        e, t = statistics.fmean(engines) / w, statistics.fmean(ranks) / w
        if e < IDLE_FRACTION and t > BUSY_FRACTION:
            engine_idle.append(step)
        if t < IDLE_FRACTION and e > BUSY_FRACTION:
            trainer_idle.append(step)
        for prefix in ("engine/", "trainer/"):
            peers = {k: v for k, v in lanes.items() if k.startswith(prefix)}
            if len(peers) >= 2:
                slow = max(peers, key=peers.get)
                median = statistics.median(v for k, v in peers.items() if k != slow)
                if median > 0 and peers[slow] > STRAGGLER_FACTOR * median:
                    straggle[slow].append(step)
    n = len([s for s in busy if wall.get(s)])
    if engine_idle and len(engine_idle) * 2 >= n:
        out.append(
            adv(
                "engine-idle",
                "info",
                f"engines were idle (busy < {IDLE_FRACTION:.0%}) while the trainer trained in {len(engine_idle)} of"
                f" {n} steps: overlap generation with training (rollout.mode: overlap or async) or colocate",
                sorted(engine_idle),
                len(engine_idle) / n,
            )
        )
    if trainer_idle and len(trainer_idle) * 2 >= n:
        out.append(
            adv(
                "trainer-idle",
                "info",
                f"trainer ranks were idle (busy < {IDLE_FRACTION:.0%}) while engines generated in {len(trainer_idle)}"
                f" of {n} steps: generate asynchronously (rollout.mode: async) with more engines",
                sorted(trainer_idle),
                len(trainer_idle) / n,
            )
        )
    for lane, steps in sorted(straggle.items()):
        if len(steps) * 2 >= n:
            out.append(
                adv(
                    "straggler",
                    "warn",
                    f"{lane} was busy more than {STRAGGLER_FACTOR:g}x its peers' median in {len(steps)} of {n} steps",
                    sorted(steps),
                    len(steps) / n,
                )
            )
    stale = [(s, v) for s, v in series.get("samples/staleness_mean", []) if v is not None and v > STALENESS_MEAN]
    if stale:
        worst = max(stale, key=lambda p: p[1])
        out.append(
            adv(
                "staleness",
                "warn",
                f"in {len(stale)} step(s) the trained samples were on average more than {STALENESS_MEAN:g} versions"
                f" stale; worst: step {worst[0]} with {worst[1]:.2f} (lower rollout.max_staleness)",
                [s for s, _ in stale],
                worst[1],
            )
        )
    return out
