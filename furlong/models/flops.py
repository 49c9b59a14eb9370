"""FLOPs a model costs and the peak this machine reaches: the two halves of every MFU furlong reports.

One place for both, below the trainer and the observers that report MFU (`furlong.train.mfu`, the
timeline's per-worker lanes in `furlong.observe.utilisation`), so their figures share one FLOP count and
one peak.

FLOPs are counted from the model config (`config.json`), not measured: a dense decoder's forward costs
about 2 FLOPs per matmul parameter per token (attention and MLP matmuls plus the LM head), backward twice
that. The sequence-length term of attention (QK^T and AV, ~4 * layers * hidden * context per token) is
left out: for the short contexts RL rollouts mostly have it is a few percent, and it makes the estimate
a lower bound, never an overclaim. MoE models count the experts a token is routed to, not all of them.

The peak of a CUDA device comes from `PEAK_TFLOPS` (dense bf16 tensor-core figures from the vendors'
data sheets, matched on the device name; untested on a GPU here); a device not in the table has no peak
(achieved TFLOP/s only). On CPU the peak is *measured* once per process and dtype, a short matmul loop
with torch's threads through MKL and through oneDNN (the better of the two: `core/onednn.py`), so CPU
MFU reads "fraction of what this machine's matmul reaches now" (these machines are shared VMs whose
GEMM rate depends on the CPU's vector units and the load).
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

PEAK_TFLOPS = {  # dense bf16 tensor-core TFLOP/s, by a substring of torch.cuda.get_device_name()
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,
    "T4": 65.0,
}


def forward_flops_per_token(config: dict[str, Any]) -> float:
    """About 2 x the matmul parameters a token passes through (see the module docstring for what is left out)."""
    h = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q and o; k and v
    experts = int(config.get("num_experts_per_tok") or 0)
    if experts and config.get("moe_intermediate_size"):
        mlp = 3 * h * int(config["moe_intermediate_size"]) * experts
    else:
        mlp = 3 * h * int(config.get("intermediate_size") or 4 * h)  # gated MLP: gate, up, down
    return 2.0 * (layers * (attn + mlp) + h * int(config["vocab_size"]))


def model_flops(model_dir: str | Path) -> float | None:
    """Forward FLOPs per token of the model in `model_dir`, or None when its config is not a decoder we know."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config = config.get("text_config", config)
        return forward_flops_per_token(config)
    except (OSError, KeyError, ValueError, TypeError):
        return None


@lru_cache(maxsize=8)
def peak_flops(dtype: str = "float32", device: str = "cpu") -> tuple[float | None, str]:
    """This machine's peak FLOP/s for one worker in `dtype` on `device`, and where the figure comes from."""
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        name = torch.cuda.get_device_name(0)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"data sheet ({name}, dense bf16)"
        return None, f"unknown device {name}"
    from furlong.core import onednn

    n = 256
    gen = torch.Generator().manual_seed(0)  # its own: the probe must not move the run's RNG stream (exact resume)
    a, b = (torch.randn(n, n, generator=gen).to(getattr(torch, dtype)) for _ in range(2))
    # The better of the two libraries the trainer and the engine multiply with (`core/onednn.py`).
    kernels = {"MKL": lambda: a @ b} | ({"oneDNN": lambda: onednn.linear(a, b)} if onednn.available(a.dtype) else {})
    rates = {name: _rate(fn, 2.0 * n**3) for name, fn in kernels.items()}
    best = max(rates, key=rates.get)
    return rates[best], f"measured {dtype} matmul on this CPU ({best})"


def _rate(fn, flops: float, seconds: float = 0.05) -> float:
    """FLOP/s of `fn` (costing `flops`) over a short loop after one warm-up call."""
    fn()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        reps += 1
    return flops * reps / (time.perf_counter() - t0)
