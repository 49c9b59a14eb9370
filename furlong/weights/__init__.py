"""Weight transport pieces shared by the trainer (send side) and the engine (receive side).

`make_sender` and `verify` are loaded on first use, so the engine, which only
imports `tensors` and `dist` from here, does not pay for the sender's imports.
"""

from typing import Any

__all__ = ["make_sender", "verify", "WeightSyncError", "SyncReport"]


def __getattr__(name: str) -> Any:
    if name in ("make_sender", "WeightSyncError", "SyncReport"):
        from furlong.weights import sync

        return getattr(sync, name)
    if name == "verify":
        from furlong.weights.checksums import verify

        return verify
    raise AttributeError(f"module 'furlong.weights' has no attribute {name!r}")
