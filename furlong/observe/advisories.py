"""Advisories: things in a run worth a look, each with the evidence that raised it.

Checks (thresholds are module constants, documented in docs/dashboard.md):

- **stall**: a step that took more than `STALL_FACTOR` × the median step time; or,
  on a live run, no event for `STALL_FACTOR` × the median step time;
- **zero-variance groups**: groups whose samples all got the same reward — no
  learning signal under group-relative advantages (GRPO, RLOO, ...);
- **truncation rate**: steps where more than `TRUNCATION_RATE` of samples hit the
  length limit;
- **abort storm**: steps where more than `ABORT_RATE` of samples were aborted;
- **reward / length drift**: the mean of the last `DRIFT_WINDOW` steps is more
  than `DRIFT_SIGMAS` standard deviations (of the first window) from the first
  window's mean — a collapse or an explosion of reward or response length;
- **dropped events**: the event store lost events (its queue was full);
- **engine-idle / trainer-idle, straggler, staleness**: from the workers' timeline and the
  samples' staleness (`balance.py` says how each is computed).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from furlong.observe.balance import balance
from furlong.observe.reader import RunReader

STALL_FACTOR = 3.0
TRUNCATION_RATE = 0.2
ABORT_RATE = 0.2
DRIFT_WINDOW = 3
DRIFT_SIGMAS = 3.0


def _adv(
    kind: str, severity: str, message: str, steps: list[int] | None = None, value: float | None = None
) -> dict[str, Any]:
    return {"kind": kind, "severity": severity, "message": message, "steps": steps or [], "value": value}


def advise(reader: RunReader, *, live: bool = False, now: float | None = None) -> dict[str, Any]:
    summary = reader.summary()
    out: list[dict[str, Any]] = []
    if summary["dropped_events"]:
        out.append(
            _adv(
                "dropped-events",
                "warn",
                f"the event store dropped {summary['dropped_events']} events (queue full or write failed): views may miss data",
                value=summary["dropped_events"],
            )
        )
    out += _stalls(reader, summary, live, now if now is not None else time.time())
    series = reader.metrics()["series"]
    out += _rates(
        series,
        "samples/truncated_frac",
        TRUNCATION_RATE,
        "truncation",
        "of samples were truncated (hit max_new_tokens)",
    )
    out += _rates(series, "samples/aborted_frac", ABORT_RATE, "abort-storm", "of samples were aborted")
    groups = reader.groups()["groups"]
    zero = [g for g in groups if g["zero_variance"]]
    if zero:
        steps = sorted({g["step"] for g in zero})
        out.append(
            _adv(
                "zero-variance",
                "info" if len(zero) < len(groups) / 2 else "warn",
                f"{len(zero)} of {len(groups)} groups have the same reward for every sample (no signal for group-relative advantages)",
                steps,
                len(zero) / len(groups),
            )
        )
    out += _drift(series, "samples/reward_mean", "reward-drift", "mean reward")
    out += _drift(series, "samples/response_length_mean", "length-drift", "mean response length")
    out += balance(reader.timeline(), series, _adv)  # engine / trainer idle, stragglers, staleness
    return {"advisories": out, "message": summary["message"]}


def _stalls(reader: RunReader, summary: dict[str, Any], live: bool, now: float) -> list[dict[str, Any]]:
    steps = reader.timeline()["steps"]
    durations = {s["step"]: s["end"] - s["start"] for s in steps}
    if len(durations) < 3:
        return []
    median = statistics.median(durations.values())
    out = []
    slow = [s for s, d in durations.items() if d > STALL_FACTOR * median]
    if slow:
        worst = max(slow, key=durations.get)
        out.append(
            _adv(
                "stall",
                "warn",
                f"{len(slow)} step(s) took more than {STALL_FACTOR:g}× the median step time "
                f"({median:.2f}s); step {worst} took {durations[worst]:.2f}s",
                sorted(slow),
                durations[worst],
            )
        )
    last = summary["last_time"]
    if live and last is not None and now - last > STALL_FACTOR * median:
        out.append(
            _adv(
                "stall",
                "warn",
                f"no event for {now - last:.0f}s (median step {median:.2f}s): the run may be stuck",
                value=now - last,
            )
        )
    return out


def _rates(series: dict[str, list], name: str, limit: float, kind: str, what: str) -> list[dict[str, Any]]:
    bad = [(s, v) for s, v in series.get(name, []) if v is not None and v > limit]
    if not bad:
        return []
    worst = max(bad, key=lambda p: p[1])
    return [
        _adv(
            kind,
            "warn",
            f"in {len(bad)} step(s) more than {limit:.0%} {what}; worst: step {worst[0]} with {worst[1]:.0%}",
            [s for s, _ in bad],
            worst[1],
        )
    ]


def _drift(series: dict[str, list], name: str, kind: str, what: str) -> list[dict[str, Any]]:
    values = [v for _, v in series.get(name, []) if v is not None]
    if len(values) < 2 * DRIFT_WINDOW:
        return []
    first, last = values[:DRIFT_WINDOW], values[-DRIFT_WINDOW:]
    m0, m1 = statistics.fmean(first), statistics.fmean(last)
    spread = max(statistics.pstdev(first), 0.05 * abs(m0), 1e-9)
    z = (m1 - m0) / spread
    if not math.isfinite(z) or abs(z) <= DRIFT_SIGMAS:
        return []
    direction = "rose" if z > 0 else "fell"
    return [
        _adv(
            kind,
            "info" if kind == "reward-drift" and z > 0 else "warn",
            f"{what} {direction} from {m0:.3g} (first {DRIFT_WINDOW} steps) to {m1:.3g} (last {DRIFT_WINDOW})",
            value=z,
        )
    ]
