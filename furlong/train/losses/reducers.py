"""Loss reducers: how a `[B, T]` tensor of per-token losses becomes one scalar.

The choice is not cosmetic. With `token_mean` every trained token weighs the same,
so long answers dominate the gradient; with `sample_mean` every sample weighs the
same, so each token of a long answer weighs less (the GRPO paper's `1/|o_i|`),
which Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") shows biases
the policy toward long wrong answers; `constant` divides the sum by `B x C` for a
fixed `C` (the generation budget), which removes that length bias.

Distributed and micro-batched training: pass `total_tokens` / `total_samples`
(the counts over the *whole* global batch) and each micro-batch's result becomes
its exact share of the global loss, so that summing micro-batches (and summing
ranks) reproduces the single-batch loss whatever the split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from furlong.config.protocols import ReducerFn  # plug points are declared once, in config/protocols.py


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum_{b,t} m_{b,t} x_{b,t} (over `dim` if given). Padding values never leak, even NaN."""
    prod = torch.where(mask > 0, values * mask, torch.zeros_like(values))
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum m x / max(sum m, 1): the mean over trained positions (0 when there are none)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1.0)


def token_mean(
    values: Tensor,
    mask: Tensor,
    *,
    constant: float | None = None,
    total_tokens: float | None = None,
    total_samples: float | None = None,
) -> Tensor:
    """L = sum_{i,t} m_{i,t} l_{i,t} / N, N = total_tokens or sum_{i,t} m_{i,t}.

    Reference: DAPO (Yu et al. 2025) "token-level policy gradient loss"; verl `token-mean`.
    """
    denom = float(total_tokens) if total_tokens is not None else mask.sum().clamp_min(1.0)
    return masked_sum(values, mask) / denom


def sample_mean(
    values: Tensor,
    mask: Tensor,
    *,
    constant: float | None = None,
    total_tokens: float | None = None,
    total_samples: float | None = None,
) -> Tensor:
    """L = (1/S) sum_i [ sum_t m_{i,t} l_{i,t} / sum_t m_{i,t} ].

    S = total_samples, or the number of rows with at least one trained token (a row
    that is all tool/env tokens has nothing to average and is not counted).
    Reference: GRPO (Shao et al. 2024) `1/G sum_i 1/|o_i| sum_t`; verl `seq-mean-token-mean`.
    """
    per_row_count = mask.sum(1)
    per_row = masked_sum(values, mask, dim=1) / per_row_count.clamp_min(1.0)
    denom = float(total_samples) if total_samples is not None else (per_row_count > 0).sum().clamp_min(1)
    return per_row.sum() / denom


def constant_divisor(
    values: Tensor,
    mask: Tensor,
    *,
    constant: float | None = None,
    total_tokens: float | None = None,
    total_samples: float | None = None,
) -> Tensor:
    """L = sum_{i,t} m_{i,t} l_{i,t} / (S x C).

    S = total_samples or B (rows); C = `constant`, or T (the padded length) when not
    given — set it to the generation budget (max new tokens) so it does not change
    with the batch. Reference: Dr.GRPO (Liu et al. 2025), `loss_agg_mode=seq-mean-token-sum-norm` in verl.
    """
    c = float(constant) if constant is not None else float(mask.shape[1])
    if c <= 0:
        raise ValueError(f"algo.reducer_constant must be > 0, got {constant}")
    s = float(total_samples) if total_samples is not None else float(mask.shape[0])
    return masked_sum(values, mask) / (max(s, 1.0) * c)


REDUCERS: dict[str, ReducerFn] = {
    "token_mean": token_mean,
    "sample_mean": sample_mean,
    "constant": constant_divisor,
}
