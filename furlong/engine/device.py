"""Where the built-in engine computes: `engine.device` (`auto` | `cpu` | `cuda[:N]`) resolved and checked.

Why a module: the engine, `furlong serve` and the config check must give the same answer
and the same message. `cuda` on a machine without a usable GPU is refused when the
engine is built, naming the setting, rather than failing inside the first forward.

How the forward runs there (`run_forward`): the model's weights and the KV pool live on the
device (`Engine` moves the HF module; pools are allocated from the weights' device). The
scheduler builds each step's `Batch` on the host from Python lists — every length and
index it will need, as Python ints (`Batch.decode_lens_host`, `Prefill`) and small host
tensors (`Batch.prefill_plan`, and the decode rows `NativeModel.prepare` assigns) — then
`batch_to` moves its tensors with one non-blocking copy each, and the forward runs inside
`with device:` so every tensor it creates (masks, index ranges) is created there too.

No host synchronisation inside the native forward: it reads no device value (`.item()`,
`.tolist()`, `int(tensor)`, `torch.equal`), makes no tensor from host data and uses no op
whose output shape depends on device values (`nonzero`, boolean-mask indexing, `unique`);
MoE routing is a sorted grouped GEMM (`engine.moe`). tests/unit/test_engine_host_sync.py
fails on any of these, for dense and MoE models and decode, prefill and mixed batches.
Logits come back to the host after the forward — the step's one wait for the device —
where sampling (per-request CPU generators, for seeded reproducibility) runs as on CPU.
Decode-only steps can instead replay a captured CUDA graph (`engine.cuda_graphs`,
`engine.graphs`).

UNTESTED ON A GPU: this project's machines have had no CUDA so far. The CPU path is the
same code with `device=cpu` (no copies, no device context) and is what the test suite
runs; tests/gpu/ and `scripts/gpu-check.sh` are the checks prepared for a GPU machine.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(spec: str) -> torch.device:
    """`auto` → the first CUDA device when one is usable, else CPU; `cuda[:N]` only when it exists (else ValueError)."""
    if not DEVICE_RE.match(spec or ""):
        raise ValueError(f"engine.device (--device): {spec!r} is not one of auto, cpu, cuda, cuda:N")
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        raise ValueError(
            f"engine.device={spec}: no CUDA GPU is visible to this process (torch {torch.__version__}, CUDA {built}); "
            "use engine.device=cpu (or auto), or run the engine on a machine with a GPU"
        )
    dev = torch.device(spec)
    index = 0 if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"engine.device={spec}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


def batch_to(obj: Any, device: torch.device) -> Any:
    """A copy of a `Batch` (or any dataclass, list of them, tensor) with every tensor on `device`.

    Non-blocking: a copy from pageable host memory is staged at once and does not wait for the device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, list) and obj and dataclasses.is_dataclass(obj[0]):
        return [batch_to(x, device) for x in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: batch_to(v, device)
            for f in dataclasses.fields(obj)
            if isinstance(v := getattr(obj, f.name), (torch.Tensor, list)) or dataclasses.is_dataclass(v)
        }
        return dataclasses.replace(obj, **changes)
    return obj


def run_forward(model: Any, batch: Any, device: torch.device, graphs: Any = None) -> tuple[torch.Tensor, Any]:
    """One step's forward where the engine computes: (logits, routes or None), both on the host.

    The model's host-side planning (`prepare`: decode rows) runs first, on the host batch; a
    decode-only step that fits a bucket replays its CUDA graph (`graphs`, `engine.cuda_graphs`) or runs
    compiled (`engine.compile`), and a step with short prompt chunks runs over the rows (`mixed_step`,
    which plans its own rows)."""
    if graphs is not None and graphs.fits_mixed(batch):  # prompt chunks over the decode rows (`mixed_step`)
        return graphs.run_mixed(batch)
    if hasattr(model, "prepare"):
        model.prepare(batch)
    if graphs is not None and graphs.fits(batch):
        return graphs.run(batch)
    if device.type == "cpu":
        return model.forward(batch)
    with device:  # one copy per batch tensor in, the logits out; sampling stays on the host
        logits, routes = model.forward(batch_to(batch, device))
    return logits.cpu(), (None if routes is None else routes.cpu())
