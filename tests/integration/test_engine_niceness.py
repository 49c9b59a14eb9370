"""Time-shared cores: an engine started with `--niceness N` runs every thread at N below its parent's priority,
and async runs derive threads and the engines' niceness from the cores (`cluster.share_cores`)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import httpx
import pytest

from furlong.cluster.topology import engine_niceness, threads_per_process
from furlong.config.schema import ClusterConfig
from tests.helpers import engine_process, token_holders


def _thread_nices(pid: int) -> list[int]:
    """The nice value of every thread of `pid` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out.append(int(stat.rsplit(")", 1)[1].split()[16]))
    return out


@pytest.mark.timeout(240)
def test_engine_niceness_lowers_every_thread_of_the_served_engine():
    token = secrets.token_hex(8)
    with engine_process(token, "--niceness", "7") as (url, _):
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = httpx.post(url + "/generate", json=body, timeout=60)  # its worker threads exist by now
        assert r.status_code == 200, r.text
        (pid,) = token_holders(token)
        nices = _thread_nices(pid)
        assert len(nices) > 1 and set(nices) == {min(os.nice(0) + 7, 19)}, nices


def test_async_runs_time_share_the_cores_with_the_engines_at_lower_priority(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    two = ClusterConfig(num_cpus=2, share_cores=True)
    assert not ClusterConfig().share_cores  # opt-in (see docs/async.md#time-shared-cores)
    assert threads_per_process(two, 1, 1, "sync") == 2 and engine_niceness(two, 1, 1, "sync", 2) == 0
    assert threads_per_process(two, 1, 1, "async") == 2  # shared: as many threads as a sync run
    assert engine_niceness(two, 1, 1, "async", 2) == 10  # 2 + 2 threads on 2 cores: the engine yields
    split = ClusterConfig(num_cpus=2, share_cores=False)
    assert threads_per_process(split, 1, 1, "async") == 1 and engine_niceness(split, 1, 1, "async", 1) == 0
    # Threads that fit the cores (one each, or OMP_NUM_THREADS=1) need no priority.
    assert engine_niceness(ClusterConfig(num_cpus=4, share_cores=True), 1, 1, "async", 2) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads_per_process(two, 1, 1, "async") == 1 and engine_niceness(two, 1, 1, "async", 1) == 0
    assert engine_niceness(ClusterConfig(num_cpus=2, share_cores=True, engine_niceness=3), 1, 2, "overlap", 1) == 3


def test_lent_cores_are_a_sync_runs_threads_taken_back_to_the_split_share(monkeypatch):
    """`cluster.lend_idle_cores`: (threads while the trainer computes, while it waits), only where an async run
    splits the cores; sync runs, explicit thread counts and colocated engines have nothing to lend."""
    from types import SimpleNamespace

    from furlong.config import load_config
    from furlong.driver.build import core_sharing

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    top = SimpleNamespace(engine_urls=["http://127.0.0.1:1"])

    def lend(*overrides: str):
        cfg = load_config(None, ["cluster.num_cpus=2", "cluster.lend_idle_cores=true", *overrides])
        return core_sharing(cfg, top, "t").lend

    assert lend("rollout.mode=async") == (1, 2) and lend("rollout.mode=overlap") == (1, 2)
    assert lend("rollout.mode=sync") is None  # the engines have every core already
    assert lend("rollout.mode=async", "cluster.threads_per_process=1") is None
    assert lend("rollout.mode=async", "cluster.colocate=true") is None
    assert core_sharing(load_config(None, ["rollout.mode=async"]), top, "t").lend is None  # off by default
