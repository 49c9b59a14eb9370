"""oneDNN matrix multiplies on CPU: the engine's packed-weight linear and the trainer's linear both use them.

Why not `F.linear` / `torch.mm`: on CPU those are MKL's sgemm, and on the AMD EPYC machines this
project is measured on MKL runs fp32 at roughly half the speed oneDNN reaches (MKL picks its AVX2
kernels on a CPU that is not Intel's). Measured on a 2-vCPU AMD EPYC with AVX-512, 2 threads, fp32,
the trainer's shapes of the `m25` model ([2048, 512] x [512, 1536] and its backward products): MKL
205-222 GFLOP/s, oneDNN on plain weights 330-495 GFLOP/s. The benchmarks print both peaks
(`benchmarks/_machine.py`). `linear(x, w, b)` computes `x @ w.T + b` like `F.linear`, with `w`
either a plain `[out, in]` matrix or one `pack`ed into oneDNN's blocked layout (the engine's
weights, packed once per weight sync).

The engine's batches are 1-64 rows, where packing pays most, and it pays on Intel too: on the
2-vCPU Xeon (AMX) of issue 15, m25, 2 threads, `engine_throughput.py --skip-http --skip-hf`, mixed
lengths / groups rows in tok/s: fp32 packed 1,051 / 1,613, `F.linear` 1,015 / 1,322, oneDNN on
plain weights 1,024 / 1,511; bf16 packed 1,892 / 2,629, `F.linear` 1,567 / 2,323, plain oneDNN
1,563 / 2,212. A weight update writes the packed weights in place (`engine/packed.py`), so packing
costs a sync nothing extra. The trainer multiplies by plain weights (they change every optimiser
step) through `train/onednn_linear.py`.

`mkl_slow_here()` says whether this CPU is one where MKL takes its slow path (an x86 CPU not made by
Intel): there the trainer's `auto` turns oneDNN on. On Intel's own CPUs MKL's sgemm is at least as fast
at the trainer's shapes (the 2-vCPU Xeon with AMX of issue 15, m25, 2048-row micro-batches, fp32:
3.49 s a step through MKL, 3.94 s through oneDNN; `benchmarks/RESULTS.md`, round 15).

`available(dtype)` probes once per dtype that oneDNN is in this build, takes `dtype` and agrees
with `F.linear`: a build without it, or a dtype it rejects, keeps `F.linear`.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F

PACK_ROWS = 64  # row-count hint for oneDNN's weight layout; any row count still works


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T + b` through oneDNN; `x` is `[rows, in]`, `w` `[out, in]` plain or packed."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def pack(w: torch.Tensor) -> torch.Tensor:
    """`w` `[out, in]` reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)


X86 = ("x86_64", "amd64", "i686", "i386")


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD", ...); "" where the file has none or is missing."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def mkl_slow_here() -> bool:
    """An x86 CPU whose vendor is not Intel: MKL's sgemm takes its generic AVX2 path there."""
    return platform.machine().lower() in X86 and cpu_vendor() not in ("", "GenuineIntel")


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """oneDNN's linear exists in this build, accepts `dtype` and matches `F.linear` on plain and packed weights."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        gen = torch.Generator().manual_seed(0)  # its own: the probe must not move a run's RNG stream
        x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((5, 16), (8, 16), (8,)))
        want = F.linear(x, w, b).float()
        return all(torch.allclose(linear(x, m, b).float(), want, atol=1e-2, rtol=1e-2) for m in (w, pack(w)))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def pick_linear(dtype: torch.dtype) -> tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(linear, pack): oneDNN with pre-packed weights where it works for `dtype`, else (`F.linear`, identity)."""
    return (linear, pack) if available(dtype) else (F.linear, lambda w: w)
