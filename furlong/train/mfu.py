"""Model FLOP utilisation of a training step: `perf/mfu` in the trainer's step metrics.

The FLOP count and the peak are `furlong.models.flops`' (the timeline's per-worker MFU lanes use the
same two): forward FLOPs per token from the model config, times 3 for forward + backward, times every
processed token of every packed sequence, prompt and response alike; the peak measured on this machine
in the trainer's dtype (a data-sheet figure on CUDA). This one is timed over the optimiser step alone, so
it reads "how well the trainer used the machine while training"; the timeline's `perf/mfu/trainer/<r>`
divides by the whole RL step's wall time, so it reads "how busy the rank was".
"""

from __future__ import annotations

import time

import torch

from furlong.models.flops import forward_flops_per_token, peak_flops

FORWARD_AND_BACKWARD = 3.0  # backward costs twice the forward


def step_mfu(flops_per_token: float, tokens: int, seconds: float, peak: float | None) -> dict[str, float]:
    """`perf/mfu` (fraction of the peak; absent without one) and `perf/train_tokens_per_s` of one step."""
    seconds = max(seconds, 1e-9)
    out = {"perf/train_tokens_per_s": tokens / seconds}
    if peak:
        out["perf/mfu"] = FORWARD_AND_BACKWARD * flops_per_token * tokens / seconds / peak
        out["perf/peak_gflops"] = peak / 1e9
    return out


def for_step(model: torch.nn.Module, dtype: torch.dtype, device, tokens: int, t0: float) -> dict[str, float]:
    """The step's MFU metrics for `model` (an HF model: its `config` counts the FLOPs), timed from `t0`."""
    seconds = time.perf_counter() - t0
    try:
        config = model.config.to_dict()
        per_token = forward_flops_per_token(config.get("text_config", config))
    except (AttributeError, KeyError, TypeError, ValueError):  # not a decoder config we can count
        return {"perf/train_tokens_per_s": tokens / max(seconds, 1e-9)}
    peak, _ = peak_flops(str(dtype).removeprefix("torch."), str(device))
    return step_mfu(per_token, tokens, seconds, peak)
