"""Policy and value losses: the PPO clipped surrogate (token or sequence ratio) and the clipped value loss.

All functions return *per-token* losses `[B, T]` (to be multiplied by correction
weights and reduced by a reducer) plus detached metrics over trained tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from furlong.config.protocols import LossFn  # plug points are declared once, in config/protocols.py
from furlong.train.losses.reducers import masked_mean, masked_sum

if TYPE_CHECKING:
    from furlong.config.schema import AlgoConfig


def log_ratio(
    logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, ratio_type: str = "token", clamp: float | None = None
) -> Tensor:
    """log r_{i,t}, clamped to [-clamp, clamp] before anyone takes exp.

    token:    log r_{i,t} = log pi(y_t) - log pi_old(y_t)                (PPO, GRPO, DAPO)
    sequence: log s_i = (1/|y_i|) sum_t m_t (log pi(y_t) - log pi_old(y_t)), the log of the
              geometric mean of the token ratios (GSPO, Zheng et al. 2025). It is spread over
              tokens as log s_{i,t} = sg[log s_i] + log pi(y_t) - sg[log pi(y_t)] (GSPO-token):
              its value is log s_i at every token, and with a per-sequence advantage its gradient
              equals that of the sequence objective; it also accepts per-token advantages.
    Reference: verl `compute_policy_loss_gspo`.
    """
    # untrained positions get ratio 1: padding log-probs are arbitrary, and exp() of a
    # padding difference could overflow and turn the masked-out gradient into 0 * inf = NaN
    diff = torch.where(mask > 0, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if ratio_type == "sequence":
        seq = masked_sum(diff.detach(), mask, dim=1) / mask.sum(1).clamp_min(1.0)
        diff = seq[:, None] + diff - diff.detach()
    elif ratio_type != "token":
        raise ValueError(f"algo.ratio_type={ratio_type!r} is not one of ['token', 'sequence']")
    if clamp:
        diff = diff.clamp(-clamp, clamp)
    return diff


def ppo_clip(
    log_r: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """l_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with dual clip, for A < 0: min(l_t, -c A).

    Asymmetric bounds are DAPO's "clip-higher" (Yu et al. 2025): a larger eps_high lets
    low-probability tokens grow, which keeps entropy from collapsing. Dual clip (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games") caps the loss of a negative-advantage token whose
    ratio has exploded, c > 1. Reference: Schulman et al. 2017 (PPO); verl `compute_policy_loss_vanilla`.

    Metrics (fractions of trained tokens; the gradient is zero on each):
      policy/clip_frac_low  A < 0 and r < 1 - eps_low
      policy/clip_frac_high A > 0 and r > 1 + eps_high
      policy/clip_frac_dual A < 0 and r > c
      policy/clip_frac      low + high
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"algo.dual_clip_c must be > 1, got {dual_clip_c}")
    ratio = torch.exp(log_r)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(loss1, loss2)
    if dual_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip_c * advantages), loss)
    with torch.no_grad():
        r = ratio.detach()
        low = ((advantages < 0) & (r < 1.0 - eps_low)).to(r.dtype)
        high = ((advantages > 0) & (r > 1.0 + eps_high)).to(r.dtype)
        dual = ((advantages < 0) & (r > dual_clip_c)).to(r.dtype) if dual_clip_c is not None else torch.zeros_like(r)
        metrics = {
            "policy/clip_frac_low": masked_mean(low, mask).item(),
            "policy/clip_frac_high": masked_mean(high, mask).item(),
            "policy/clip_frac_dual": masked_mean(dual, mask).item(),
            "policy/ratio_mean": masked_mean(r, mask).item(),
            "policy/ratio_max": (r * mask).max().item() if mask.any() else 0.0,
            "policy/approx_kl": masked_mean(-log_r.detach(), mask).item(),
        }
        metrics["policy/clip_frac"] = metrics["policy/clip_frac_low"] + metrics["policy/clip_frac_high"]
    return loss, metrics


def ppo_clip_loss(
    algo: AlgoConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """The registered `ppo_clip` loss: `log_ratio` per `algo.ratio_type`, then `ppo_clip` with algo's bounds."""
    log_r = log_ratio(logprobs, old_logprobs, mask, algo.ratio_type, algo.log_ratio_clamp)
    loss, metrics = ppo_clip(log_r, advantages.detach(), mask, algo.clip_eps_low, algo.clip_eps_high, algo.dual_clip_c)
    if algo.ratio_type == "sequence":  # GSPO alone logs these: the ratio it clips is one number per sequence
        metrics.update(sequence_ratio_metrics(log_r, mask, algo.clip_eps_low, algo.clip_eps_high))
    return loss, metrics


def sequence_ratio_metrics(log_r: Tensor, mask: Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """policy/seq_ratio_mean, policy/seq_ratio_max and policy/seq_clip_frac over the sequences that have tokens.

    With a sequence-level ratio every trained token of a row carries the same value, log s_i; a
    sequence is clipped when s_i leaves [1 - eps_low, 1 + eps_high] (GSPO's bounds are ~1e-4 wide).
    """
    with torch.no_grad():
        rows = mask.sum(1) > 0
        if not rows.any():
            return {"policy/seq_ratio_mean": 1.0, "policy/seq_ratio_max": 1.0, "policy/seq_clip_frac": 0.0}
        s = torch.exp(masked_sum(log_r.detach(), mask, dim=1) / mask.sum(1).clamp_min(1.0))[rows]
        out = ((s < 1.0 - eps_low) | (s > 1.0 + eps_high)).to(s.dtype)
        return {
            "policy/seq_ratio_mean": s.mean().item(),
            "policy/seq_ratio_max": s.max().item(),
            "policy/seq_clip_frac": out.mean().item(),
        }


POLICY_LOSSES: dict[str, LossFn] = {"ppo_clip": ppo_clip_loss}


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
) -> tuple[Tensor, dict[str, float]]:
    """l_t = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2); unclipped 1/2 (V - R)^2 when c is 0/None.

    Clipping keeps the critic near the values the advantages were computed with
    (PPO2 baselines; verl `compute_value_loss`). Metrics: value/clip_frac (the clipped
    branch is the larger one), value/pred_mean, value/return_mean.
    """
    returns = returns.detach()
    err = (values - returns) ** 2
    if clip:
        v_clip = old_values.detach() + (values - old_values.detach()).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(err, err_clip)
        clipped = (err_clip > err).to(values.dtype)
    else:
        loss = 0.5 * err
        clipped = torch.zeros_like(err)
    metrics = {
        "value/clip_frac": masked_mean(clipped.detach(), mask).item(),
        "value/pred_mean": masked_mean(values.detach(), mask).item(),
        "value/return_mean": masked_mean(returns, mask).item(),
    }
    return loss, metrics
