"""`weights.verify=true`: after a sync, compare every engine's weights with the trainer's by CRC32.

Engine side (the contract this module speaks, served by the built-in engine's
`furlong/engine/server.py`; SGLang has no equivalent):

    POST /get_weights_checksum
    body      {"names": ["model.norm.weight", ...]}   # optional; omitted or null = every tensor
    200       {"weight_version": 3,
               "tensors": {"model.norm.weight": {"dtype": "float32", "shape": [64], "crc32": 123}, ...}}
    400       an unknown name, named: "names: no such parameter 'x'"

`crc32` is `furlong.weights.tensors.checksum` of the engine's tensor as it is
stored (its own dtype), computed on the scheduler thread between two forwards
so it sees one consistent version. The trainer side casts its tensor to the
engine's dtype before hashing, so a bf16 engine fed fp32 weights still matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from furlong.core.api import WEIGHT_CHECKSUMS as ENDPOINT
from furlong.core.client import EngineControl, EngineError
from furlong.weights.report import WeightSyncError
from furlong.weights.tensors import checksum, parse_dtype


class VerifyUnsupported(WeightSyncError):
    """The engine has no checksum endpoint."""


@dataclass
class VerifyReport:
    weight_versions: dict[str, int] = field(default_factory=dict)
    mismatches: dict[str, list[str]] = field(default_factory=dict)  # engine url -> tensor names that differ
    checked: int = 0

    @property
    def ok(self) -> bool:
        return not any(self.mismatches.values())


def engine_checksums(engine: EngineControl, names: list[str] | None = None) -> dict:
    """The engine's checksum reply (module docstring); `VerifyUnsupported` if it has no such endpoint."""
    try:
        return engine.weights_checksum(names)
    except EngineError as e:
        if e.status in (404, 405):
            raise VerifyUnsupported(
                f"{engine.url}: the engine has no POST {ENDPOINT} (needed by weights.verify=true)"
            ) from None
        raise WeightSyncError(str(e)) from None


def verify(
    engine_urls: list[str],
    admin_token: str | None,
    expected: Mapping[str, int] | Iterable[tuple[str, torch.Tensor]],
    *,
    raise_on_mismatch: bool = True,
    timeout_s: float = 600.0,
) -> VerifyReport:
    """Compare every engine with `expected`; raise `WeightSyncError` naming the first differing tensors.

    `expected` is either name → CRC32 (computed where the tensors live, e.g. in
    a trainer actor; then the engine must hold the same dtype) or (name,
    tensor) pairs, which are cast to each engine's dtype before hashing.
    """
    engines = [EngineControl(url, admin_token=admin_token, timeout_s=timeout_s) for url in engine_urls]
    try:
        return compare(engines, expected, raise_on_mismatch=raise_on_mismatch)
    finally:
        for engine in engines:
            engine.close()


def compare(
    engines: list[EngineControl],
    expected: Mapping[str, int] | Iterable[tuple[str, torch.Tensor]],
    *,
    raise_on_mismatch: bool = True,
) -> VerifyReport:
    """`verify` over clients already open (a sender's own, one per engine)."""
    items = expected.items() if isinstance(expected, Mapping) else expected
    ours = dict(items)
    report = VerifyReport(checked=len(ours))
    for engine in engines:
        got = engine_checksums(engine)  # all: a name the engine lacks is a mismatch, not an error
        report.weight_versions[engine.url] = got.get("weight_version")
        theirs = got.get("tensors", {})
        report.mismatches[engine.url] = [name for name, want in ours.items() if not matches(want, theirs.get(name))]
    if raise_on_mismatch and not report.ok:
        worst = {u: names[:5] for u, names in report.mismatches.items() if names}
        raise WeightSyncError(f"weights.verify: engine weights differ from the trainer's: {worst}")
    return report


def matches(want: int | torch.Tensor, spec: dict | None) -> bool:
    if spec is None:
        return False
    if isinstance(want, torch.Tensor):
        if list(spec["shape"]) != list(want.shape):
            return False
        want = checksum(want.detach().cpu().to(parse_dtype(spec["dtype"])))
    return int(want) == spec["crc32"]
