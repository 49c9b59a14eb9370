"""torch.distributed set-up and FSDP2 wrapping: gloo on CPU, NCCL on GPU.

World size 1 skips both the process group and FSDP: a plain module does the
same maths (tested against world size 2) without needing a rendezvous, so
in-process use in tests and notebooks stays free.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"train.backend: unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("train.backend=nccl needs a CUDA device; use gloo (or auto) on CPU")
    return backend


def init(rank: int, world_size: int, backend: str) -> torch.device:
    """Join the process group (env:// rendezvous, MASTER_ADDR defaults to 127.0.0.1) and pick the device."""
    if not 0 <= rank < world_size:
        raise ValueError(f"trainer: rank={rank} is outside world_size={world_size}")
    backend = resolve_backend(backend)
    device = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise ValueError("trainer: world_size > 1 needs MASTER_PORT in the environment for the rendezvous")
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    return device


def close() -> None:
    """Leave the process group: wait for every rank, then destroy it.

    A rank whose interpreter exits while its gloo group is alive (and a peer still
    mid-collective or mid-save) can abort in gloo's C++ threads with "terminate called
    without an active exception". Ranks that end on their own call this first; Ray
    actors are killed by the TrainerGroup instead and need not.
    """
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


MIXED_PRECISION = ("none", "bf16")


def mixed_policy(mode: str):
    """FSDP2's `MixedPrecisionPolicy` for `train.mixed_precision`, or None (`none`: compute in the parameters' dtype).

    `bf16`: parameters are all-gathered and used in bfloat16 for forward and backward, while
    the sharded master weights, the optimiser state and the gradient reduce-scatter stay in
    fp32 (`reduce_dtype`), so small updates are not lost to bf16's 8-bit mantissa. On GPUs
    this is the usual RL-trainer setting; on CPU (gloo) it runs too, only slower.
    """
    if mode not in MIXED_PRECISION:
        raise ValueError(f"train.mixed_precision: {mode!r} is not one of {list(MIXED_PRECISION)}")
    if mode == "none":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def distribute(model: nn.Module, device: torch.device, world_size: int, mixed_precision: str = "none") -> nn.Module:
    """A trainer's module made ready for its ranks: FSDP2 shards over several (`shard`, with FSDP2's
    mixed-precision policy); on one rank, `mixed_precision=bf16` wraps the module's forward in autocast.

    Why autocast on one rank: FSDP2's policy needs sharded modules, and one rank is the common laptop
    and single-GPU case. Autocast runs the matmuls in bf16 and leaves the rest in fp32: master weights,
    gradients, AdamW state, norms and softmax (the trainer takes logits to fp32 before its log-softmax),
    so small updates are not lost. Matmuls are where the time goes: on a CPU with AMX (bf16 tiles) a
    trainer step ran 1.63x faster than in fp32 (docs/benchmarks.md#bf16-on-cpu)."""
    if world_size > 1:
        return shard(model, device, mixed_precision)
    if mixed_precision == "bf16":
        model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)
    return model


def shard(model: nn.Module, device: torch.device, mixed_precision: str = "none") -> nn.Module:
    """FSDP2: shard every transformer block (the classes HF lists in `_no_split_modules`), then the root.

    Over NCCL on GPU ranks, over gloo on CPU ranks (the same calls); `mixed_precision` see `mixed_policy`.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mp = mixed_policy(mixed_precision)
    extra = {"mp_policy": mp} if mp is not None else {}
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks: set[str] = set()
    for m in model.modules():
        blocks.update(getattr(m, "_no_split_modules", None) or [])
    for m in list(model.modules()):
        if type(m).__name__ in blocks:
            fully_shard(m, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP-sharded DTensor) parameter; collective when sharded."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every state entry, one at a time; all ranks must iterate together."""
    for name, t in model.state_dict().items():
        yield name, full_tensor(t).detach()


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if world()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (a list of one at world size 1)."""
    if world()[1] == 1:
        return [obj]
    out: list[Any] = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()
