"""Same-node sync through POSIX shared memory, and its checksummed delta variant.

shm: each bucket is copied once into a fresh segment (`tensors.write_shm`);
only its JSON handle travels to the engines (`/update_weights_from_tensor`),
which copy the tensors out. The segment is unlinked as soon as every engine
has answered for it. Two buckets are in flight at a time: while the engines
load bucket k the sender fills bucket k+1, so sender and engine copies overlap.

delta: the same path, but only tensors whose CRC32 changed since the last
successful sync are sent, each with its CRC32 in the handle, which the engine
verifies before applying (`read_shm`). The baseline is what this sender last
pushed to the *connected* engines: `connect` (e.g. after an engine was
replaced) resets it, so the next push is full. A CRC32 collision would hide a
change (odds 2^-32 per changed tensor); `weights.verify` catches drift.
"""

from __future__ import annotations

import torch

from furlong.weights.sync import Sender, SyncReport, buckets, nbytes
from furlong.weights.tensors import checksum, write_shm

IN_FLIGHT = 2


class ShmSender(Sender):
    transport = "shm"

    def __init__(self, bucket_mb: float = 64, checksum: bool = False, **kw):
        super().__init__(bucket_mb=bucket_mb, **kw)
        self.with_checksum = checksum

    def _send(self, items: list[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        self._send_groups(buckets(items, self.bucket_bytes), report, stamp_last=True)

    def _send_groups(self, groups: list[list[tuple[str, torch.Tensor]]], report: SyncReport, stamp_last: bool) -> None:
        """Post each group as one segment; the last one carries the new version if `stamp_last`."""
        inflight: list = []
        try:
            for k, group in enumerate(groups):
                if not any(e.ok for e in report.engines.values()):
                    break
                seg, handle = write_shm(dict(group), with_checksum=self.with_checksum)
                last = stamp_last and k == len(groups) - 1
                futures = self._post_all("/update_weights_from_tensor",
                                         lambda u: {"shm": handle, "weight_version": self._body_version(u, last)})
                inflight.append((seg, futures))
                report.buckets += 1
                report.tensors += len(group)
                report.bytes += sum(nbytes(t) for _, t in group)
                while len(inflight) >= IN_FLIGHT:
                    release(*inflight.pop(0))
        finally:
            while inflight:
                release(*inflight.pop(0))


def release(seg, futures) -> None:
    """Wait until every engine answered for this segment, then free it."""
    try:
        Sender._wait(futures)
    finally:
        seg.close()
        seg.unlink()


class DeltaSender(ShmSender):
    transport = "delta"

    def __init__(self, bucket_mb: float = 64, **kw):
        super().__init__(bucket_mb=bucket_mb, checksum=True, **kw)
        self.baseline: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}

    def connect(self, engine_urls: list[str], admin_token: str | None) -> None:
        super().connect(engine_urls, admin_token)
        self.baseline = {}

    def _send(self, items: list[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        sums = {n: (checksum(t), tuple(t.shape), t.dtype) for n, t in items}
        changed = [(n, t) for n, t in items if self.baseline.get(n) != sums[n]]
        if not changed:  # nothing new, but the version must still be stamped once: resend the smallest
            changed = [min(items, key=lambda p: nbytes(p[1]))]
        report.unchanged = len(items) - len(changed)
        self.baseline, old = {}, self.baseline  # until it lands, some engine may hold a mix: trust nothing
        super()._send(changed, report)
        if report.ok:
            self.baseline = {**old, **{n: sums[n] for n, _ in changed}}
