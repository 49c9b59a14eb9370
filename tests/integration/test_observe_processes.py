"""Several processes share one event store: spawned processes write concurrently, a forked child keeps writing."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3

from furlong.core.sample import Sample, Source, Status
from furlong.observe.reader import RunReader
from furlong.observe.store import DB_NAME, EventStore


def make_sample(index=0) -> Sample:
    s = Sample(index=index, prompt="p", tokens=[1, 2])
    s.append([7, 8], logprobs=[-0.5, -1.5], version=1)
    s.append([9], source=Source.TOOL, version=1)
    s.reward, s.status = 1.0, Status.COMPLETED
    return s.validate()


def rows(run_dir, sql):
    with sqlite3.connect(run_dir / DB_NAME) as c:
        return c.execute(sql).fetchall()


def _child_writes(run_dir: str, worker: str, n: int) -> None:
    with EventStore(run_dir, batch_size=7) as store:
        for step in range(n):
            with store.span(worker, "generate", step):
                pass
            store.metrics(step, {f"{worker}/x": step, "shared": 1.0})
            store.samples(step, [make_sample(index=step)])


def test_several_processes_write_one_store(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child_writes, args=(str(tmp_path), f"engine/{i}", 40)) for i in range(3)]
    for p in procs:
        p.start()
    _child_writes(str(tmp_path), "driver", 40)  # and this process at the same time
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    summary = RunReader(tmp_path).summary()
    assert summary["counts"] == {"spans": 160, "metrics": 320, "samples": 160}
    assert summary["workers"] == ["driver", "engine/0", "engine/1", "engine/2"]
    assert summary["steps"] == list(range(40)) and summary["dropped_events"] == 0


def _forked_child(store: EventStore) -> None:
    store.metric(5, "child", 1.0)
    store.close()


def test_a_forked_child_keeps_using_the_parents_store(tmp_path):
    store = EventStore(tmp_path)
    store.metric(1, "parent", 1.0)
    store.flush()
    p = mp.get_context("fork").Process(target=_forked_child, args=(store,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    store.close()
    assert sorted(rows(tmp_path, "SELECT name FROM metrics")) == [("child",), ("parent",)]
