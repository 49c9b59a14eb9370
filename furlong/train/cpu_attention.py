"""A trainer's attention on a CPU in fp32 when its model computes in bf16 (or fp16) and a backward follows.

Why: PyTorch's CPU flash-attention kernel is slow backwards in bf16. On the 2-vCPU Intel Xeon with
AMX of the round-15 benchmarks (`m25` shapes: 32 rows x 80 tokens, 8 query and 4 kv heads of 64,
causal, 2 threads) SDPA forward + backward took 33.6 ms in bf16 against 12.2 ms in fp32, and 14.7 ms
with q, k and v cast up to fp32 first; a profile of a bf16 trainer step (`train.mixed_precision=bf16`)
put a quarter of the step in that backward. The attention's own FLOPs are few next to the
projections', so computing it in fp32 costs the casts only, and is the more precise of the two.

How: the model's attention implementation becomes `furlong_cpu_sdpa` (registered with transformers'
`AttentionInterface`, with the `sdpa` mask function, so masks are built exactly as for `sdpa`): it is
transformers' own `sdpa_attention_forward`, called with fp32 inputs outside autocast when it would
otherwise compute in half precision (half inputs, or autocast casting fp32 ones down) and grad is on.
Inference-only passes (old log-probs, reference, evaluation) and fp32 models take the plain call: a
forward alone is faster in bf16 (2.7 against 4.3 ms above).
Only models on a CPU are switched; a CUDA device keeps `sdpa`, whose bf16 kernels are the fast ones.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa_forward

NAME = "furlong_cpu_sdpa"
HALF = (torch.bfloat16, torch.float16)


def cpu_sdpa(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, in fp32 when it would run in half precision (half inputs, or fp32 ones that
    autocast casts down: under `mixed_precision=bf16` RoPE hands fp32 q and k over) and a backward will follow."""
    half = query.dtype in HALF or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in HALF)
    if not half or not torch.is_grad_enabled():
        return sdpa_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # an additive mask must match the query's dtype
    with torch.autocast("cpu", enabled=False):  # autocast would cast SDPA's inputs back down
        out, weights = sdpa_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


def register() -> None:
    """Make `NAME` known to transformers (idempotent): the attention function and `sdpa`'s mask builder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, cpu_sdpa)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def apply(model: nn.Module, device: torch.device) -> bool:
    """Switch a CPU model that attends through `sdpa` to `NAME`; returns whether it was switched."""
    config = getattr(model, "config", None)
    if device.type != "cpu" or config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    model.set_attn_implementation(NAME)
    return True
