"""Named tensors in a POSIX shared-memory segment, described by a JSON-able handle.

Why shared memory: a trainer and an engine on one node exchange hundreds of MB
per sync; a shared segment costs one memcpy on each side and nothing on the
wire — only the small handle travels over HTTP. The handle lists, for every
tensor, its name, dtype, shape and byte offset, plus an optional CRC32 per
tensor so a torn or stale segment is caught before it becomes model weights.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

_ALIGN = 64
_created: set[str] = set()  # segments this process created: its resource tracker must keep them registered


def create_segment(size: int) -> shared_memory.SharedMemory:
    """A new segment of `size` bytes (at least 1) that this process owns and unlinks."""
    seg = shared_memory.SharedMemory(create=True, size=max(size, 1))
    _created.add(seg._name)  # type: ignore[attr-defined]
    return seg


def unlink_segment(seg: shared_memory.SharedMemory, close: bool = True) -> None:
    """Unlink a segment this process created (closing its mapping unless views of it live on)."""
    _created.discard(seg._name)  # type: ignore[attr-defined]
    if close:
        seg.close()
    seg.unlink()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, field: str = "dtype") -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{field}: unknown dtype {name!r}")
    return dt


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())


def copy_into(buf: memoryview, offset: int, t: torch.Tensor) -> None:
    """Copy `t`'s bytes into `buf` at `offset` with torch's copy, not a memoryview slice assignment.

    Why: a slice assignment is one single-threaded memcpy that holds the GIL for the whole tensor
    (hundreds of MB per bucket), so the sender's posting thread and the HTTP client stall behind it;
    torch's copy releases the GIL and splits large tensors over the intra-op threads."""
    n = t.numel() * t.element_size()
    if n == 0:
        return
    src = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    dst = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset)
    dst.copy_(src)
    del dst  # no view may outlive the call: the segment's owner closes it later


def checksum(t: torch.Tensor) -> int:
    """CRC32 of a tensor's raw bytes (what both sides compute to check a transfer)."""
    return zlib.crc32(tensor_bytes(t))


def write_shm(
    named: dict[str, torch.Tensor], *, with_checksum: bool = True
) -> tuple[shared_memory.SharedMemory, dict[str, Any]]:
    """Copy tensors into a new segment; the caller owns it (close + unlink when the receiver is done)."""
    specs, offset = [], 0
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        specs.append(
            {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": nbytes}
        )
        offset += -(-nbytes // _ALIGN) * _ALIGN
    shm = create_segment(offset)
    for spec, t in zip(specs, named.values()):
        copy_into(shm.buf, spec["offset"], t)
        if with_checksum:
            spec["crc32"] = zlib.crc32(shm.buf[spec["offset"] : spec["offset"] + spec["nbytes"]])
    return shm, {"shm_name": shm.name, "tensors": specs}


@contextmanager
def shm_views(handle: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
    """Tensors that *view* the segment named in `handle`, valid inside the `with` block.

    Why views: copying out of the segment and then into the parameters is two
    copies into fresh memory; a view lets the engine copy once, straight from
    shared memory into its parameters. Every spec is checked first (name,
    dtype, bounds, CRC32 over the mapped bytes when the handle carries one),
    raising ValueError naming the tensor, so nothing is yielded from a torn or
    malformed handle. Do not keep a view past the block: the sender rewrites
    the segment for its next bucket.

    Mappings are kept open across calls (an LRU of `MAPPINGS`) because the
    sender reuses its segments from sync to sync (`weights.shm`): a fresh
    mapping pays a page fault per 4 KiB page on every sync, a kept one pays
    it once (a kept mapping read ~1.7x faster here). A cached mapping is reused only if the name
    still refers to the same segment (same inode), so an unlinked-and-recreated
    name is reopened, and mappings of unlinked segments are dropped.
    """
    if not isinstance(handle, dict):
        raise ValueError("shm: must be an object with shm_name and tensors")
    if "cuda_ipc" in handle:  # a GPU bucket (weights.transport=cuda_ipc): the same views, of the sender's GPU memory
        from furlong.weights.cuda_ipc import views

        with views(handle) as out:
            yield out
        return
    name = handle.get("shm_name")
    if not isinstance(name, str) or not name:
        raise ValueError("shm_name: required string")
    specs = handle.get("tensors")
    if specs is None:
        specs = []
    if not isinstance(specs, list) or not all(isinstance(x, dict) for x in specs):
        raise ValueError("shm.tensors: must be a list of {name, dtype, shape, offset, nbytes} objects")
    seg = _open(name)
    try:
        out: dict[str, torch.Tensor] = {}
        for spec in specs:
            tname = spec.get("name")
            if not isinstance(tname, str):
                raise ValueError(f"shm.tensors: every tensor needs a string name, got {tname!r}")
            if tname in out:
                raise ValueError(f"tensors[{tname}]: given twice")
            out[tname] = _view(seg, spec, tname)
        yield out
    finally:
        _release(seg)


def _view(seg: shared_memory.SharedMemory, spec: dict[str, Any], tname: str) -> torch.Tensor:
    dt = parse_dtype(spec.get("dtype"), f"tensors[{tname}].dtype")
    try:
        shape = [int(s) for s in spec.get("shape", [])]
        off, nbytes = int(spec.get("offset", -1)), int(spec.get("nbytes", -1))
    except (TypeError, ValueError):
        raise ValueError(f"tensors[{tname}]: shape, offset and nbytes must be integers") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"tensors[{tname}]: negative dimension in shape {shape}")
    size = torch.empty((), dtype=dt).element_size()
    if nbytes != torch.Size(shape).numel() * size or off < 0 or off + nbytes > seg.size:
        raise ValueError(f"tensors[{tname}]: offset/nbytes do not fit shape {shape} and the segment")
    if off % size:
        raise ValueError(f"tensors[{tname}]: offset {off} is not aligned to its {size}-byte elements")
    if "crc32" in spec and zlib.crc32(seg.buf[off : off + nbytes]) != spec["crc32"]:
        raise ValueError(f"tensors[{tname}]: checksum mismatch")
    if nbytes == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes, offset=off).view(dt).reshape(shape)


MAPPINGS = 4  # the sender keeps two segments in flight; a little slack for several senders
_lock = threading.Lock()
# name -> (segment, inode, users)
_mapped: OrderedDict[str, tuple[shared_memory.SharedMemory, int | None, int]] = OrderedDict()


def _inode(name: str) -> int | None:
    """Inode of the named segment (Linux exposes them under /dev/shm); None where unknown."""
    try:
        return os.stat(os.path.join("/dev/shm", name.lstrip("/"))).st_ino
    except OSError:
        return None


def _open(name: str) -> shared_memory.SharedMemory:
    with _lock:
        ino = _inode(name)
        for other, (_seg, seg_ino, users) in list(_mapped.items()):  # drop mappings of unlinked or replaced segments
            if users == 0 and (seg_ino is None or _inode(other) != seg_ino):
                _close(_mapped.pop(other)[0])
        hit = _mapped.get(name)
        if hit is not None and ino is not None and hit[1] == ino:
            _mapped[name] = (hit[0], ino, hit[2] + 1)
            _mapped.move_to_end(name)
            return hit[0]
        try:
            seg = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            raise ValueError(f"shm_name: no shared-memory segment {name!r}") from None
        if seg._name not in _created:  # type: ignore[attr-defined]
            # The sender owns the segment; stop this process's tracker from unlinking it at exit (a segment
            # this process created stays registered: its unlink unregisters it, once).
            resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
        if hit is None:
            _mapped[name] = (seg, ino, 1)
        while len(_mapped) > MAPPINGS:
            idle = next((k for k, v in _mapped.items() if v[2] == 0), None)
            if idle is None:
                break
            _close(_mapped.pop(idle)[0])
        return seg


def _release(seg: shared_memory.SharedMemory) -> None:
    with _lock:
        for name, (s, ino, users) in _mapped.items():
            if s is seg:
                _mapped[name] = (s, ino, users - 1)
                return
    _close(seg)  # not cached (an older mapping of a name that was replaced while in use)


def _close(seg: shared_memory.SharedMemory) -> None:
    try:
        seg.close()
    except BufferError:  # a view outlived its block: the mapping goes when the last view does
        pass
