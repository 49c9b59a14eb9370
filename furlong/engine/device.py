"""Where the built-in engine computes: `engine.device` (`auto` | `cpu` | `cuda[:N]`) resolved and checked.

Why a module: the engine, `furlong serve` and the config check must give the same answer
and the same message. `cuda` on a machine without a usable GPU is refused when the
engine is built, naming the setting, rather than failing inside the first forward.

How the forward runs there: the model's weights and the KV pool live on the device
(`Engine` moves the HF module; pools are allocated from the weights' device). The
scheduler builds each step's `Batch` on the host from Python lists, `batch_to` moves its
tensors with one non-blocking copy each, and the forward runs inside `with device:` so
every tensor the forward creates (masks, index ranges, decode rows) is created there too.
Logits come back to the host after the forward, where sampling (per-request CPU
generators, for seeded reproducibility) runs as on CPU.

UNTESTED ON A GPU: this session's machines have no CUDA. The CPU path is the same code
with `device=cpu` (no copies, no device context) and is what the test suite runs.
Known host synchronisations left inside the native forward on CUDA: the decode-length
lists (`decode_lens.tolist()`, the `max` of a fill) and the MoE expert loop
(`torch.unique(...).tolist()`); CUDA-graph capture (`engine.cuda_graphs`) is not built.
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
    """A copy of a `Batch` (or any dataclass, list of them, tensor) with every tensor on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, list) and obj and dataclasses.is_dataclass(obj[0]):
        return [batch_to(x, device) for x in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: batch_to(getattr(obj, f.name), device)
            for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), (torch.Tensor, list))
        }
        return dataclasses.replace(obj, **changes)
    return obj
