"""The event store: what goes in comes back out, drops are counted, several processes share one file."""

from __future__ import annotations

import json
import math
import sqlite3
import threading

import pytest

from furlong.core.sample import Sample, Source, Status
from furlong.observe.reader import RunReader
from furlong.observe.store import DB_NAME, EventStore


class ByteTokenizer:
    """Decodes id i to chr(i): enough to check token text and response text are stored."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def make_sample(index=0, group=0, reward=1.0) -> Sample:
    s = Sample(index=index, group_index=group, prompt=[{"role": "user", "content": "hi"}], tokens=[1, 2, 3])
    s.append([72, 105], logprobs=[-0.5, -1.5], version=3)
    s.append([33], source=Source.TOOL, version=4)
    s.append([46], logprobs=[-0.25], version=4)
    s.reward, s.status = reward, Status.TRUNCATED
    return s.validate()


def rows(run_dir, sql):
    with sqlite3.connect(run_dir / DB_NAME) as c:
        return c.execute(sql).fetchall()


def test_spans_metrics_and_samples_round_trip(tmp_path):
    with EventStore(tmp_path, tokenizer=ByteTokenizer()) as store:
        with store.span("trainer/0", "forward-backward", 7, device="cpu:1", micro=2):
            pass
        store.metrics(7, {"loss/total": 0.5, "policy/entropy": 2})
        store.metric(8, "loss/total", 0.25)
        s = make_sample()
        store.samples(7, [s], train_logprobs=[[-0.4, -1.6, float("-inf"), -0.2]], advantages=[0.75], version=5)
    (span,) = rows(tmp_path, "SELECT worker, device, phase, step, end >= start, attrs FROM spans")
    assert span == ("trainer/0", "cpu:1", "forward-backward", 7, 1, '{"micro": 2}')
    assert rows(tmp_path, "SELECT step, name, value FROM metrics ORDER BY id") == [
        (7, "loss/total", 0.5),
        (7, "policy/entropy", 2.0),
        (8, "loss/total", 0.25),
    ]

    got = RunReader(tmp_path).sample(1)
    assert (got["step"], got["idx"], got["grp"], got["reward"], got["status"]) == (7, 0, 0, 1.0, "truncated")
    assert got["staleness"] == 5 - 3  # trainer version - oldest policy token version
    assert (got["version_min"], got["version_max"], got["trained_tokens"]) == (3, 4, 3)
    assert got["messages"] == [{"role": "user", "content": "hi"}]
    assert got["response_text"] == "Hi!."
    t = got["tokens"]
    assert t["ids"] == [72, 105, 33, 46] and t["text"] == ["H", "i", "!", "."]
    assert t["logprob"] == pytest.approx(s.rollout_logprobs, rel=1e-6) and t["loss_mask"] == [1, 1, 0, 1]
    assert t["version"] == [3, 3, 4, 4] and t["source"] == ["policy", "policy", "tool", "policy"]
    assert t["advantage"] == [0.75] * 4  # a per-sample advantage is broadcast to its tokens
    assert t["train_logprob"][2] is None  # -inf is stored, then served as null (valid JSON)
    assert [t["train_logprob"][i] for i in (0, 1, 3)] == pytest.approx([-0.4, -1.6, -0.2], rel=1e-6)
    json.dumps(got, allow_nan=False)


def test_staleness_from_the_rollout_manager_wins(tmp_path):
    s = make_sample()
    s.metadata["staleness"] = 0
    with EventStore(tmp_path) as store:
        store.samples(1, [s], version=9)
    assert rows(tmp_path, "SELECT staleness FROM samples") == [(0,)]


def test_bad_per_token_lengths_name_the_sample(tmp_path):
    with EventStore(tmp_path) as store:
        with pytest.raises(ValueError, match=r"sample 4: len\(train_logprobs\)=2 != response_length=4"):
            store.samples(1, [make_sample(index=4)], train_logprobs=[[-1.0, -1.0]])
        with pytest.raises(ValueError, match="1 advantages for 2 samples"):
            store.samples(1, [make_sample(), make_sample(1)], advantages=[0.0])
        with pytest.raises(ValueError, match="end .* is before start"):
            store.record_span("w", "eval", 1, 10.0, 9.0)


def test_span_records_the_error_and_reraises(tmp_path):
    with EventStore(tmp_path) as store:
        with pytest.raises(KeyError):
            with store.span("driver", "reward", 3):
                raise KeyError("x")
    assert rows(tmp_path, "SELECT phase, attrs FROM spans") == [("reward", '{"error": "KeyError"}')]


def test_flush_makes_events_visible_to_another_connection(tmp_path):
    store = EventStore(tmp_path, flush_interval_s=60)  # the timer alone would not write for a minute
    store.metrics(1, {"a": 1.0})
    assert store.flush(timeout_s=10)
    assert RunReader(tmp_path).summary()["counts"]["metrics"] == 1
    store.close()
    store.close()  # idempotent
    store.metrics(2, {"a": 2.0})  # after close: ignored, not an error
    assert rows(tmp_path, "SELECT COUNT(*) FROM metrics") == [(1,)]


def test_disabled_store_writes_nothing_but_feeds_sinks(tmp_path):
    seen = []

    class Sink:
        def log(self, step, metrics):
            seen.append((step, dict(metrics)))

        def close(self):
            seen.append("closed")

    with EventStore(tmp_path / "run", enabled=False, sinks=[Sink()]) as store:
        store.metrics(3, {"x": 1})
        store.samples(3, [make_sample()])
        with store.span("w", "eval", 3):
            pass
        assert store.flush()
    assert not (tmp_path / "run").exists()
    assert seen == [(3, {"x": 1.0}), "closed"]


def test_a_full_queue_drops_and_counts_never_silently(tmp_path):
    gate, written = threading.Event(), []
    from furlong.observe.store import SqliteWriter

    real = SqliteWriter(tmp_path / DB_NAME)

    def slow_writer(rows):
        gate.wait(30)
        written.append(rows)
        real.write(rows)

    store = EventStore(tmp_path, writer=slow_writer, queue_size=4, batch_size=1, max_block_s=0.001)
    for i in range(50):
        store.metric(i, "m", i)
    assert store.dropped > 0
    gate.set()
    assert store.flush(timeout_s=30)
    store.metric(99, "m", 99.0)
    store.close()
    kept = rows(tmp_path, "SELECT COUNT(*) FROM metrics")[0][0]
    assert kept + store.dropped == 51 and (99, 99.0) in rows(tmp_path, "SELECT step, value FROM metrics")
    assert RunReader(tmp_path).summary()["dropped_events"] == store.dropped


def test_a_failed_write_is_counted_and_the_writer_survives(tmp_path):
    calls = []

    def flaky(rows):
        calls.append(rows)
        if len(calls) == 1:
            raise sqlite3.OperationalError("disk I/O error")

    store = EventStore(tmp_path, writer=flaky)
    store.metrics(1, {"a": 1.0, "b": 2.0})
    store.flush()
    store.metrics(2, {"a": 1.0})
    store.flush()
    store.close()
    assert store.dropped == 2 and store.written == 1
    assert calls[-1]["meta"][0][1] == "2"  # the next successful batch carries the drop count


def test_non_finite_metrics_become_null(tmp_path):
    with EventStore(tmp_path) as store:
        store.metrics(1, {"nan": math.nan, "inf": math.inf, "ok": 1.0})
    series = RunReader(tmp_path).metrics()["series"]
    assert series["nan"] == [[1, None]] and series["inf"] == [[1, None]] and series["ok"] == [[1, 1.0]]
