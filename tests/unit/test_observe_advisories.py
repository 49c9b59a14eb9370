"""Advisories fire on the patterns they name, with the steps as evidence, and stay quiet on a clean run."""

from __future__ import annotations

import sqlite3
import time

from furlong.core.sample import Sample, Status
from furlong.observe.advisories import advise
from furlong.observe.reader import RunReader
from furlong.observe.store import EventStore


def group(step, g, rewards, statuses=None, length=4):
    out = []
    for k, r in enumerate(rewards):
        s = Sample(index=g * 10 + k, group_index=g, prompt="p", tokens=[1])
        s.append(list(range(5, 5 + length)), logprobs=[-0.1] * length, version=step)
        s.reward, s.status = r, (statuses or [Status.COMPLETED] * len(rewards))[k]
        out.append(s)
    return out


def write(run_dir, steps, *, slow_step=None, stats=None, rewards=None, lengths=None):
    with EventStore(run_dir) as store:
        t = 1000.0
        for step in range(1, steps + 1):
            dur = 10.0 if step == slow_step else 1.0
            store.record_span("trainer/0", "forward-backward", step, t, t + dur)
            t += dur
            r = (rewards or {}).get(step, [0.0, 1.0])
            store.samples(step, group(step, 0, r, (stats or {}).get(step), (lengths or {}).get(step, 4)))
    return RunReader(run_dir)


def kinds(run_dir_reader, **kw):
    return {a["kind"]: a for a in advise(run_dir_reader, **kw)["advisories"]}


def test_clean_run_has_no_advisories(tmp_path):
    assert kinds(write(tmp_path, 6)) == {}


def test_stall_names_the_slow_step(tmp_path):
    a = kinds(write(tmp_path, 6, slow_step=4))
    assert a["stall"]["steps"] == [4] and "step 4 took 10.00s" in a["stall"]["message"]


def test_live_run_without_events_is_a_stall(tmp_path):
    reader = write(tmp_path, 4)
    later = time.time() + 600  # steps take 1 s; nothing for 10 min
    assert "stall" not in kinds(reader, live=False, now=later)
    assert "no event for" in kinds(reader, live=True, now=later)["stall"]["message"]
    assert "stall" not in kinds(reader, live=True)


def test_zero_variance_truncation_and_abort_storm(tmp_path):
    T, A, C = Status.TRUNCATED, Status.ABORTED, Status.COMPLETED
    a = kinds(write(tmp_path, 4, rewards={2: [1.0, 1.0]}, stats={3: [T, C], 4: [A, A]}))
    assert a["zero-variance"]["steps"] == [2]
    assert a["truncation"]["steps"] == [3] and a["truncation"]["value"] == 0.5
    assert a["abort-storm"]["steps"] == [4] and a["abort-storm"]["value"] == 1.0


def test_length_drift(tmp_path):
    lengths = {s: 4 for s in range(1, 4)} | {s: 40 for s in range(4, 7)}
    a = kinds(write(tmp_path, 6, lengths=lengths))
    assert a["length-drift"]["severity"] == "warn" and "rose from 4 " in a["length-drift"]["message"]


def test_dropped_events_are_an_advisory(tmp_path):
    reader = write(tmp_path, 2)
    with sqlite3.connect(tmp_path / "events.sqlite") as c:
        c.execute("INSERT INTO meta VALUES ('dropped_events:h:1', '3')")  # as a store whose queue overflowed writes
    assert kinds(reader)["dropped-events"]["value"] == 3
