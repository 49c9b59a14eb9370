"""A standalone torch.distributed group for weight broadcast (trainer rank 0 → engines).

Why not `init_process_group`: the engine (and a trainer that already runs FSDP)
may hold a default group of its own; a weight-update group is a separate
rendezvous built from a `TCPStore`, so it never disturbs the default one.
Both sides call `init_group` with the same address, port and world size.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def init_group(
    master_address: str, master_port: int, world_size: int, rank: int, backend: str = "gloo", timeout_s: float = 60.0
):
    """Join (rank 0: host) the group; returns the ProcessGroup."""
    if backend != "gloo":
        if backend == "nccl" and torch.cuda.is_available():
            timeout = timedelta(seconds=timeout_s)
            store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
            return dist.ProcessGroupNCCL(store, rank, world_size)
        raise ValueError(f"backend: {backend!r} is not available here; use gloo")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def broadcast(group, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast of one tensor from `src` over `group`."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    # gloo has no float8 types (quantised codes and scales, engine.quantization): move their bytes as uint8.
    wire = tensor.view(torch.uint8) if tensor.is_floating_point() and tensor.element_size() == 1 else tensor
    group.broadcast([wire], opts).wait()
    return tensor
