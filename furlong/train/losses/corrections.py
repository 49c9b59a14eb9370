"""Off-policy corrections for the gap between the rollout engine and the trainer.

The engine that sampled a token (pi_rollout: other kernels, batch shapes, precision,
maybe an older weight version) and the trainer's recomputation at the same step
(pi_old) disagree. PPO's ratio pi/pi_old corrects only for the trainer's own updates;
these corrections weigh or drop tokens by the *behaviour* ratio

    rho_{i,t} = pi_old(y_t) / pi_rollout(y_t) = exp(old_logprobs - rollout_logprobs)

(decoupled PPO: loss_t = w_t * clipped_surrogate_t; Hilton et al. 2022, Fu et al. 2025 AReaL).
Every correction returns detached per-token weights `[B, T]` (0 = dropped) and metrics.
A dropped token contributes nothing but still counts in the reducer's denominator,
as in the IcePop and DeepSeek-V3.2 formulas.

Levels of rho for MIS/TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"; slime `mis.py`, verl rollout correction):
    token      rho_{i,t}
    sequence   prod_t rho_{i,t}                   = exp(sum_t log rho_{i,t})
    geometric  (prod_t rho_{i,t})^(1/|y_i|)       = exp(mean_t log rho_{i,t})
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from furlong.config.protocols import CorrectionFn  # plug points are declared once, in config/protocols.py
from furlong.train.losses.reducers import masked_mean, masked_sum

if TYPE_CHECKING:
    from furlong.config.schema import AlgoConfig

LEVELS = ("token", "sequence", "geometric")
_EXP_GUARD = 20.0  # exp(20) ~ 5e8; beyond it the weight is truncated or masked anyway


@dataclass(frozen=True)
class Correction:
    """Detached per-token weights `[B, T]` (0 where a token is dropped) and metrics."""

    weights: Tensor
    metrics: dict[str, float]


def ess_ratio(weights: Tensor, mask: Tensor) -> float:
    """Effective sample size ratio (sum w)^2 / (N sum w^2) over the N trained tokens; 1 = uniform weights.

    Reference: Kong 1992; reported as `rollout_is_eff_sample_size` in verl.
    """
    w = weights.detach().double()
    n = mask.sum().item()
    sq = masked_sum(w * w, mask).item()
    if n == 0 or sq == 0:
        return 0.0
    return masked_sum(w, mask).item() ** 2 / (n * sq)


def log_behaviour_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    """log rho at `level`, broadcast to `[B, T]` (zero on untrained positions for the token level)."""
    diff = torch.where(mask > 0, (old_logprobs - rollout_logprobs).detach(), torch.zeros_like(old_logprobs))
    if level == "token":
        return diff
    total = diff.sum(1, keepdim=True)
    if level == "sequence":
        return total.expand_as(diff)
    if level == "geometric":
        return (total / mask.sum(1, keepdim=True).clamp_min(1.0)).expand_as(diff)
    raise ValueError(f"algo.correction_level={level!r} is not one of {list(LEVELS)}")


def _bound_metrics(log_w: Tensor, weights: Tensor, mask: Tensor, low: float, high: float) -> dict[str, float]:
    below = (log_w < (math.log(low) if low > 0 else -math.inf)).to(weights.dtype)
    above = (log_w > math.log(high)).to(weights.dtype)
    return {
        "correction/low_frac": masked_mean(below, mask).item(),
        "correction/high_frac": masked_mean(above, mask).item(),
        "correction/keep_frac": masked_mean((weights > 0).to(weights.dtype), mask).item(),
        "correction/weight_mean": masked_mean(weights, mask).item(),
        "correction/ess_ratio": ess_ratio(weights, mask),
    }


def tis(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float, level: str = "token") -> Correction:
    """Truncated importance sampling: w = min(rho, C), detached.

    Reference: Yao et al. 2025 (TIS, fengyao.notion.site/off-policy-rl); slime `--use-tis`.
    """
    log_w = log_behaviour_ratio(old_logprobs, rollout_logprobs, mask, level)
    weights = torch.exp(log_w.clamp(max=_EXP_GUARD)).clamp(max=cap) * mask
    return Correction(weights, _bound_metrics(log_w, weights, mask, 0.0, cap))


def mis(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    level: str,
    mode: str,
    low: float,
    high: float,
) -> Correction:
    """Masked / truncated importance sampling at `level`.

    truncate: w = clip(rho, low, high)
    mask:     w = rho * 1[low <= rho <= high]   (the whole sequence for sequence/geometric levels)
    Reference: slime `examples/train_infer_mismatch_helper/mis.py`; verl rollout_is / rollout_rs.
    """
    if not 0 <= low < high:
        raise ValueError(f"need 0 <= algo.correction_low < algo.correction_high, got {low}, {high}")
    log_w = log_behaviour_ratio(old_logprobs, rollout_logprobs, mask, level)
    rho = torch.exp(log_w.clamp(-_EXP_GUARD, _EXP_GUARD))
    if mode == "truncate":
        weights = rho.clamp(low, high)
    elif mode == "mask":
        lo = math.log(low) if low > 0 else -math.inf
        weights = torch.where((log_w >= lo) & (log_w <= math.log(high)), rho, torch.zeros_like(rho))
    else:
        raise ValueError(f"algo.correction_mode={mode!r} is not one of ['truncate', 'mask']")
    weights = weights * mask
    return Correction(weights, _bound_metrics(log_w, weights, mask, low, high))


def icepop(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, low: float, high: float) -> Correction:
    """IcePop: w_t = rho_t if low <= rho_t <= high else 0, per token ("discrepancy masking").

    Tokens whose train/inference probabilities disagree by more than the band are dropped
    from the gradient; the others are importance-weighted. Reference: Ling Team 2025,
    "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model" (Ring-1T), eq. of
    M(k) = k if k in [alpha, beta] else 0 with alpha = 0.5, beta = 5; slime `icepop_function`.
    Equal to `mis(level="token", mode="mask")`; kept as its own name because recipes ask for it.
    """
    return mis(old_logprobs, rollout_logprobs, mask, "token", "mask", low, high)


def opsm(logprobs: Tensor, sampling_logprobs: Tensor, advantages: Tensor, mask: Tensor, delta: float) -> Correction:
    """Off-policy sequence masking: drop tokens with A_{i,t} < 0 of sequences that drifted too far.

    M_{i,t} = 0 if A_{i,t} < 0 and (1/|y_i|) sum_t log(pi_sampling(y_t) / pi_theta(y_t)) > delta, else 1.
    A negative sample from a policy the learner has already left teaches little and
    destabilises; positive ones are kept. `sampling_logprobs` are the rollout engine's
    log-probs (the old log-probs when none were recorded); `logprobs` the current ones (detached).
    Reference: DeepSeek-AI 2025, "DeepSeek-V3.2" (Off-Policy Sequence Masking); slime `compute_opsm_mask`.
    """
    diff = torch.where(mask > 0, (sampling_logprobs - logprobs).detach(), torch.zeros_like(logprobs))
    seq_kl = diff.sum(1) / mask.sum(1).clamp_min(1.0)
    drop = (advantages.detach() < 0) & (seq_kl[:, None] > delta) & (mask > 0)
    weights = (~drop).to(logprobs.dtype) * mask
    rows = mask.sum(1) > 0
    metrics = {
        "correction/keep_frac": masked_mean(weights, mask).item(),
        "correction/opsm_seq_frac": (drop.any(1).sum() / rows.sum().clamp_min(1)).item(),
        "correction/opsm_seq_kl_mean": (seq_kl[rows].mean().item() if rows.any() else 0.0),
        "correction/ess_ratio": ess_ratio(weights, mask),
    }
    return Correction(weights, metrics)


def mismatch_metrics(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the trainer and the rollout engine disagree on the sampled tokens.

    mismatch/logprob_abs_diff  mean_t |log pi_old - log pi_rollout|
    mismatch/kl                mean_t (rho - 1 - log rho), rho = pi_old/pi_rollout: the k3
                               estimate of KL(pi_rollout || pi_old) on rollout samples
    mismatch/ess_ratio         ESS ratio of the raw token weights rho
    """
    log_rho = log_behaviour_ratio(old_logprobs, rollout_logprobs, mask, "token").clamp(-_EXP_GUARD, _EXP_GUARD)
    rho = torch.exp(log_rho)
    return {
        "mismatch/logprob_abs_diff": masked_mean(log_rho.abs(), mask).item(),
        "mismatch/kl": masked_mean(rho - 1.0 - log_rho, mask).item(),
        "mismatch/ess_ratio": ess_ratio(rho, mask),
    }


# ---------------------------------------------------------------- registry adapters
def _need_rollout(algo: AlgoConfig, tensors: Mapping[str, Tensor]) -> Tensor:
    rollout = tensors.get("rollout_logprobs")
    if rollout is None:
        raise ValueError(f"algo.correction={algo.correction!r} needs tensors['rollout_logprobs'] from the engine")
    return rollout


def _tis(algo: AlgoConfig, t: Mapping[str, Tensor]) -> Correction:
    return tis(t["old_logprobs"], _need_rollout(algo, t), t["mask"], algo.correction_high, algo.correction_level)


def _mis(algo: AlgoConfig, t: Mapping[str, Tensor]) -> Correction:
    return mis(
        t["old_logprobs"],
        _need_rollout(algo, t),
        t["mask"],
        algo.correction_level,
        algo.correction_mode,
        algo.correction_low,
        algo.correction_high,
    )


def _icepop(algo: AlgoConfig, t: Mapping[str, Tensor]) -> Correction:
    return icepop(t["old_logprobs"], _need_rollout(algo, t), t["mask"], algo.correction_low, algo.correction_high)


def _opsm(algo: AlgoConfig, t: Mapping[str, Tensor]) -> Correction:
    sampling = t.get("rollout_logprobs")
    sampling = t["old_logprobs"] if sampling is None else sampling
    return opsm(t["logprobs"], sampling, t["advantages"], t["mask"], algo.correction_high)


CORRECTIONS: dict[str, CorrectionFn] = {"tis": _tis, "mis": _mis, "icepop": _icepop, "opsm": _opsm}
