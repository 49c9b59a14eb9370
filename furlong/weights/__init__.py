"""Weight transport pieces shared by the trainer (send side) and the engine (receive side).

- `tensors`, `dist`   the wire formats both sides speak (shared-memory layout, CRC32, the broadcast group)
- `report`            what a sync returns or raises (SyncReport, WeightSyncError)
- `schema`, `checksums`  the check before a sync and the verify after it
- `base`              the Sender base class and its bucketing
- `shm`, `disk`, `broadcast`, `p2p`  the transports (delta is in `shm`)
- `factory`           make_sender(transport): the only module that imports every transport

`make_sender` and `verify` are loaded on first use, so the engine, which only
imports `tensors` and `dist` from here, does not pay for the sender's imports.
"""

from typing import Any

__all__ = ["make_sender", "verify", "WeightSyncError", "SyncReport"]


def __getattr__(name: str) -> Any:
    if name == "make_sender":
        from furlong.weights.factory import make_sender

        return make_sender
    if name in ("WeightSyncError", "SyncReport"):
        from furlong.weights import report

        return getattr(report, name)
    if name == "verify":
        from furlong.weights.checksums import verify

        return verify
    raise AttributeError(f"module 'furlong.weights' has no attribute {name!r}")
