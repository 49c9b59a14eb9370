"""`init_ray` with a Ray already running in this process (an earlier run in the same interpreter).

Too few CPUs for the run's bundles used to leave the placement group waiting until a 120 s timeout: now an
idle local Ray is restarted bigger, and one in which something still holds CPUs is a clear error.
"""

from __future__ import annotations

import pytest


@pytest.mark.timeout(180)
def test_a_small_idle_ray_is_restarted_and_a_busy_one_refused():
    import ray

    from furlong.cluster.topology import init_ray
    from furlong.config.schema import ClusterConfig

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        init_ray(ClusterConfig(), 2)  # enough: reused as it is
        assert ray.cluster_resources()["CPU"] == 2
        init_ray(ClusterConfig(), 3)
        assert ray.cluster_resources()["CPU"] == 3  # idle: restarted with room for 3 bundles
        pg = ray.util.placement_group([{"CPU": 1}] * 3)
        ray.get(pg.ready(), timeout=60)
        with pytest.raises(RuntimeError, match="has 3 CPUs but this run places 5 one-CPU bundles"):
            init_ray(ClusterConfig(), 5)
    finally:
        ray.shutdown()


@pytest.mark.timeout(180)
def test_a_local_ray_runs_its_workers_at_the_drivers_priority(monkeypatch):
    """Ray's default niceness of 15 let any busy program starve a trainer (module docstring of topology.py)."""
    import os

    import ray

    from furlong.cluster.topology import NICENESS, init_ray
    from furlong.config.schema import ClusterConfig

    monkeypatch.delenv(NICENESS, raising=False)
    if ray.is_initialized():
        ray.shutdown()
    init_ray(ClusterConfig(num_cpus=1), 1)
    try:
        niceness = ray.get(ray.remote(lambda: os.nice(0)).remote(), timeout=120)
        assert niceness == os.nice(0), f"a Ray worker runs at nice {niceness}, the driver at {os.nice(0)}"
        assert NICENESS not in os.environ  # set for the raylet only, not left behind for later children
    finally:
        ray.shutdown()


def test_omp_num_threads_caps_the_derived_threads_but_not_an_explicit_count(monkeypatch):
    from furlong.cluster.topology import threads_per_process
    from furlong.config.schema import ClusterConfig

    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert threads_per_process(ClusterConfig(num_cpus=4), 1, 1, "sync") == 4  # the cores bound it first
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads_per_process(ClusterConfig(num_cpus=4), 1, 1, "sync") == 1
    assert threads_per_process(ClusterConfig(num_cpus=4, threads_per_process=3), 1, 1, "sync") == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_process(ClusterConfig(num_cpus=4), 1, 1, "async") == 2
