"""KL estimators and entropy: the two regularisers of the policy loss.

We only have log-probs of the *sampled* tokens, so KL(pi_theta || pi_ref) is estimated
per token from the log-ratio `x = log pi_theta(y_t) - log pi_ref(y_t)` of a sample
`y_t ~ pi_theta` (Schulman, "Approximating KL Divergence", 2020):

- k1 = x                          unbiased, high variance, can be negative;
- k2 = x^2 / 2                    biased, low variance; its gradient x * grad log pi is the
                                  on-policy score-function gradient of KL (so it is the right
                                  *loss* even though k1 is the unbiased *value*);
- k3 = exp(-x) - 1 + x            unbiased, low variance, always >= 0 ("low_var_kl").

The same per-token KL either enters the loss (`kl_coef * reduce(kl)`) or is folded
into the reward as a per-token penalty `-kl_coef * kl_t` (`kl_in_reward`, as in
InstructGPT/PPO-RLHF and REINFORCE++); see `advantages.token_rewards`.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_TYPES = ("k1", "k2", "k3")

# exp() of a log-ratio beyond this is numerically meaningless in float32; clamp for safety only.
_EXP_GUARD = 20.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs, `[B, T]`, unmasked.

    x = logprobs - ref_logprobs;  k1 = x;  k2 = x^2/2;  k3 = exp(-x) - 1 + x.
    Gradients flow through `logprobs` (and `ref_logprobs`, which callers pass detached).
    Reference: http://joschu.net/blog/kl-approx.html; verl `kl_penalty` (k1, mse, low_var_kl).
    """
    x = logprobs - ref_logprobs
    if kl_type == "k1":
        return x
    if kl_type == "k2":
        return 0.5 * x * x
    if kl_type == "k3":
        x = x.clamp(-_EXP_GUARD, _EXP_GUARD)
        return torch.exp(-x) - 1.0 + x
    raise ValueError(f"algo.kl_type={kl_type!r} is not one of {list(KL_TYPES)}")


def token_entropy(logits: Tensor) -> Tensor:
    """H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_{t,v}: the entropy of each next-token distribution.

    `logits` `[..., V]` (already divided by the sampling temperature) -> `[...]`.
    The trainer computes it next to the log-probs; the objective turns it into the
    entropy bonus `-entropy_coef * reduce(H)`.
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    return lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
