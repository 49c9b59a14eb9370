"""Timeline advisories: engines idle while ranks train (and the reverse), a straggling rank, stale samples."""

from __future__ import annotations

from furlong.observe.advisories import _adv
from furlong.observe.balance import balance, busy_by_step


def timeline(steps, lanes):
    """`RunReader.timeline()`'s shape: lanes of spans, each step's extent from its spans."""
    out = {"lanes": [], "steps": []}
    extent = {}
    for worker, spans in lanes.items():
        out["lanes"].append({"worker": worker, "devices": [], "spans": []})
        for step, phase, a, b in spans:
            out["lanes"][-1]["spans"].append({"phase": phase, "step": step, "start": a, "end": b, "attrs": None})
            lo, hi = extent.get(step, (a, b))
            extent[step] = (min(lo, a), max(hi, b))
    out["steps"] = [{"step": s, "start": a, "end": b} for s, (a, b) in sorted(extent.items()) if s in steps]
    return out


def sync_like(n=4, rank1_factor=1.0):
    """Each 10 s step: engines decode for 1 s, then both ranks train for the rest."""
    lanes = {"engine/0": [], "engine/1": [], "trainer/0": [], "trainer/1": [], "driver": []}
    for s in range(1, n + 1):
        t = 10.0 * s
        lanes["driver"].append((s, "generate", t, t + 10))
        for e in ("engine/0", "engine/1"):
            lanes[e].append((s, "decode", t, t + 1))
        lanes["trainer/0"].append((s, "forward-backward", t + 1, t + 6))
        lanes["trainer/1"].append((s, "forward-backward", t + 1, t + 1 + 5 * rank1_factor))
    return timeline(range(1, n + 1), lanes)


def kinds(tl, series=None):
    return {a["kind"]: a for a in balance(tl, series or {}, _adv)}


def test_busy_time_is_the_union_of_a_lanes_work_spans():
    tl = timeline([1], {"engine/0": [(1, "decode", 0, 2), (1, "prefill", 1, 3), (1, "paused", 3, 9)]})
    wall, busy = busy_by_step(tl)
    assert wall == {1: 9} and busy == {1: {"engine/0": 3.0}}  # overlap counted once, pauses are not work


def test_engines_idle_while_ranks_train_suggests_overlap_or_colocate():
    a = kinds(sync_like())
    assert set(a) == {"engine-idle"} and a["engine-idle"]["steps"] == [1, 2, 3, 4]
    assert "colocate" in a["engine-idle"]["message"] and "async" in a["engine-idle"]["message"]


def test_ranks_idle_while_engines_generate():
    lanes = {"engine/0": [], "trainer/0": []}
    for s in (1, 2):
        lanes["engine/0"].append((s, "decode", 10 * s, 10 * s + 9))
        lanes["trainer/0"].append((s, "optimiser", 10 * s + 9, 10 * s + 10))
    assert set(kinds(timeline([1, 2], lanes))) == {"trainer-idle"}


def test_a_straggling_rank_is_named():
    a = kinds(sync_like(rank1_factor=1.8))  # rank 1 needs 9 s against rank 0's 5 s
    assert a["straggler"]["message"].startswith("trainer/1 ") and a["straggler"]["steps"] == [1, 2, 3, 4]


def test_stale_samples_and_a_balanced_run():
    series = {"samples/staleness_mean": [[1, 0.5], [2, 2.0], [3, 3.0]]}
    a = kinds(timeline([], {}), series)
    assert set(a) == {"staleness"} and a["staleness"]["steps"] == [2, 3] and a["staleness"]["value"] == 3.0
    balanced = {"engine/0": [(1, "decode", 0, 6)], "trainer/0": [(1, "forward-backward", 4, 10)]}
    assert kinds(timeline([1], balanced), {"samples/staleness_mean": [[1, 1.0]]}) == {}
