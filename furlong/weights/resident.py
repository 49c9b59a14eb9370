"""Zero-copy sending for `shm` and `delta`: the trainer's parameters live in one shared-memory segment.

Why: a sync over shared memory made three full passes over the weights — the sender copied
each bucket into a segment, the engine copied it into its parameters, then re-packed the
touched matrices for oneDNN. With the parameters themselves resident in a segment the
engines map (`ResidentWeights.adopt`, once per trainer process), a bucket's handle points
straight at them: the sender copies nothing, and the engine's write out of the segment,
straight into its packed weights (`engine/packed.py`), is the only pass over the weights.

Why it is safe: the engines read while the trainer waits inside `Sender.push`, which
returns only after every engine acknowledged every bucket, so no optimiser step writes a
tensor an engine is reading. The fused AdamW step updates the parameters in place, so they
stay in the segment; anything that replaces a parameter's storage (a checkpoint loaded
into new tensors) merely makes that tensor travel through a bucket segment again
(`locate` returns None), as does every tensor that is computed for the sync rather than
held (LoRA merges, QAT's fake-quantised weights, FSDP2's gathered full tensors).

Where: one trainer rank on CPU, and only where `/dev/shm` has room for the whole model
plus a margin — a tmpfs that runs out does not fail the allocation but faults the writer
with SIGBUS later, so a short one is refused up front (`adopt` returns None, logged) and
the sender copies as before. The segment is unlinked when the trainer closes it; views in
this process and mappings in the engines stay valid until they are dropped.
"""

from __future__ import annotations

import logging
import os
from multiprocessing import shared_memory

import torch
from torch import nn

from furlong.weights.tensors import create_segment, unlink_segment

log = logging.getLogger("furlong.weights")
ALIGN = 64  # offsets, as in tensors.write_shm
SHM_DIR = "/dev/shm"
MARGIN = 2  # room wanted in /dev/shm: the model this many times (bucket segments and other users too)


def _room(nbytes: int) -> bool:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= MARGIN * nbytes


class ResidentWeights:
    """A module's parameters moved into one segment; `locate` finds a tensor's bytes in it."""

    def __init__(self, seg: shared_memory.SharedMemory) -> None:
        self.seg = seg
        self.name = seg.name
        self.base = torch.frombuffer(seg.buf, dtype=torch.uint8).data_ptr()
        self.size = seg.size

    @classmethod
    def adopt(cls, module: nn.Module) -> ResidentWeights | None:
        """Move every (CPU, contiguous) parameter of `module` into a new segment, values kept; None where
        the parameters are not all on the CPU or `/dev/shm` lacks the room."""
        params = list(module.parameters())  # tied weights are one Parameter: moved once
        if not params or any(p.device.type != "cpu" or not p.is_contiguous() for p in params):
            return None
        sizes = [-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in params]
        total = sum(sizes)
        if not _room(total):
            log.warning("weights: /dev/shm has less than %d MB free; the sender copies each bucket", total >> 19)
            return None
        seg = create_segment(total)
        offset = 0
        with torch.no_grad():
            for p, size in zip(params, sizes):
                n = p.numel() * p.element_size()
                view = torch.frombuffer(seg.buf, dtype=torch.uint8, count=n, offset=offset) if n else None
                new = torch.empty(0, dtype=p.dtype) if view is None else view.view(p.dtype)
                new = new.reshape(p.shape)
                new.copy_(p.data)
                p.data = new
                offset += size
        return cls(seg)

    def locate(self, t: torch.Tensor) -> int | None:
        """Byte offset of `t`'s data in the segment, or None when it is not (wholly, contiguously) there."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
        start = t.data_ptr() - self.base
        if start < 0 or start + t.numel() * t.element_size() > self.size or start % t.element_size():
            return None
        return start

    def close(self) -> None:
        """Unlink the name (no new mapping can open it); the memory lives on while any view or mapping does."""
        try:
            unlink_segment(self.seg, close=False)
        except FileNotFoundError:
            pass
