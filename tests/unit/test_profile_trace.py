"""`furlong profile`'s pieces: a process profiles itself only when asked, and the traces merge onto one clock."""

from __future__ import annotations

import json
import threading

import torch

from furlong.core import profiling
from furlong.observe.store import EventStore
from furlong.profile import TRACE, merge


def test_profiling_is_off_unless_asked_and_writes_a_chrome_trace_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(profiling.PROFILE_ENV, raising=False)
    assert profiling.start("engine") is False and profiling.stop() is None
    monkeypatch.setenv(profiling.PROFILE_ENV, str(tmp_path))
    assert profiling.start("engine") is True
    other = []
    t = threading.Thread(target=lambda: other.append(profiling.stop()))  # not the profiling thread: no effect
    t.start()
    t.join()
    torch.ones(8, 8) @ torch.ones(8, 8)
    path = profiling.stop()
    assert other == [None] and path is not None and path.parent == tmp_path
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert "aten::mm" in names and profiling.stop() is None


def test_traces_and_spans_merge_onto_one_clock(tmp_path):
    a = {"baseTimeNanoseconds": 1_000_000_000, "traceEvents": [{"ph": "X", "name": "a", "pid": 1, "ts": 5.0}]}
    b = {"baseTimeNanoseconds": 1_002_000_000, "traceEvents": [{"ph": "X", "name": "b", "pid": 2, "ts": 5.0}]}
    (tmp_path / "driver-1.json").write_text(json.dumps(a))
    (tmp_path / "engine-2.json").write_text(json.dumps(b))
    (tmp_path / "trainer-0-3.json").write_text("{not json")  # a process killed while writing
    with EventStore(tmp_path / "run") as store:
        store.record_span("engine/0", "decode", 1, 1.5, 1.75)
    out = merge(tmp_path, tmp_path / "run" / "events.sqlite")
    assert out == tmp_path / TRACE
    events = json.loads(out.read_text())["traceEvents"]
    ts = {e["name"]: e["ts"] for e in events if e["ph"] == "X"}
    assert ts["a"] == 5.0 and ts["b"] == 2005.0  # b's clock starts 2 ms later
    assert ts["decode"] == 1.5e6 - 1e6 and [e["dur"] for e in events if e["name"] == "decode"] == [0.25e6]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"engine/0", "driver (torch)", "engine (torch)"} <= tracks
