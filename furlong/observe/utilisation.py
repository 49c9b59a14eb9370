"""GPU utilisation and memory per device, for the timeline's per-step metrics.

They come from NVML (`nvidia-ml-py`, imported as `pynvml`) when it is installed and a driver answers;
otherwise `gpu_stats()` returns nothing. That path has not been run on a GPU by this project's tests (no
GPU in CI): treat its numbers as untested until it has. (MFU's FLOP count and peak: `furlong.models.flops`.)
"""

from __future__ import annotations


def gpu_stats() -> dict[str, float]:
    """`gpu/<i>/util` (percent busy) and `gpu/<i>/memory_gb` per device from NVML; {} without NVML or a GPU."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVML present but no driver: no device stats, not an error
        return {}
    out: dict[str, float] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            out[f"gpu/{i}/util"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            out[f"gpu/{i}/memory_gb"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
    finally:
        pynvml.nvmlShutdown()
    return out
