"""Request priority in the built-in engine's scheduler (SGLang's `priority` on /generate): with a full batch,
a waiting higher-priority request is admitted before lower-priority ones queued ahead of it; aging bounds the wait
of a low-priority request (the rule: `furlong.engine.request.admission_order`)."""

from __future__ import annotations

from collections import deque

import pytest

from furlong.engine.engine import Engine
from furlong.engine.request import AGING_STEPS, Request, admission_order
from furlong.engine.sampler import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = Engine(tiny_model_dir, kv_cache_mb=2, max_running=2, block_size=4).start()
    yield eng
    eng.stop()


def _admitted_order(eng: Engine, priorities: list[int]) -> list[int]:
    """Submit two 12-token fillers (they fill the batch: max_running=2) then one request per priority, all while
    the engine is paused (so they queue in this order); the order in which the queued ones got their first token."""
    first: list[str] = []

    def listen(req: Request, n: int, finished: bool) -> None:  # scheduler thread, one call per new token
        if req.rid not in first:
            first.append(req.rid)

    def req(i: int, prio: int, n: int) -> Request:
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        return Request([20 + i, 30 + i, 40 + i], params, rid=f"r{i}", priority=prio, stream=True, listener=listen)

    eng.pause("in_place").result(timeout=30)
    fillers = [req(i, 0, 12) for i in range(2)]
    queued = [req(2 + i, p, 4) for i, p in enumerate(priorities)]
    eng.submit_many(fillers + queued)
    eng.resume().result(timeout=30)
    for r in fillers + queued:
        assert r.done.wait(120), f"{r.rid} did not finish"
    assert first[:2] == ["r0", "r1"], first  # the fillers were admitted first and held both slots
    return [int(rid[1:]) - 2 for rid in first[2:]]


def test_high_priority_request_overtakes_queued_low_priority_ones(engine):
    # Three eval-like requests at -1 queued before one training request at 0: the training one goes first.
    order = _admitted_order(engine, [-1, -1, -1, 0])
    assert order[0] == 3, f"admission order {order}: the priority-0 request (index 3) was not admitted first"
    # Control: with one priority, the queue is first come first served (so the above is the priority's doing).
    assert _admitted_order(engine, [0, 0, 0, 0]) == [0, 1, 2, 3]


def test_aging_lets_a_low_priority_request_past_newcomers():
    """A -1 request that has waited AGING_STEPS steps ranks with priority 0 and, older, goes before new 0s."""

    def r(rid: str, prio: int, arrived: int) -> Request:
        return Request([1], rid=rid, priority=prio, arrival_step=arrived)

    fresh = deque([r("low", -1, 100), r("hi", 0, 100)])
    admission_order(fresh, 100)
    assert [x.rid for x in fresh] == ["hi", "low"]
    aged = deque([r("low", -1, 100), r("hi", 0, 100 + AGING_STEPS)])
    admission_order(aged, 100 + AGING_STEPS)
    assert [x.rid for x in aged] == ["low", "hi"]
