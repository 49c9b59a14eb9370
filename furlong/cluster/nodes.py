"""Which node each process lands on, and what changes when a run spans more than one.

On one machine every server binds loopback and the weights may cross through this host's
shared memory. Across nodes neither holds: a server on loopback cannot be reached from the
next node, and `/dev/shm` is not shared. So a run is *multi-node* when `cluster.address`
joins a cluster or Ray reports more than one alive node, and then:

* each server binds its node's routable address (a `host` left on loopback is replaced by
  the IP Ray reports for the node its bundle landed on) and its URL carries that IP;
* the admin token is mandatory: control endpoints reachable from other machines must
  never be open (`require_token`);
* the same-host transports (`SAME_HOST`) are refused with a message naming
  `weights.transport`, and an unset transport becomes `broadcast` (`weight_transport`).

Placement: `cluster.trainer_nodes` / `cluster.engine_nodes` name Ray resources (a custom
resource a node was started with, `ray start --resources='{"engines": 8}'`, or Ray's own
`node:<ip>`); rank or engine i gets a sliver of the i-th name (cycling), so its bundle can
only land on a node that has it. Empty lists leave the choice to Ray.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from furlong.config.schema import ClusterConfig, WeightsConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ANY_ADDRESS = ("0.0.0.0", "::")
SAME_HOST = ("shm", "p2p", "delta", "cuda_ipc")  # through this host's shared (host or GPU) memory or local sockets
MULTI_NODE_TRANSPORT = "broadcast"
SLIVER = 0.001  # a placement resource is a label: ask for a sliver, so any number of processes fit


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def is_multi_node(cluster: ClusterConfig) -> bool:
    """A cluster by address, or a Ray of more than one alive node (call after Ray is up)."""
    return cluster.address is not None or len(alive_nodes()) > 1


def bundles(cluster: ClusterConfig, world_size: int, engines: int, gpu: int) -> list[dict[str, float]]:
    """One bundle per trainer rank, then one per engine, with the placement resources asked for."""

    def one(names: list[str], i: int) -> dict[str, float]:
        b: dict[str, float] = {"CPU": 1, **({"GPU": gpu} if gpu else {})}
        if names:
            b[names[i % len(names)]] = SLIVER
        return b

    return [one(cluster.trainer_nodes, r) for r in range(world_size)] + [
        one(cluster.engine_nodes, i) for i in range(engines)
    ]


def check_resources(cluster: ClusterConfig) -> None:
    """Before placing: every resource named exists on some alive node (else Ray would wait forever)."""
    have = {k for n in alive_nodes() for k in n.get("Resources", {})}
    for field in ("trainer_nodes", "engine_nodes"):
        missing = [r for r in getattr(cluster, field) if r not in have]
        if missing:
            raise ValueError(
                f"cluster.{field}: no alive Ray node has the resource(s) {missing}; start a node with "
                f"`ray start --resources='{{\"{missing[0]}\": 1}}'` or name one of {sorted(have)}"
            )


def bundle_nodes(pg: Any) -> list[tuple[str, str]]:
    """(node id, node IP) of each bundle of a ready placement group, in bundle order."""
    from ray.util.placement_group import placement_group_table

    ids = placement_group_table(pg)["bundles_to_node_id"]
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in alive_nodes()}
    return [(ids[i], ips.get(ids[i], "127.0.0.1")) for i in range(len(ids))]


def bind_host(host: str, node_ip: str, multi: bool) -> tuple[str, str]:
    """(the address a server binds, the host its URL names) on a node whose routable IP is `node_ip`.

    One node: as set. Several: a loopback `host` becomes the node's IP; a wildcard stays
    the bind address but the URL names the node's IP (a wildcard is not an address to dial).
    """
    if not multi:
        return host, host
    if host in LOOPBACK:
        return node_ip, node_ip
    if host in ANY_ADDRESS:
        return host, node_ip
    return host, host


def require_token(admin_token: str, multi: bool) -> None:
    if multi and not admin_token:
        raise ValueError(
            "cluster: a run across nodes binds every server to a routable address, so the control endpoints "
            "need the admin token; none was given (the run directory's admin_token file is empty)"
        )


def weight_transport(weights: WeightsConfig, multi: bool, n_nodes: int) -> str:
    """The transport the run uses: as set on one node; across nodes, broadcast unless set, same-host ones refused."""
    if not multi:
        return weights.transport
    if "transport" not in weights.model_fields_set:
        return MULTI_NODE_TRANSPORT
    if weights.transport in SAME_HOST:
        raise ValueError(
            f"weights.transport={weights.transport} moves weights within one host, but this run spans "
            f"{'a Ray cluster (cluster.address)' if n_nodes <= 1 else f'{n_nodes} nodes'}; "
            "use weights.transport=broadcast (the default across nodes), or disk on a filesystem every node shares"
        )
    return weights.transport


def broadcast_backend(train_backend: str, engine_device: str, gpus: bool) -> str:
    """The broadcast group's backend: NCCL (GPU to GPU, no host copy) when trainer and engines compute on GPUs.

    `train_backend` is `train.backend` (auto | gloo | nccl), `engine_device` `engine.device`, `gpus` whether
    the cluster has GPUs. gloo otherwise: it moves host memory, which a CPU engine needs.
    """
    trainer_on_gpu = train_backend == "nccl" or (train_backend == "auto" and gpus)
    engine_on_gpu = engine_device.startswith("cuda") or (engine_device == "auto" and gpus)
    return "nccl" if trainer_on_gpu and engine_on_gpu else "gloo"


def write_placement(run_dir: Path, placed: dict[str, dict[str, str]], *, multi: bool, transport: str | None) -> Path:
    """`<run_dir>/placement.json`: where each process of the run landed (role -> {node_id, node_ip, url}),
    whether the run spans nodes, and the weight transport that follows from it."""
    path = Path(run_dir) / "placement.json"
    doc = {"multi_node": multi, "weights_transport": transport, "processes": placed}
    path.write_text(json.dumps(doc, indent=1, sort_keys=True))
    return path
