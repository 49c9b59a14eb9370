"""Borrowed cores (`cluster.borrow_idle_cores`): the trainer computes on the engines' cores once they are idle.

The thread lease itself (furlong/train/threads.py), which runs get it (`driver.build.core_sharing`), and a
real async run (Ray trainer actor, engine process, router): each train step starts on the split share, the
driver sees the engines idle (the buffer full of finished groups) and lends their cores through the actor's
control thread while the step runs, and the step's micro-batches run on them, then go back to one thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
import ray
import torch

from furlong.config import load_config
from furlong.train.threads import Lease


def test_a_lease_takes_lent_threads_at_the_next_micro_batch_until_they_are_taken_back():
    lease, before = Lease(), torch.get_num_threads()

    def lend(threads: int) -> None:  # from another thread, as the actor's control thread does
        t = threading.Thread(target=lease.lend, args=(threads,))
        t.start()
        t.join()

    try:
        with lease.step(1):
            assert torch.get_num_threads() == 1
            seen = []
            for i in lease.each(range(4)):
                seen.append(torch.get_num_threads())
                if i == 1:
                    lend(2)
                    assert torch.get_num_threads() == 1  # the count is this thread's: it changes at the next one
            assert seen == [1, 1, 2, 2] and lease.borrowed == 2
        assert torch.get_num_threads() == 1  # the step ends on its own share
        lend(0)  # the driver takes the cores back
        with lease.step(1):
            assert [torch.get_num_threads() for _ in lease.each(range(2))] == [1, 1] and lease.borrowed == 0
        lend(2)  # a lend that reaches the rank just before its step starts counts for that step
        with lease.step(1):
            assert [torch.get_num_threads() for _ in lease.each(range(2))] == [2, 2] and lease.borrowed == 2
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="threads must be >= 0"):
            lease.lend(-1)
    finally:
        torch.set_num_threads(before)


def test_a_lend_during_a_backward_pass_is_taken_before_the_next_autograd_node():
    lease, before, seen = Lease(), torch.get_num_threads(), []

    class Record(torch.autograd.Function):  # each backward notes the threads it ran on
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(torch.get_num_threads())
            return g

    class LendHere(Record):  # the driver's lend, arriving while this node's backward runs
        @staticmethod
        def backward(ctx, g):
            threading.Thread(target=lease.lend, args=(2,)).start()
            while not lease.lent:
                pass
            return g

    try:
        lease.lend(0)  # lent to once before: armed
        with lease.step(1):
            for _ in lease.each(range(1)):
                x = torch.ones(3, requires_grad=True)
                lease.backward(Record.apply(LendHere.apply(Record.apply(x))).sum())
            assert seen == [1, 2] and lease.borrowed == 1 and torch.get_num_threads() == 2
            assert x.grad.tolist() == [1.0, 1.0, 1.0]
        assert torch.get_num_threads() == 1

        class LendInForward(Record):  # the lend arrives during the forward: the whole backward takes it
            @staticmethod
            def forward(ctx, x):
                lease.lend(2)
                return x.clone()

        lease.lend(0)
        seen.clear()
        with lease.step(1):
            for _ in lease.each(range(1)):
                lease.backward(Record.apply(LendInForward.apply(torch.ones(3, requires_grad=True))).sum())
            assert seen == [2, 2] and lease.borrowed == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_borrowing_runs_only_where_an_async_run_splits_the_cores(monkeypatch):
    from furlong.config import ConfigError
    from furlong.driver.build import core_sharing

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    top = SimpleNamespace(engine_urls=["http://127.0.0.1:1"])

    def borrow(*overrides: str):
        cfg = load_config(None, ["cluster.num_cpus=2", "cluster.borrow_idle_cores=true", *overrides])
        got = core_sharing(cfg, top, "t").borrow
        return got and got[0]

    assert borrow("rollout.mode=async") == 2 and borrow("rollout.mode=overlap") == 2
    assert borrow("rollout.mode=async", "cluster.lend_idle_cores=true") == 2  # the two combine
    assert not borrow("rollout.mode=sync")  # the trainer has every core already
    assert not borrow("rollout.mode=async", "cluster.threads_per_process=1")
    assert not borrow("rollout.mode=async", "cluster.colocate=true")
    assert core_sharing(load_config(None, ["rollout.mode=async"]), top, "t").borrow is None  # off by default
    with pytest.raises(ConfigError, match="cluster.borrow_idle_cores"):
        load_config(None, ["cluster.borrow_idle_cores=true", "cluster.share_cores=true"])


@pytest.mark.timeout(420)
def test_an_async_trainer_computes_on_the_idle_engines_cores_then_gives_them_back(tmp_path, monkeypatch):
    from furlong.driver.run import Run

    # The suite's parallel workers run with OMP_NUM_THREADS=1, which caps every derived thread count (borrowing
    # included: nothing to lend); this run is the one that asks for two.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")

    run_dir = tmp_path / "run"
    cfg = load_config(
        "recipes/debug.yaml",
        [
            f"run_dir={run_dir}",
            "data.n_eval=1",
            "rollout.mode=async",
            "train.total_steps=3",
            "train.micro_batch_tokens=24",  # one sample (prompt + 8 tokens > 12) a micro-batch: 4 a step
            "cluster.num_cpus=2",
            "cluster.borrow_idle_cores=true",
            "train.before_train_step=tests.integration.borrow_plugins:wait_for_lent_cores",
        ],
    )
    try:
        result = asyncio.run(Run(cfg, progress=False).run())
    finally:
        ray.shutdown()
    assert result["steps"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:  # the hook held each step until the lend came: every micro-batch ran on the lent cores
        assert row["perf/borrowed_micro_batches"] == 4, row
