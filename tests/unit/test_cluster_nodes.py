"""Multi-node rules without a cluster: bind addresses, the mandatory token, transports across nodes, bundles."""

from __future__ import annotations

import pytest

from furlong.cluster import nodes
from furlong.config.schema import ClusterConfig, WeightsConfig


def test_servers_bind_the_node_address_only_across_nodes():
    assert nodes.bind_host("127.0.0.1", "10.0.0.7", multi=False) == ("127.0.0.1", "127.0.0.1")
    assert nodes.bind_host("127.0.0.1", "10.0.0.7", multi=True) == ("10.0.0.7", "10.0.0.7")
    assert nodes.bind_host("0.0.0.0", "10.0.0.7", multi=True) == ("0.0.0.0", "10.0.0.7")  # URL: a dialable address
    assert nodes.bind_host("10.0.0.9", "10.0.0.7", multi=True) == ("10.0.0.9", "10.0.0.9")  # set explicitly: kept


def test_admin_token_is_mandatory_across_nodes():
    nodes.require_token("", multi=False)
    nodes.require_token("t", multi=True)
    with pytest.raises(ValueError, match="admin token"):
        nodes.require_token("", multi=True)


@pytest.mark.parametrize("transport", ["shm", "p2p", "delta"])
def test_same_host_transports_are_refused_across_nodes(transport):
    w = WeightsConfig(transport=transport)
    assert nodes.weight_transport(w, multi=False, n_nodes=1) == transport
    with pytest.raises(ValueError, match=f"weights.transport={transport} .* 2 nodes.*broadcast"):
        nodes.weight_transport(w, multi=True, n_nodes=2)


def test_broadcast_is_the_default_across_nodes():
    assert nodes.weight_transport(WeightsConfig(), multi=False, n_nodes=1) == "shm"
    assert nodes.weight_transport(WeightsConfig(), multi=True, n_nodes=3) == "broadcast"
    assert nodes.weight_transport(WeightsConfig(transport="disk"), multi=True, n_nodes=3) == "disk"


def test_bundles_carry_the_placement_resources_cycling():
    c = ClusterConfig(trainer_nodes=["node:10.0.0.1"], engine_nodes=["a", "b"])
    got = nodes.bundles(c, world_size=2, engines=3, gpu=1)
    assert [b.get("node:10.0.0.1") for b in got[:2]] == [nodes.SLIVER] * 2
    assert [next(k for k in b if k not in ("CPU", "GPU")) for b in got[2:]] == ["a", "b", "a"]
    assert all(b["GPU"] == 1 and b["CPU"] == 1 for b in got)
    assert nodes.bundles(ClusterConfig(), 1, 1, 0) == [{"CPU": 1}, {"CPU": 1}]


def test_broadcast_uses_nccl_only_when_both_sides_compute_on_gpus():
    assert nodes.broadcast_backend("auto", "auto", gpus=False) == "gloo"
    assert nodes.broadcast_backend("auto", "auto", gpus=True) == "nccl"
    assert nodes.broadcast_backend("nccl", "cpu", gpus=True) == "gloo"  # a CPU engine receives host memory
    assert nodes.broadcast_backend("gloo", "cuda", gpus=True) == "gloo"
    assert nodes.broadcast_backend("nccl", "cuda:1", gpus=False) == "nccl"


def test_a_placement_resource_no_node_has_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setattr(nodes, "alive_nodes", lambda: [{"Resources": {"CPU": 2, "node:10.0.0.1": 1, "gpu_box": 1}}])
    nodes.check_resources(ClusterConfig(engine_nodes=["gpu_box"], trainer_nodes=["node:10.0.0.1"]))
    with pytest.raises(ValueError, match=r"cluster.engine_nodes: no alive Ray node has the resource\(s\) \['gpu_bx'\]"):
        nodes.check_resources(ClusterConfig(engine_nodes=["gpu_bx"]))
