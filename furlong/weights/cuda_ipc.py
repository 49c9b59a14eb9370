"""Same-node GPU sync through CUDA IPC handles: the engine maps the trainer's GPU buffer and copies device to device.

Why: with trainer and engine on the same GPU (or on GPUs of one node), going through
host memory (shm) costs two PCIe crossings per byte. CUDA IPC lets the engine open
the trainer's allocation directly — SGLang's `update_weights_from_tensor` does the same
with handles inside a pickle. Here nothing is pickled: `reduce_tensor`'s handle fields
travel as JSON (bytes in base64, the storage class from an allowlist), and the engine
rebuilds the buffer with `rebuild_cuda_tensor`, so a malformed request can at worst name
a wrong allocation (refused by the driver), never run code.

Per bucket the sender packs the tensors into one flat uint8 buffer on its GPU (offsets
aligned to 256 bytes), waits for its stream, and posts one handle plus the tensors'
specs (name, dtype, shape, offset, nbytes) to `/update_weights_from_tensor` in the `shm`
field (`tensors.shm_views` hands a handle with a `cuda_ipc` key to `views`). The buffer
is freed once every engine has answered, i.e. copied. Versions, all-or-nothing checks
and `weights.verify` are the base sender's, as for every transport.

UNTESTED ON A GPU: the packing, the spec checks and the refusals run on CPU in the test
suite (`pack`/`unpack` take any device); opening a handle needs two CUDA processes and
is covered by `tests/gpu/`, which has not run on a GPU in this repository yet.
SGLang engines: not supported (SGLang expects its pickled `serialized_named_tensors`).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from furlong.core.client import EngineControl
from furlong.weights.base import Sender, buckets, layout, nbytes
from furlong.weights.report import SyncReport
from furlong.weights.tensors import parse_dtype

KEY = "cuda_ipc"
ALIGN = 256  # CUDA allocations are 256-byte aligned; so is every tensor in a bucket
STORAGE_CLASSES = {"TypedStorage": "torch.storage.TypedStorage", "UntypedStorage": "torch.UntypedStorage"}
BYTES_FIELDS = ("handle", "ref_counter_handle")
INT_FIELDS = ("device", "tensor_offset", "size_bytes", "offset_bytes", "ref_counter_offset", "numel")


def pack(group: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """One flat uint8 buffer on `device` holding every tensor of `group`, and the specs that locate them."""
    specs, offset = layout(group, ALIGN)
    flat = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)
    for spec, (_, t) in zip(specs, group):
        if spec["nbytes"]:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[spec["offset"] : spec["offset"] + spec["nbytes"]].copy_(src, non_blocking=True)
    return flat, specs


def unpack(flat: torch.Tensor, specs: Any) -> dict[str, torch.Tensor]:
    """Views of `flat` for each spec, every spec checked first (ValueError naming the tensor)."""
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise ValueError("tensors: must be a list of {name, dtype, shape, offset, nbytes} objects")
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        name = spec.get("name")
        if not isinstance(name, str) or name in out:
            raise ValueError(f"tensors: a missing or repeated name {name!r}")
        dt = parse_dtype(spec.get("dtype"), f"tensors[{name}].dtype")
        try:
            shape = [int(s) for s in spec.get("shape", [])]
            off, n = int(spec["offset"]), int(spec["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensors[{name}]: shape, offset and nbytes must be integers") from None
        size = torch.empty((), dtype=dt).element_size()
        if any(s < 0 for s in shape) or n != torch.Size(shape).numel() * size or off < 0 or off + n > flat.numel():
            raise ValueError(f"tensors[{name}]: offset/nbytes do not fit shape {shape} and the buffer")
        if off % size:
            raise ValueError(f"tensors[{name}]: offset {off} is not aligned to its {size}-byte elements")
        out[name] = flat[off : off + n].view(dt).reshape(shape) if n else torch.empty(shape, dtype=dt)
    return out


def describe(flat: torch.Tensor) -> dict[str, Any]:
    """The JSON form of `flat`'s CUDA IPC handle (what `reduce_tensor` would pickle)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(flat)
    (_, _, _, tensor_offset, storage_cls, _, device, handle, size_bytes, offset_bytes, _, ref, ref_off, event, sync) = (
        args
    )
    return {
        "device": int(device),
        "tensor_offset": int(tensor_offset),
        "storage": storage_cls.__name__,
        "handle": base64.b64encode(handle).decode(),
        "size_bytes": int(size_bytes),
        "offset_bytes": int(offset_bytes),
        "ref_counter_handle": base64.b64encode(ref).decode(),
        "ref_counter_offset": int(ref_off),
        "event_handle": base64.b64encode(event).decode() if event else None,
        "event_sync_required": bool(sync),
        "numel": flat.numel(),
    }


def parse_handle(h: Any) -> dict[str, Any]:
    """The handle's fields, type-checked, bytes decoded, storage class looked up (ValueError naming the field)."""
    if not isinstance(h, dict):
        raise ValueError(f"{KEY}: must be an object")
    out: dict[str, Any] = {}
    for f in INT_FIELDS:
        if not isinstance(h.get(f), int) or isinstance(h.get(f), bool) or h[f] < 0:
            raise ValueError(f"{KEY}.{f}: must be a non-negative integer")
        out[f] = h[f]
    for f in BYTES_FIELDS + ("event_handle",):
        v = h.get(f)
        if v is None and f == "event_handle":
            out[f] = None
            continue
        try:
            out[f] = base64.b64decode(v, validate=True)
        except (TypeError, ValueError):
            raise ValueError(f"{KEY}.{f}: must be base64") from None
    if h.get("storage") not in STORAGE_CLASSES:
        raise ValueError(f"{KEY}.storage: {h.get('storage')!r} is not one of {sorted(STORAGE_CLASSES)}")
    out["storage"] = h["storage"]
    out["event_sync_required"] = bool(h.get("event_sync_required"))
    return out


def open_handle(h: dict[str, Any]) -> torch.Tensor:
    """The sender's flat buffer, mapped into this process (needs CUDA on the same node)."""
    f = parse_handle(h)
    if not torch.cuda.is_available():
        raise ValueError(f"{KEY}: this engine sees no CUDA device; use weights.transport=shm or broadcast")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    storage_cls = torch.storage.TypedStorage if f["storage"] == "TypedStorage" else torch.UntypedStorage
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([f["numel"]]),
        (1,),
        f["tensor_offset"],
        storage_cls,
        torch.uint8,
        f["device"],
        f["handle"],
        f["size_bytes"],
        f["offset_bytes"],
        False,
        f["ref_counter_handle"],
        f["ref_counter_offset"],
        f["event_handle"],
        f["event_sync_required"],
    )


@contextmanager
def views(handle: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
    """Tensors viewing the sender's GPU bucket, valid inside the block (the engine copies out of them)."""
    flat = open_handle(handle.get(KEY))
    try:
        yield unpack(flat, handle.get("tensors"))
    finally:
        torch.cuda.current_stream(flat.device).synchronize()  # the copies out are done before the sender frees it
        del flat


class CudaIpcSender(Sender):
    transport = KEY

    def __init__(self, bucket_mb: float = 512, **kw):
        super().__init__(bucket_mb=bucket_mb, **kw)
        if not torch.cuda.is_available():
            raise ValueError("weights.transport=cuda_ipc needs CUDA on the trainer; use shm (same host) on CPU")
        if self.engine_api == "sglang":
            raise ValueError("weights.transport=cuda_ipc: SGLang engines take pickled tensors; use broadcast")

    def _send(self, items: list[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        groups = buckets(items, self.bucket_bytes)
        for k, group in enumerate(groups):
            flat, specs = pack(group, device)
            torch.cuda.current_stream(device).synchronize()  # the engine reads the buffer from another process
            handle = {KEY: describe(flat), "tensors": specs}
            self._wait(self._post_all(EngineControl.update_weights_from_tensor, k == len(groups) - 1, shm=handle))
            del flat
            report.buckets += 1
            report.tensors += len(group)
            report.bytes += sum(nbytes(t) for _, t in group)
            if not report.ok:
                break
