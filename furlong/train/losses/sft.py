"""Supervised fine-tuning loss: masked negative log-likelihood of the target tokens."""

from __future__ import annotations

from torch import Tensor

from furlong.train.losses.reducers import REDUCERS, ReducerFn, masked_mean


def sft_loss(
    logprobs: Tensor,
    mask: Tensor,
    reducer: str | ReducerFn = "token_mean",
    *,
    constant: float | None = None,
    total_tokens: float | None = None,
    total_samples: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """L = reduce(-log p(y_t | y_<t), mask): cross-entropy on trained tokens only.

    `logprobs` `[B, T]` are the log-probs of the target tokens (with grad); prompt,
    padding, tool and template tokens have mask 0. With `token_mean` this is exactly
    `F.cross_entropy(..., ignore_index=-100)` over the kept tokens.
    Metrics: loss/sft (the reduced loss), sft/nll_token_mean (per-token NLL, independent
    of the reducer), sft/num_tokens.
    """
    fn = REDUCERS.get(reducer) if isinstance(reducer, str) else reducer
    if fn is None:
        raise ValueError(f"algo.loss_reducer={reducer!r} is not one of {sorted(REDUCERS)}")
    mask = mask.to(logprobs.dtype)
    loss = fn(-logprobs, mask, constant=constant, total_tokens=total_tokens, total_samples=total_samples)
    metrics = {
        "loss/sft": loss.item(),
        "sft/nll_token_mean": masked_mean(-logprobs.detach(), mask).item(),
        "sft/num_tokens": mask.sum().item(),
    }
    return loss, metrics
