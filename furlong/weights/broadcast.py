"""Sync by torch.distributed broadcast: trainer rank 0 is rank 0 of a group, engines are ranks 1..M.

Why a group of its own: it works across nodes (the path when one machine is
not enough) and with NCCL moves GPU memory without a host copy. `connect`
forms the group: each engine joins through `/init_weights_update_group` (the
call blocks until everyone has joined, so the engines are asked on their lanes
while this process hosts the rendezvous). Per bucket, every engine is told the
names, dtypes and shapes (`/update_weights_from_distributed`), then each tensor
is broadcast in that order; the engine receives them all before it checks and
applies the bucket, so the sender never hangs on a refusal.
"""

from __future__ import annotations

import torch

from furlong.core.client import EngineControl, EngineError
from furlong.core.net import free_port
from furlong.weights.base import Sender, buckets, nbytes
from furlong.weights.dist import broadcast, init_group
from furlong.weights.report import SyncReport, WeightSyncError
from furlong.weights.tensors import dtype_name


class BroadcastSender(Sender):
    transport = "broadcast"

    def __init__(
        self,
        bucket_mb: float = 64,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "weight_update_group",
        init_timeout_s: float = 60.0,
        **kw,
    ):
        super().__init__(bucket_mb=bucket_mb, **kw)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: unknown backend {backend!r}; choose gloo or nccl")
        self.backend, self.master_address, self.master_port = backend, master_address, master_port
        self.group_name, self.init_timeout_s = group_name, init_timeout_s
        self.group = None

    def connect(self, engine_urls: list[str], admin_token: str | None) -> None:
        super().connect(engine_urls, admin_token)
        if not self.active:
            return
        port = self.master_port or free_port(self.master_address)
        world = len(self.urls) + 1
        joins = {
            u: self._lanes[u].submit(
                self.engines[u].init_weights_update_group,
                self.master_address,
                port,
                rank_offset=i + 1,
                world_size=world,
                group_name=self.group_name,
                backend=self.backend,
                timeout_s=self.init_timeout_s,
            )
            for i, u in enumerate(self.urls)
        }
        try:
            self.group = init_group(self.master_address, port, world, 0, self.backend, self.init_timeout_s)
        except Exception as e:
            problems = [str(f.exception()) for f in joins.values() if f.done() and f.exception()]
            raise WeightSyncError(
                f"broadcast: cannot form the group on {self.master_address}:{port}: {e}"
                + (f" ({'; '.join(problems)})" if problems else "")
            ) from None
        self._wait(joins)

    def close(self) -> None:
        if self.group is not None:
            for engine in self.engines.values():  # best effort: an engine that is gone has no group to drop
                try:
                    engine.destroy_weights_update_group(self.group_name)
                except EngineError:
                    pass
        self.group = None
        super().close()

    def _send(self, items: list[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        if self.group is None:
            raise WeightSyncError("broadcast: not connected")
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        groups = buckets(items, self.bucket_bytes)
        for k, group in enumerate(groups):
            last = k == len(groups) - 1
            futures = self._post_all(
                EngineControl.update_weights_from_distributed,
                last,
                names=[n for n, _ in group],
                dtypes=[dtype_name(t.dtype) for _, t in group],
                shapes=[list(t.shape) for _, t in group],
                group_name=self.group_name,
            )
            for _, t in group:
                broadcast(self.group, t.detach().to(device).contiguous(), 0)
            self._wait(futures)
            report.buckets += 1
            report.tensors += len(group)
            report.bytes += sum(nbytes(t) for _, t in group)
            if not report.ok:  # a member that failed will not join the next collective
                break
