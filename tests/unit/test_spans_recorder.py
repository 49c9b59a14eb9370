"""The per-process span buffer: contiguous scheduler steps fold, reads are idempotent, a full buffer says so."""

from __future__ import annotations

import asyncio

import pytest

from furlong.core.spans import SpanRecorder
from furlong.observe.timeline import SpanPuller


def test_contiguous_steps_fold_until_read_and_counters_add_up():
    rec = SpanRecorder()
    rec.record("engine", "decode", 1.0, 1.001, merge=True, tokens=4, steps=1, batch=4)
    rec.record("engine", "decode", 1.002, 1.003, merge=True, tokens=2, steps=1, batch=2)
    rec.record("engine", "prefill", 1.003, 1.004, merge=True, tokens=9, steps=1, batch=1)  # another kind: new span
    first = rec.since(0)
    assert [(s[3], s[5], s[6], s[7]) for s in first["spans"]] == [
        ("decode", 1.0, 1.003, {"tokens": 6, "steps": 2, "batch": 4}),
        ("prefill", 1.003, 1.004, {"tokens": 9, "steps": 1, "batch": 1}),
    ]
    rec.record("engine", "prefill", 1.0045, 1.005, merge=True, tokens=1, steps=1, batch=1)  # read already: not folded
    rec.record("engine", "prefill", 2.0, 2.1, merge=True, tokens=1, steps=1, batch=1)  # a gap: not folded
    again = rec.since(first["seq"])
    assert [s[5] for s in again["spans"]] == [1.0045, 2.0] and again["missed"] == 0
    assert rec.since(0)["spans"][:2] == first["spans"]  # reading does not consume


def test_a_full_buffer_tells_the_reader_what_it_missed():
    rec = SpanRecorder(capacity=3)
    for i in range(5):
        rec.record("router", "route", float(i), float(i) + 0.5)
    got = rec.since(0)
    assert [s[5] for s in got["spans"]] == [2.0, 3.0, 4.0] and got["missed"] == 2


def test_span_context_records_errors_and_late_attributes():
    rec = SpanRecorder()
    with pytest.raises(KeyError):
        with rec.span("trainer/1", "optimiser", 3) as attrs:
            attrs["tokens"] = 7
            raise KeyError("x")
    (span,) = rec.since(0)["spans"]
    assert span[1:5] == ["trainer/1", "", "optimiser", 3] and span[7] == {"tokens": 7, "error": "KeyError"}


@pytest.fixture(autouse=True)
def own_recorder(monkeypatch):
    """A fresh in-process recorder: spans earlier tests left in this process's (a test worker's) are not ours."""
    from furlong.core import spans

    monkeypatch.setattr(spans, "RECORDER", SpanRecorder())


class _Store:
    def __init__(self):
        self.rows, self.written = [], {}

    def metrics(self, step, values):
        self.written[step] = values

    def record_span(self, worker, phase, step, start, end, *, device="", **attrs):
        self.rows.append((worker, phase, step, attrs))


class _Ranks:
    """Two trainer ranks' buffers, as `TrainerGroup.spans` returns them."""

    def __init__(self):
        self.recs = [SpanRecorder(), SpanRecorder()]

    def __len__(self):
        return 2

    async def spans(self, since):
        return [r.since(s) for r, s in zip(self.recs, since)]


@pytest.mark.timeout(60)
def test_the_puller_names_lanes_stamps_steps_and_reads_each_span_once(tiny_model_dir):
    store, ranks = _Store(), _Ranks()
    puller = SpanPuller(store, trainers=ranks, model_dir=tiny_model_dir)
    ranks.recs[0].record("engine", "decode", 1.0, 1.1, tokens=5)  # a colocated engine, inside rank 0
    ranks.recs[1].record("trainer/1", "forward-backward", 1.0, 1.2, tokens=10)
    ranks.recs[1].record("trainer/1", "checkpoint-save", 1.2, 1.3, 7)
    metrics = asyncio.run(puller.pull(4))
    mine = [r for r in store.rows if r[0] != "driver" and r[0] != "env"]
    assert mine == [
        ("engine/0", "decode", 4, {"tokens": 5}),
        ("trainer/1", "forward-backward", 4, {"tokens": 10}),
        ("trainer/1", "checkpoint-save", 7, {}),
    ]
    assert metrics["perf/tflops/trainer/1"] > 0 and metrics["perf/tflops/engine/0"] > 0
    before = len(store.rows)
    metrics = asyncio.run(puller.pull(5))
    assert len(store.rows) == before and "cpu/trainer/0" in metrics


@pytest.mark.timeout(60)
def test_a_background_pull_stamps_each_span_with_the_step_it_started_in(tiny_model_dir, monkeypatch):
    """The pull of step 1 may run after step 2 has begun: step 2's early spans must say step 2."""
    import time

    store, ranks = _Store(), _Ranks()
    puller = SpanPuller(store, trainers=ranks, model_dir=tiny_model_dir)
    now = time.time()
    ranks.recs[0].record("trainer/0", "forward-backward", now - 2, now - 1, tokens=3)  # during step 1

    async def steps():
        puller.start(1)  # step 1 ends now
        ranks.recs[0].record("trainer/0", "forward-backward", time.time() + 0.5, time.time() + 1, tokens=3)
        await puller.wait()
        puller.start(2)
        await puller.wait()
        ranks.recs[1].record("trainer/1", "checkpoint-save", time.time() + 1, time.time() + 2)
        await puller.pull(2, final=True)

    asyncio.run(steps())
    fb = [(r[0], r[2]) for r in store.rows if r[1] in ("forward-backward", "checkpoint-save")]
    assert fb == [("trainer/0", 1), ("trainer/0", 2), ("trainer/1", 2)]
    assert set(store.written) == {1, 2}  # each background pull wrote its step's metrics, the final one none
    assert "perf/tflops/trainer/0" in store.written[1] and "perf/tflops/trainer/0" in store.written[2]
