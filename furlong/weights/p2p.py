"""P2P sync: every trainer rank sends its own part of the model to every engine — no rank-0 funnel.

Design. With N trainer ranks, the parameter list (names and global shapes,
which every rank knows) is split into N parts of about equal bytes by a
deterministic greedy partition (`partition`), so all ranks agree on who owns
what without talking. Rank r then:

1. obtains the full tensors of the parameters it owns. Under FSDP2 a
   parameter is a DTensor sharded on dim 0; rank r *gathers* (not
   all-gathers) the dim-0 shards of its own parameters from the other ranks
   (`gather_to`), so each rank receives ~1/N of the model instead of rank 0
   receiving all of it. Plain (replicated) tensors need no communication.
2. writes them into its own shared-memory segments and posts them to every
   engine (`/update_weights_from_tensor` accepts any subset of names), so the
   engines assemble the model from N concurrent streams.
3. versioning: every bucket carries the engine's current version except one
   bucket held back by rank 0; after an all-reduce of "did my part land?"
   over the trainer group, rank 0 posts that last bucket with the new
   version only if every rank succeeded. So the version bumps once, after all
   parts have landed, as with the other transports.

All ranks check the whole list against the engine schema before sending, so
they all refuse a bad name or shape together. Across nodes, the same split
works over the broadcast transport (one group per rank) — not built yet; on
one node this module is the multi-writer form of `shm`.

What it does not do: send raw FSDP shards for the engine to stitch, which
would save the gather. That needs the engine to accept a row range per
tensor spec (`"rows": [a, b]` of dim 0) and to stage partial tensors until a
commit, so a half-written parameter is never used. Note also that
`Trainer.state_dict_for_sync` yields full tensors on every rank (an
all-gather); the gather above only saves traffic when the trainer hands over
its sharded `state_dict()` (DTensors) instead, as test_weights_p2p.py does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from furlong.weights.base import buckets
from furlong.weights.report import SyncReport, WeightSyncError
from furlong.weights.shm import ShmSender


def partition(sizes: list[int], world_size: int) -> list[int]:
    """Owner rank of each item: largest first onto the least-loaded rank (ties: lowest rank).

    Rank 0 always owns at least one item (it carries the version stamp).
    """
    if world_size < 1:
        raise ValueError(f"world_size: must be at least 1, got {world_size}")
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + sizes[i]
    return owner


def global_nbytes(t: torch.Tensor) -> int:
    return t.shape.numel() * t.element_size()


def gather_to(t: torch.Tensor, owner: int, rank: int, world_size: int, group=None) -> torch.Tensor | None:
    """The full tensor on `owner` (None elsewhere); collective for sharded DTensors."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return t.detach() if rank == owner else None
    placements = t.placements
    if t.device_mesh.ndim == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0:
        local = t.to_local().detach()
        rows = t.shape[0]
        chunk = -(-rows // world_size)  # FSDP2 splits dim 0 like torch.chunk
        padded = local.new_zeros((chunk, *t.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(world_size)] if rank == owner else None
        dist.gather(padded, parts, dst=owner, group=group)
        return torch.cat(parts)[:rows] if parts is not None else None
    full = t.full_tensor().detach()  # other layouts: correct, though every rank gets it
    return full if rank == owner else None


class P2PSender(ShmSender):
    transport = "p2p"
    every_rank_sends = True

    def __init__(self, bucket_mb: float = 64, group=None, **kw):
        """`rank` / `world_size` (keyword options) default to the trainer's torch.distributed group."""
        super().__init__(bucket_mb=bucket_mb, **kw)
        if self.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("p2p: world_size > 1 needs torch.distributed initialised (the trainer group)")
        self.group = group

    def _send(self, items: list[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        owners = partition([global_nbytes(t) for _, t in items], self.world_size)
        mine = []
        for (name, t), owner in zip(items, owners):
            full = gather_to(t, owner, self.rank, self.world_size, self.group) if self.world_size > 1 else t.detach()
            if full is not None:
                mine.append((name, full))
        self._sent = mine  # verify: each rank checks the parameters it owns
        groups = buckets(mine, self.bucket_bytes) if mine else []
        held = groups.pop() if self.rank == 0 else None
        try:
            self._send_groups(groups, report, stamp_last=False)
        finally:
            failed = torch.tensor([0 if report.ok else 1])
            if self.world_size > 1:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if failed.item():
            if report.ok:
                raise WeightSyncError(f"p2p: another trainer rank failed; version {report.version} not stamped", report)
            return
        if held is not None:
            self._send_groups([held], report, stamp_last=True)
