"""Resume picks the newest checkpoint that loads, rewinds the run's records to it, and loads nothing foreign.

`Run._restore` with stand-ins for the trainer group (which fails on the checkpoints a
test marks damaged), the rollout manager and the weight sync; the run's records are
real files (`metrics.jsonl`, `samples/`, `events.sqlite`) written by the real sinks.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest

from furlong.config.schema import ObserveConfig
from furlong.core.version import WeightVersion
from furlong.driver.metrics import MetricLog
from furlong.driver.restarts import RunStopped
from furlong.driver.run import Run
from furlong.driver.rundir import checkpoint_dir, write_driver_state
from furlong.observe.sinks import JsonlSink
from furlong.observe.store import DB_NAME, EventStore


class Trainers:
    def __init__(self, damaged: set[str]):
        self.damaged, self.loaded = damaged, []

    def load(self, path: str) -> int:
        self.loaded.append(path)
        if path in self.damaged:
            raise RuntimeError(f"{path}/dcp: DCP could not load it: truncated file")
        return 0


class Manager:
    def __init__(self):
        self.state = None

    def load_state_dict(self, state):
        self.state = state

    async def on_weights_updated(self, version):
        pass


class Log(MetricLog):
    """The driver's real records (JSONL sink, event store); notes and rewinds kept for the asserts."""

    def __init__(self, run_dir):
        super().__init__(run_dir, ObserveConfig(tensorboard=False), {})
        self.notes, self.rewound = [], []

    def note(self, text):
        self.notes.append(text)

    def rewind(self, step):
        self.rewound.append(step)
        super().rewind(step)


def make_run(run_dir, damaged=()) -> Run:
    run = Run.__new__(Run)
    run.run_dir, run.step, run.resume, run.version = run_dir, 0, True, WeightVersion(0)
    run.trainers, run.manager, run.log = (
        Trainers({str(checkpoint_dir(run_dir, s)) for s in damaged}),
        Manager(),
        Log(run_dir),
    )

    async def sync(version):
        return {}

    run._sync_weights = sync
    return run


def checkpoints(run_dir, *steps):
    for s in steps:
        path = checkpoint_dir(run_dir, s)
        path.mkdir(parents=True)
        write_driver_state(path, {"step": s, "version": s, "rollout": {"at": s}, "log": {}})


def records(run_dir, steps):
    """What a run that got to `steps` left: a metrics row, a samples file and event-store rows per step."""
    sink = JsonlSink(run_dir / "metrics.jsonl")
    (run_dir / "samples").mkdir()
    with EventStore(run_dir, sinks=[sink]) as store:
        for n in range(1, steps + 1):
            store.metrics(n, {"loss": float(n)})
            store.record_span("driver", "generate", n, 0.0, 1.0)
            (run_dir / "samples" / f"step_{n - 1}.jsonl").write_text("{}\n")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')  # a torn last line: the driver was killed mid-write


def db(run_dir, sql):
    with sqlite3.connect(run_dir / DB_NAME) as c:
        return [r[0] for r in c.execute(sql).fetchall()]


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning_and_the_records_rewind_to_it(tmp_path):
    records(tmp_path, 4)
    checkpoints(tmp_path, 1, 2, 3)
    run = make_run(tmp_path, damaged={3})
    asyncio.run(run._restore())
    assert run.step == 2 and run.version.current == 2 and run.manager.state == {"at": 2}
    assert run.trainers.loaded == [str(checkpoint_dir(tmp_path, 3)), str(checkpoint_dir(tmp_path, 2))]
    warning = next(n for n in run.log.notes if n.startswith("warning:"))
    assert str(checkpoint_dir(tmp_path, 3)) in warning and "truncated file" in warning and "the one before" in warning
    assert f"resumed from {checkpoint_dir(tmp_path, 2)} at step 2" in run.log.notes[-1]
    assert run.log.rewound == [2]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]  # rows 3, 4 and the torn one are gone
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_0.jsonl", "step_1.jsonl"]
    assert db(tmp_path, "SELECT step FROM metrics ORDER BY step") == [1, 2]
    assert db(tmp_path, "SELECT step FROM spans ORDER BY step") == [1, 2]
    run.log.write(3, {"loss": 3.0})  # the resumed run's rows follow the kept ones, through the open sink
    run.log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert db(tmp_path, "SELECT step FROM metrics ORDER BY step") == [1, 2, 3]


def test_no_checkpoint_that_loads_stops_the_run_naming_each(tmp_path):
    checkpoints(tmp_path, 1, 2)
    run = make_run(tmp_path, damaged={1, 2})
    with pytest.raises(RunStopped, match="no checkpoint of this run loads") as e:
        asyncio.run(run._restore())
    run.log.close()
    assert str(checkpoint_dir(tmp_path, 1)) in str(e.value) and str(checkpoint_dir(tmp_path, 2)) in str(e.value)


def test_a_checkpoint_outside_the_run_directory_is_not_loaded(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    checkpoints(elsewhere, 5)
    run_dir = tmp_path / "run"
    checkpoints(run_dir, 1)
    checkpoint_dir(run_dir, 5).symlink_to(checkpoint_dir(elsewhere, 5), target_is_directory=True)
    run = make_run(run_dir)
    asyncio.run(run._restore())
    run.log.close()
    assert run.step == 1 and run.trainers.loaded == [str(checkpoint_dir(run_dir, 1))]
    assert any("outside" in n and str(checkpoint_dir(run_dir, 5)) in n for n in run.log.notes)


def test_no_checkpoint_at_all_starts_over_with_empty_records(tmp_path):
    records(tmp_path, 2)
    run = make_run(tmp_path)
    asyncio.run(run._restore())
    run.log.close()
    assert run.step == 0 and run.resume is False and run.log.rewound == [0]
    assert (tmp_path / "metrics.jsonl").read_text() == "" and not list((tmp_path / "samples").iterdir())
    assert db(tmp_path, "SELECT step FROM metrics") == []


def test_checkpoints_are_on_by_default_every_n_steps_or_m_minutes_whichever_first():
    import time
    from types import SimpleNamespace

    from furlong.config.schema import TrainConfig

    d = TrainConfig()
    assert d.checkpoint_every > 0 and d.checkpoint_every_min > 0 and d.keep_checkpoints == 3
    run = Run.__new__(Run)
    run.cfg = SimpleNamespace(train=TrainConfig(total_steps=100, checkpoint_every=4, checkpoint_every_min=10))
    due = {}
    for step, minutes_ago in [(3, 0), (4, 0), (5, 11), (5, 9), (100, 11)]:
        run.step, run.saved_at = step, time.monotonic() - minutes_ago * 60
        due[(step, minutes_ago)] = run._checkpoint_due()
    # step 4: by steps; step 5 after 11 minutes: by time; the last step: the final save takes it
    assert due == {(3, 0): False, (4, 0): True, (5, 11): True, (5, 9): False, (100, 11): False}
