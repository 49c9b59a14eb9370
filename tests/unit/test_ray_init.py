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
