"""Same-node sync through POSIX shared memory, and its checksummed delta variant.

shm: each bucket is copied once into a segment; only its JSON handle (the
`tensors.write_shm` format) travels to the engines (`/update_weights_from_tensor`),
which copy the tensors out. Two buckets are in flight at a time: while the
engines load bucket k the sender fills bucket k+1, so sender and engine copies
overlap. A segment is free again once every engine has answered for it.

Why segments are reused (`reuse_segments=True`, the default): a fresh segment
costs a page fault per 4 KiB page on first touch, which here makes writing it
~10x slower than memcpy (benchmarks/weight_sync.py measures both). The sender
therefore keeps its (at most two) bucket-sized segments across syncs and
unlinks them in `close()` — or, with `reuse_segments=False`, right after the
engines acknowledge. The segments are registered with Python's resource
tracker, so a crashed trainer does not leak them.

Zero copy (`resident`, a `weights.resident.ResidentWeights` the trainer process sets once): tensors
that already lie in the trainer's resident parameter segment are not copied at all; one handle names
that segment and the tensors' offsets in it (one request, whatever `bucket_mb`), and the engines read the
parameters in place. The rest (computed tensors, buffers) goes through bucket segments as above.

delta: the same path, but only tensors whose CRC32 changed since the last
successful sync are sent, each with its CRC32 in the handle, which the engine
verifies before applying (`read_shm`). The baseline is what the connected
engines hold: `connect` seeds it from every engine's `/get_weights_checksum`
(a tensor counts as known only where all engines agree), so a replaced engine
that loaded an older checkpoint gets exactly what it lacks; afterwards it is
what this sender last pushed. A CRC32 collision would hide a change (odds
2^-32 per changed tensor); `weights.verify` catches drift.
"""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Any

import torch

from furlong.core.client import EngineControl
from furlong.weights.base import Sender, buckets, layout, nbytes
from furlong.weights.checksums import VerifyUnsupported, engine_checksums
from furlong.weights.report import SyncReport
from furlong.weights.resident import ResidentWeights
from furlong.weights.tensors import checksum, copy_into, create_segment, dtype_name, unlink_segment

IN_FLIGHT = 2
ALIGN = 64  # tensor offsets, as in tensors.write_shm


def write_segment(
    group: list[tuple[str, torch.Tensor]],
    free: list[shared_memory.SharedMemory],
    crcs: dict[str, int] | None,
    min_size: int = 1,
) -> tuple[shared_memory.SharedMemory, dict[str, Any]]:
    """Lay `group` out in a free segment big enough, else a new one of at least `min_size` bytes.

    New segments are sized to a whole bucket (pages are only allocated when
    touched), so any free segment fits any later bucket. With `crcs` (name →
    CRC32 of the tensor's bytes) every spec carries its checksum for the engine to verify.
    """
    specs, offset = layout(group, ALIGN)
    seg = next((s for s in free if s.size >= offset), None)
    if seg is not None:
        free.remove(seg)
    else:
        if free:  # too small for this (oversized) bucket: make room rather than grow the pool
            unlink(free.pop(0))
        seg = create_segment(max(offset, min_size))
    for spec, (name, t) in zip(specs, group):
        copy_into(seg.buf, spec["offset"], t)
        if crcs is not None:
            spec["crc32"] = crcs[name]
    return seg, {"shm_name": seg.name, "tensors": specs}


unlink = unlink_segment


class ShmSender(Sender):
    transport = "shm"

    def __init__(self, bucket_mb: float = 64, checksum: bool = False, reuse_segments: bool = True, **kw):
        super().__init__(bucket_mb=bucket_mb, **kw)
        self.with_checksum = checksum
        self.reuse_segments = reuse_segments
        self._free: list[shared_memory.SharedMemory] = []
        self.resident: ResidentWeights | None = None  # the trainer's parameter segment, owned by the trainer

    def close(self) -> None:
        super().close()
        while self._free:
            unlink(self._free.pop())

    def _send(self, items: list[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        """Resident tensors go in one request, however many bytes: a bucket bounds the segment the sender
        fills and pipelines that filling with the engine's apply, and resident tensors need neither. Each
        request costs a round trip (~2-3 ms here), and an engine's lane sends the next only once the last
        was answered, so 64 MB buckets added ~17 ms to a 416 MB sync (5.3 vs 6.4 GB/s, 100M qwen3)."""
        here = self.resident.locate if self.resident is not None else lambda t: None
        held = [(n, t) for n, t in items if here(t) is not None]  # read in place: no bucket, no copy
        rest = [(n, t) for n, t in items if here(t) is None]
        self._send_groups(([held] if held else []) + buckets(rest, self.bucket_bytes), report, stamp_last=True)

    def _resident_handle(self, group: list[tuple[str, torch.Tensor]], crcs: dict[str, int] | None) -> dict | None:
        """The handle of a group whose every tensor lies in the resident segment (None otherwise)."""
        if self.resident is None:
            return None
        specs = []
        for name, t in group:
            offset = self.resident.locate(t)
            if offset is None:
                return None
            spec = {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset}
            specs.append(spec | {"nbytes": nbytes(t)} | ({"crc32": crcs[name]} if crcs is not None else {}))
        return {"shm_name": self.resident.name, "tensors": specs}

    def _send_groups(self, groups: list[list[tuple[str, torch.Tensor]]], report: SyncReport, stamp_last: bool) -> None:
        """Post each group as one segment; the last one carries the new version if `stamp_last`."""
        inflight: list = []
        try:
            for k, group in enumerate(groups):
                if not any(e.ok for e in report.engines.values()):
                    break
                crcs = self._crcs(group) if self.with_checksum else None
                seg, handle = None, self._resident_handle(group, crcs)
                if handle is None:
                    seg, handle = write_segment(group, self._free, crcs, self.bucket_bytes)
                else:
                    report.zero_copy_bytes += sum(nbytes(t) for _, t in group)
                last = stamp_last and k == len(groups) - 1
                futures = self._post_all(EngineControl.update_weights_from_tensor, last, shm=handle)
                inflight.append((seg, futures))
                report.buckets += 1
                report.tensors += len(group)
                report.bytes += sum(nbytes(t) for _, t in group)
                while len(inflight) >= IN_FLIGHT:
                    self._release(*inflight.pop(0))
        finally:
            while inflight:
                self._release(*inflight.pop(0))

    def _crcs(self, group: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
        return {n: checksum(t) for n, t in group}

    def _release(self, seg: shared_memory.SharedMemory | None, futures) -> None:
        """Wait until every engine answered for this segment, then keep it for the next bucket (or free it);
        `seg` None: a bucket of the resident segment, which is the trainer's to keep."""
        try:
            self._wait(futures)
        finally:
            if seg is not None and self.reuse_segments and len(self._free) < IN_FLIGHT:
                self._free.append(seg)
            elif seg is not None:
                unlink(seg)


class DeltaSender(ShmSender):
    transport = "delta"

    def __init__(self, bucket_mb: float = 64, **kw):
        super().__init__(bucket_mb=bucket_mb, checksum=True, **kw)
        self.baseline: dict[str, tuple[int, tuple[int, ...], str]] = {}
        self._sums: dict[str, tuple[int, tuple[int, ...], str]] = {}

    def _crcs(self, group: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
        return {n: self._sums[n][0] for n, _ in group}  # computed once, for the change test

    def connect(self, engine_urls: list[str], admin_token: str | None) -> None:
        super().connect(engine_urls, admin_token)
        self.baseline = {}
        if not self.active:
            return
        try:
            per_engine = [engine_checksums(e)["tensors"] for e in self.engines.values()]
        except VerifyUnsupported:
            return  # no engine checksums: the first push is full
        first, *others = per_engine
        for name, spec in first.items():
            key = (spec["crc32"], tuple(spec["shape"]), spec["dtype"])
            if all(o.get(name) == spec for o in others):
                self.baseline[name] = key

    def _send(self, items: list[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        sums = {n: (checksum(t), tuple(t.shape), dtype_name(t.dtype)) for n, t in items}
        self._sums = sums
        changed = [(n, t) for n, t in items if self.baseline.get(n) != sums[n]]
        if not changed:  # nothing new, but the version must still be stamped once: resend the smallest
            changed = [min(items, key=lambda p: nbytes(p[1]))]
        report.unchanged = len(items) - len(changed)
        self.baseline, old = {}, self.baseline  # until it lands, some engine may hold a mix: trust nothing
        super()._send(changed, report)
        if report.ok:
            self.baseline = {**old, **{n: sums[n] for n, _ in changed}}
