"""What every benchmark states about the machine it ran on, and the roofline it is judged against.

Why: a throughput figure without the CPU, its vector units and *that run's*
measured GEMM peak and memory bandwidth cannot be compared with anything; a
roofline from a datasheet (or from another machine) makes every system look
slower or faster than it is. So each benchmark prints `header()` first and
RESULTS.md records the same line, and rooflines are min(compute, bandwidth):

- compute: FLOPs of every processed token — prompt and generated, forward
  (2 x params) and, for training, backward (4 x params) — at the measured GEMM peak;
- bandwidth: the bytes each step must stream (the weights once per decode step,
  plus the KV it reads) at the measured copy bandwidth.

Figures are the median of `runs` (default 3) runs of >= 5 timed steps each;
`--profile` (or FURLONG_BENCH_PROFILE=1) prints a `torch.profiler` top-10 of one run.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info() -> dict[str, Any]:
    """CPU model, the vector-unit flags that decide GEMM speed, and core counts."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return {
        "model": model,
        "flags": [f for f in FLAGS if f in flags],
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


def gemm_peak(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 1.0) -> dict[str, float]:
    """GFLOP/s of an n x n matmul through MKL (`torch.mm`) and oneDNN with a pre-packed weight; `peak` is
    the better, so no system is measured against a slower library than it could use."""
    from furlong.core.onednn import pick_linear

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    linear, pack = pick_linear(dtype)
    packed = pack(b)
    out = {}
    for name, fn in (("mkl", lambda: torch.mm(a, b)), ("onednn", lambda: linear(a, packed))):
        fn()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            reps += 1
        out[name] = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9
    out["peak"] = max(out.values())
    out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def memcpy_bandwidth(mb: int = 256, seconds: float = 1.0) -> float:
    """GB/s of memory traffic (read + write) of a large tensor copy: the bound on streaming weights."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src)
        reps += 1
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - t0) / 1e9


def header(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Measure and print the machine line every benchmark starts with; returns the figures."""
    info = cpu_info()
    info["gemm"] = gemm_peak(dtype)
    info["bandwidth_gbs"] = memcpy_bandwidth()
    info["load"] = os.getloadavg()[0]
    print(machine_line(info), flush=True)
    return info


def machine_line(info: dict[str, Any]) -> str:
    g = info["gemm"]
    return (
        f"machine: {info['model']}; flags {' '.join(info['flags']) or '-'}; {info['cpus']} cpus, "
        f"{info['threads']} threads; GEMM peak {g['peak']:.0f} GFLOP/s "
        f"({g.get('dtype', 'float32')}: MKL {g['mkl']:.0f}, oneDNN {g['onednn']:.0f}); "
        f"memcpy {info['bandwidth_gbs']:.1f} GB/s; load avg {info['load']:.1f}"
    )


def load_line(threads: int, consequence: str = "these figures are noisy") -> str:
    """The load average now, and a warning when other work shares the cores (every benchmark prints it last)."""
    load = os.getloadavg()[0]
    busy = f" - other work shared the CPU; {consequence}" if load > threads + 0.5 else ""
    return f"load average {load:.1f} on {os.cpu_count()} cores{busy}"


def roofline_seconds(flops: float, bytes_moved: float, info: dict[str, Any]) -> float:
    """The least time the work can take: compute-bound or bandwidth-bound, whichever is slower."""
    return max(flops / (info["gemm"]["peak"] * 1e9), bytes_moved / (info["bandwidth_gbs"] * 1e9))


def decode_roofline_tok_s(
    n_params: int, param_bytes: int, prompt_tokens: int, new_tokens: int, batch: int, kv_bytes_per_token: int, info
) -> float:
    """Generated tokens/s the hardware allows for `batch` sequences of `prompt_tokens` + `new_tokens`:
    FLOPs count every processed token (2 x params each, prompt included); bytes count the weights
    streamed once per decode step plus the KV each step reads."""
    flops = 2.0 * n_params * batch * (prompt_tokens + new_tokens)
    kv_read = kv_bytes_per_token * batch * sum(prompt_tokens + i for i in range(new_tokens))
    bytes_moved = param_bytes * (new_tokens + 1) + kv_read
    return batch * new_tokens / roofline_seconds(flops, bytes_moved, info)


def median_of(fn: Callable[[], float], runs: int = 3) -> tuple[float, list[float]]:
    """(median, all) of `runs` calls of `fn`, each returning one figure."""
    figures = [fn() for _ in range(runs)]
    return statistics.median(figures), figures


def profiling() -> bool:
    return os.environ.get("FURLONG_BENCH_PROFILE", "") not in ("", "0")


def profile_top10(fn: Callable[[], Any], title: str) -> Any:
    """Run `fn` under `torch.profiler` and print the 10 ops with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    print(f"\ntorch.profiler top-10 ({title}):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    return out
