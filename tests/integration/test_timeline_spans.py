"""A real 2-engine, 2-rank `furlong train` records what every worker did: spans of each engine, each
trainer rank, the router and the driver, with their phases, in the run's event store; plus utilisation.

The run is the shared session fixture `real_run_dir` (`tests/fixtures/real_run.py`), which the browser
tests read too. The store is read with plain SQL, not through the dashboard's reader.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest

from tests.fixtures.real_run import ENGINES, RANKS, STEPS

pytestmark = pytest.mark.slow


def _rows(run_dir, query, *args):
    with closing(sqlite3.connect(f"file:{run_dir / 'events.sqlite'}?mode=ro", uri=True)) as db:
        return db.execute(query, args).fetchall()


@pytest.mark.timeout(900)
def test_every_engine_rank_router_and_the_driver_record_their_phases(real_run_dir):
    phases: dict[str, set[str]] = {}
    for worker, phase in _rows(real_run_dir, "SELECT DISTINCT worker, phase FROM spans"):
        phases.setdefault(worker, set()).add(phase)
    for i in range(ENGINES):  # every engine: scheduler steps of both kinds, paused for each sync, weights applied
        assert {"prefill", "decode", "paused", "weight-apply"} <= phases.get(f"engine/{i}", set()), i
    for r in range(RANKS):  # every rank: micro-batches, optimiser, old log-probs (2 steps/rollout), push, save
        want = {"forward-backward", "optimiser", "old-logprob", "weight-push", "checkpoint-save"}
        assert want <= phases.get(f"trainer/{r}", set()), r
    assert "route" in phases.get("router", set())
    assert {"generate", "reward", "buffer-wait", "idle", "weight-sync", "eval"} <= phases.get("driver", set())
    # Each rank trained every step, each engine generated: the spans carry the steps they belong to.
    for lane in [f"trainer/{r}" for r in range(RANKS)] + [f"engine/{i}" for i in range(ENGINES)]:
        steps = {s for (s,) in _rows(real_run_dir, "SELECT DISTINCT step FROM spans WHERE worker = ?", lane)}
        assert set(range(1, STEPS + 1)) <= steps, lane
    # Scheduler steps carry what they did; folded runs of steps add their counts up.
    attrs = _rows(
        real_run_dir,
        "SELECT SUM(json_extract(attrs, '$.tokens')), SUM(json_extract(attrs, '$.steps')), COUNT(*) FROM spans"
        " WHERE phase IN ('prefill', 'decode')",
    )[0]
    assert attrs[0] >= attrs[1] >= attrs[2] > 0
    mb = _rows(real_run_dir, "SELECT COUNT(*) FROM spans WHERE phase = 'forward-backward' AND worker = 'trainer/1'")
    assert mb[0][0] >= STEPS * 2  # one span per micro-batch, two optimiser steps per rollout


@pytest.mark.timeout(900)
def test_utilisation_metrics_per_process(real_run_dir):
    names = {n for (n,) in _rows(real_run_dir, "SELECT DISTINCT name FROM metrics WHERE step = ?", STEPS)}
    lanes = [f"engine/{i}" for i in range(ENGINES)] + [f"trainer/{r}" for r in range(RANKS)]
    assert {f"cpu/{x}" for x in lanes + ["router", "driver"]} <= names
    assert {f"perf/mfu/{x}" for x in lanes} <= names
    for (value,) in _rows(real_run_dir, "SELECT value FROM metrics WHERE name LIKE 'perf/mfu/%'"):
        assert 0 < value < 1
