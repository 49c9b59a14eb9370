"""Multi-node path: processes that cannot open the run's file send their batches to one collector actor."""

from __future__ import annotations

import pytest

from furlong.observe.reader import RunReader


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    # A Ray of this module's own: an earlier run in this worker may have left its Ray up (and RAY_ADDRESS set)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_remote_workers_write_through_one_collector(ray_local, tmp_path):
    ray = ray_local
    from furlong.observe.collector import collector_actor, remote_store

    run_dir = tmp_path / "run"
    actor = collector_actor(run_dir)

    @ray.remote(num_cpus=0)
    def worker(name: str, steps: int) -> int:
        from furlong.core.sample import Sample
        from furlong.observe.collector import collector_actor, remote_store

        store = remote_store(collector_actor(run_dir), batch_size=3)  # found by name, not passed in
        for step in range(steps):
            with store.span(name, "generate", step, device="cpu"):
                pass
            store.metrics(step, {f"{name}/tokens": 10.0 * step})
            s = Sample(index=step, prompt="p", tokens=[1])
            s.append([5, 6], logprobs=[-0.1, -0.2], version=step)
            s.reward = 1.0
            store.samples(step, [s])
        store.close()
        return store.dropped

    assert ray.get([worker.remote(f"engine/{i}", 6) for i in range(3)]) == [0, 0, 0]
    local = remote_store(actor)  # the driver may use the collector too
    local.metric(0, "driver/x", 1.0)
    local.close()
    summary = RunReader(run_dir).summary()
    assert summary["workers"] == ["engine/0", "engine/1", "engine/2"]
    assert summary["counts"] == {"spans": 18, "metrics": 19, "samples": 18}
    assert summary["steps"] == list(range(6))
    assert RunReader(run_dir).sample(1)["tokens"]["ids"] == [5, 6]
