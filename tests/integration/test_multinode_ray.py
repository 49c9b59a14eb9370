"""A run across two Ray nodes: the trainer on one, the engine on the other, weights by broadcast.

Two raylets on this machine (`ray.cluster_utils.Cluster`), each with its own custom
resource: `cluster.trainer_nodes` / `cluster.engine_nodes` name them, so the trainer
rank can only land on the head and the engine only on the second node. The run joins
the cluster by `cluster.address`, which makes it multi-node: servers bind the node's
address, the weight transport defaults to broadcast (rank 0's rendezvous on the trainer
node), and `weights.verify=true` compares every engine tensor's CRC32 with the trainer's
after each sync. Afterwards no process of the cluster or the run is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from tests.helpers import processes_left

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "multinode-test-token"


@pytest.fixture()
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # another module's local Ray: this test must join its own cluster
        ray.shutdown()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"trainer_host": 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=2, resources={"engine_host": 1})
        cluster.wait_for_nodes()
        session_dir = cluster.head_node.get_session_dir_path()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
    deadline = time.monotonic() + 20
    while processes_left(TOKEN, session_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_left(TOKEN, session_dir), processes_left(TOKEN, session_dir)


@pytest.mark.timeout(300)
def test_trainer_and_engine_on_different_nodes_sync_by_broadcast(tmp_path, two_nodes):
    import ray

    from furlong.config import load_config
    from furlong.driver.run import Run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "admin_token").write_text(TOKEN)
    cfg = load_config(
        str(ROOT / "recipes" / "debug.yaml"),
        [
            f"run_dir={run_dir}",
            f"cluster.address={two_nodes.address}",
            "cluster.trainer_nodes=[trainer_host]",
            "cluster.engine_nodes=[engine_host]",
            "cluster.threads_per_process=1",
            "train.total_steps=1",
            "data.n_eval=1",
            "weights.verify=true",
            "algo.entropy_coef=0.01",
        ],
    )
    assert "transport" not in cfg.weights.model_fields_set  # across nodes the unset transport becomes broadcast
    result = asyncio.run(Run(cfg, progress=False).run())
    assert result["steps"] == 1

    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    doc = json.loads((run_dir / "placement.json").read_text())
    assert doc["multi_node"] and doc["weights_transport"] == "broadcast"
    placed = doc["processes"]
    trainer, engine = placed["trainer-0"], placed["engine-0"]
    assert "trainer_host" in nodes[trainer["node_id"]]["Resources"]
    assert "engine_host" in nodes[engine["node_id"]]["Resources"]
    assert trainer["node_id"] != engine["node_id"]
    assert engine["url"].startswith(f"http://{nodes[engine['node_id']]['NodeManagerAddress']}:")

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    (m,) = [r for r in records if "weight_sync/version" in r]  # the step's record (other lines: perf, cpu)
    assert m["train/grad_norm"] > 0, "the step did not change the weights"
    assert m["weight_sync/version"] == 1
    assert m["weight_sync/verified"] == 1, "the cross-node sync was not verified"
