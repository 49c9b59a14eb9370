"""`make_sender(transport)`: the one place that knows every transport by its `weights.transport` name.

Why apart from `base`: the transports import the base class, and this module imports
every transport; kept in one file they would import each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from furlong.weights.base import Sender, WeightSender
from furlong.weights.broadcast import BroadcastSender
from furlong.weights.cuda_ipc import CudaIpcSender
from furlong.weights.disk import DiskSender
from furlong.weights.p2p import P2PSender
from furlong.weights.shm import DeltaSender, ShmSender

SENDERS: dict[str, type[Sender]] = {
    "shm": ShmSender,
    "broadcast": BroadcastSender,
    "p2p": P2PSender,
    "disk": DiskSender,
    "delta": DeltaSender,
    "cuda_ipc": CudaIpcSender,
}
TRANSPORTS = tuple(SENDERS)


def make_sender(transport: str, *, run_dir: str | Path | None = None, **opts: Any) -> WeightSender:
    """The sender for `weights.transport`; `opts` are the transport's keyword options.

    Common to all: bucket_mb, timeout_s, check_schema, verify, rank, world_size.
    `run_dir` gives disk its default directory, `<run_dir>/weights`.
    """
    cls = SENDERS.get(transport)
    if cls is None:
        raise ValueError(f"weights.transport: unknown transport {transport!r}; choose one of {list(TRANSPORTS)}")
    if transport == "disk" and run_dir is not None:
        opts.setdefault("directory", Path(run_dir) / "weights")
    try:
        return cls(**opts)
    except TypeError as e:
        raise ValueError(f"weights.transport={transport}: {e}") from None
