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

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import httpx
import torch

from furlong.weights.sync import WeightSyncError, error_text
from furlong.weights.tensors import checksum, parse_dtype

ENDPOINT = "/get_weights_checksum"


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


def engine_checksums(client: httpx.Client, url: str, names: list[str] | None = None) -> dict:
    r = client.post(url.rstrip("/") + ENDPOINT, json={"names": names})
    if r.status_code in (404, 405):
        raise VerifyUnsupported(f"{url}: the engine has no POST {ENDPOINT} (needed by weights.verify=true)")
    if r.status_code != 200:
        raise WeightSyncError(f"{url}{ENDPOINT}: HTTP {r.status_code}: {error_text(r)}")
    return r.json()


def verify(engine_urls: list[str], admin_token: str | None,
           expected: Mapping[str, int] | Iterable[tuple[str, torch.Tensor]], *,
           raise_on_mismatch: bool = True, timeout_s: float = 600.0) -> VerifyReport:
    """Compare every engine with `expected`; raise `WeightSyncError` naming the first differing tensors.

    `expected` is either name → CRC32 (computed where the tensors live, e.g. in
    a trainer actor; then the engine must hold the same dtype) or (name,
    tensor) pairs, which are cast to each engine's dtype before hashing.
    """
    items = expected.items() if isinstance(expected, Mapping) else expected
    ours = dict(items)
    report = VerifyReport(checked=len(ours))
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    with httpx.Client(headers=headers, timeout=timeout_s) as client:
        for url in engine_urls:
            got = engine_checksums(client, url)  # all: a name the engine lacks is a mismatch, not an error
            report.weight_versions[url] = got.get("weight_version")
            theirs = got.get("tensors", {})
            report.mismatches[url] = [name for name, want in ours.items() if not matches(want, theirs.get(name))]
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
