"""Advantage estimators: from rewards `[B]` (and values / per-token KL) to advantages `[B, T]`.

Every estimator returns `(advantages [B, T], returns [B, T] | None)`, zero at
untrained positions (`mask == 0`: padding, tool/env/template tokens). Token-level
estimators (REINFORCE++, GAE) walk over trained positions only: a tool response in
the middle of a trajectory is not a step of the policy, so its positions get no
reward, no value and no discount — the recursion jumps straight over them.

A group is the set of samples of one prompt (`group_index`). A group of one has no
baseline, so every group-relative estimator gives it advantage 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from furlong.config.protocols import AdvantageFn  # plug points are declared once, in config/protocols.py
from furlong.train.losses.reducers import masked_mean

if TYPE_CHECKING:
    from furlong.config.schema import AlgoConfig

EPS = 1e-6


# ---------------------------------------------------------------- group statistics
def group_mean_std(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (mean, unbiased std, size) of the sample's group, each `[B]`.

    std uses Bessel's correction (n - 1), as `torch.std` in DeepSeekMath/TRL/verl GRPO;
    it is 0 for a group of one.
    """
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    zeros = rewards.new_zeros(n_groups)
    count = zeros.index_add(0, inv, torch.ones_like(rewards))
    mean = zeros.index_add(0, inv, rewards) / count
    dev2 = (rewards - mean[inv]) ** 2
    var = zeros.index_add(0, inv, dev2) / (count - 1).clamp_min(1.0)
    return mean[inv], var.sqrt()[inv], count[inv]


def grpo_advantages(rewards: Tensor, group_index: Tensor, norm_by_std: bool = True, eps: float = EPS) -> Tensor:
    """A_i = (r_i - mean_g(r)) / (std_g(r) + eps), or r_i - mean_g(r) without std normalisation.

    Reference: GRPO, Shao et al. 2024 (DeepSeekMath) eq. for outcome supervision.
    Dr.GRPO (Liu et al. 2025) drops the std division: it up-weights groups whose
    rewards barely differ (too easy or too hard prompts).
    """
    mean, std, _ = group_mean_std(rewards, group_index)
    adv = rewards - mean
    return adv / (std + eps) if norm_by_std else adv


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) (r_i - mean_g(r)); 0 for n = 1.

    Reference: Ahmadian et al. 2024 "Back to Basics: Revisiting REINFORCE Style Optimization" (RLOO);
    Kool et al. 2019.
    """
    mean, _, n = group_mean_std(rewards, group_index)
    return (rewards - mean) * n / (n - 1).clamp_min(1.0)


def whiten(x: Tensor, mask: Tensor, scale: bool = True, eps: float = EPS) -> Tensor:
    """(x - mean) / (std + eps) over all trained positions of the batch (population std), times mask.

    The global batch normalisation of REINFORCE++ and of PPO advantages.
    """
    mean = masked_mean(x, mask)
    centred = x - mean
    if scale:
        var = masked_mean(centred * centred, mask)
        centred = centred / (var.sqrt() + eps)
    return centred * mask


# ---------------------------------------------------------------- token-level returns
def last_trained_index(mask: Tensor) -> Tensor:
    """Index of the last position with mask > 0 in each row (`[B]`, -1 for an empty row)."""
    t = mask.shape[1]
    pos = torch.arange(t, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(1).values


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """r_{i,t} = R_i [t = last trained position of i] - kl_coef * kl_{i,t}, times mask.

    The outcome reward lands on the last *trained* token (a trailing tool/template
    token is not an action). `kl` is the per-token KL to the reference policy when it
    is folded into the reward (`algo.kl_in_reward`). Reference: OpenRLHF `compute_reward`,
    Ouyang et al. 2022 (InstructGPT).
    """
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    last = last_trained_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards[rows]
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.detach().to(out.dtype)
    return out * mask


def discounted_returns(token_reward: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t'} where t' is the next *trained* position after t (G = 0 past the end).

    Untrained positions neither add reward nor consume a discount step. Reference:
    REINFORCE++ (Hu 2025), OpenRLHF `get_cumulative_returns`, restricted to loss-masked steps.
    """
    out = torch.zeros_like(token_reward)
    carry = token_reward.new_zeros(token_reward.shape[0])
    for t in range(token_reward.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        carry = torch.where(m, token_reward[:, t] + gamma * carry, carry)
        out[:, t] = torch.where(m, carry, torch.zeros_like(carry))
    return out


def gae(token_reward: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over trained positions only; returns (A, A + V), masked.

    With k indexing the trained positions of a row in order and V_{K} = 0 after the last one:
        delta_k = r_k + gamma V_{k+1} - V_k,   A_k = delta_k + gamma lam A_{k+1},   R_k = A_k + V_k.
    Values at tool/env positions are never read. Reference: Schulman et al. 2016 (GAE);
    verl `compute_gae_advantage_return` (which steps over every position instead).
    """
    adv = torch.zeros_like(token_reward)
    next_v = token_reward.new_zeros(token_reward.shape[0])
    next_a = torch.zeros_like(next_v)
    v = values.detach().to(token_reward.dtype)
    for t in range(token_reward.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        a_t = token_reward[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        next_a = torch.where(m, a_t, next_a)
        next_v = torch.where(m, v[:, t], next_v)
        adv[:, t] = torch.where(m, a_t, torch.zeros_like(a_t))
    return adv, (adv + v) * mask


# ---------------------------------------------------------------- registered estimators
def _outcome_rewards(algo: AlgoConfig, rewards: Tensor, mask: Tensor, kl: Tensor | None) -> Tensor:
    """Scalar rewards, minus kl_coef * sum_t kl_t when the KL is folded into the reward."""
    if algo.kl_in_reward and kl is not None and algo.kl_coef:
        return rewards - algo.kl_coef * (kl.detach().to(rewards.dtype) * mask).sum(1)
    return rewards


def _grpo(
    algo: AlgoConfig, rewards: Tensor, group_index: Tensor, mask: Tensor, values: Tensor | None, kl: Tensor | None
):
    adv = grpo_advantages(_outcome_rewards(algo, rewards, mask, kl), group_index, bool(algo.norm_adv_by_std))
    return adv[:, None] * mask, None


def _dr_grpo(
    algo: AlgoConfig, rewards: Tensor, group_index: Tensor, mask: Tensor, values: Tensor | None, kl: Tensor | None
):
    adv = grpo_advantages(_outcome_rewards(algo, rewards, mask, kl), group_index, norm_by_std=False)
    return adv[:, None] * mask, None


def _rloo(
    algo: AlgoConfig, rewards: Tensor, group_index: Tensor, mask: Tensor, values: Tensor | None, kl: Tensor | None
):
    return rloo_advantages(_outcome_rewards(algo, rewards, mask, kl), group_index)[:, None] * mask, None


def _token_kl(algo: AlgoConfig, kl: Tensor | None) -> Tensor | None:
    return kl if algo.kl_in_reward else None


def _reinforce_pp(
    algo: AlgoConfig, rewards: Tensor, group_index: Tensor, mask: Tensor, values: Tensor | None, kl: Tensor | None
):
    """REINFORCE++ (Hu 2025): G_t over trained tokens with per-token KL penalty, then global whitening."""
    ret = discounted_returns(token_rewards(rewards, mask, _token_kl(algo, kl), algo.kl_coef), mask, algo.gamma)
    return whiten(ret, mask, scale=bool(algo.norm_adv_by_std)), ret


def _reinforce_pp_baseline(
    algo: AlgoConfig, rewards: Tensor, group_index: Tensor, mask: Tensor, values: Tensor | None, kl: Tensor | None
):
    """REINFORCE++-baseline: subtract the group mean reward, then as REINFORCE++."""
    mean, _, _ = group_mean_std(rewards, group_index)
    shaped = token_rewards(rewards - mean, mask, _token_kl(algo, kl), algo.kl_coef)
    ret = discounted_returns(shaped, mask, algo.gamma)
    return whiten(ret, mask, scale=bool(algo.norm_adv_by_std)), ret


def _gae(
    algo: AlgoConfig, rewards: Tensor, group_index: Tensor, mask: Tensor, values: Tensor | None, kl: Tensor | None
):
    if values is None:
        raise ValueError("algo.advantage='gae' needs critic values (`values` [B, T])")
    adv, ret = gae(token_rewards(rewards, mask, _token_kl(algo, kl), algo.kl_coef), values, mask, algo.gamma, algo.lam)
    return (whiten(adv, mask) if algo.norm_adv_by_std else adv), ret


def _none(
    algo: AlgoConfig, rewards: Tensor, group_index: Tensor, mask: Tensor, values: Tensor | None, kl: Tensor | None
):
    return torch.zeros_like(mask, dtype=rewards.dtype), None


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
    "gae": _gae,
    "none": _none,
}
