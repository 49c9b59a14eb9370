"""What a weight sync returns (`SyncReport`, one `EngineResult` per engine) or raises (`WeightSyncError`).

Why a module of its own: the schema check and the checksum verify raise the same
error the senders do, and the senders use both; with the error here, below all of
them, every sender module imports downward only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class WeightSyncError(RuntimeError):
    """A sync that did not fully land; `report` says what each engine did (None before any send)."""

    def __init__(self, message: str, report: SyncReport | None = None):
        super().__init__(message)
        self.report = report


@dataclass
class EngineResult:
    url: str
    ok: bool = True
    weight_version: int | None = None  # what the engine reported after its last applied request
    requests: int = 0
    error: str | None = None


@dataclass
class SyncReport:
    transport: str
    version: int
    bytes: int = 0  # payload bytes of one copy of the sent tensors (not multiplied by engines)
    seconds: float = 0.0
    buckets: int = 0
    tensors: int = 0
    unchanged: int = 0  # delta: tensors not sent because their checksum did not change
    zero_copy_bytes: int = 0  # shm/delta: bytes the engines read in place from the trainer's resident parameters
    verified: bool = False  # weights.verify: engine checksums matched the pushed tensors
    engines: dict[str, EngineResult] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.engines.values())

    def summary(self) -> str:
        bad = [f"{u}: {e.error}" for u, e in self.engines.items() if not e.ok]
        head = (
            f"{self.transport} v{self.version}: {self.tensors} tensors, {self.bytes / 1e6:.1f} MB in "
            f"{self.buckets} buckets, {self.seconds:.3f} s ({self.gbps:.2f} GB/s) to {len(self.engines)} engines"
        )
        return head + (f"; FAILED {'; '.join(bad)}" if bad else "")
