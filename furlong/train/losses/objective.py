"""The two entry points the trainer calls: `compute_advantages` and `compute_policy_objective`.

`algo` is the config's `AlgoConfig` (read by attribute only, so tests may pass any object
with its fields). Each piece — advantage estimator, policy loss, off-policy correction,
reducer — is looked up by name in its registry, or replaced by passing a function: the
trainer passes the `train.advantage_fn` / `loss_fn` / `correction_fn` / `reducer_fn` plug
points here, resolved by the driver, and each is called exactly as its Protocol in
`furlong.config.registry` declares.

One call computes, in this order:
    advantages (+ distillation shaping) -> behaviour correction weights w
    -> per-token clipped surrogate l_t -> L_pg = reduce(w * l)
    L = L_pg + kl_coef * reduce(kl) - entropy_coef * reduce(H) + vf_coef * reduce(l_V)
        [+ distill_coef * reduce(w * l_rkl)]
and returns every metric the loss side knows (names listed in docs/algorithms/).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from furlong.train.losses.advantages import ADVANTAGE_ESTIMATORS, AdvantageFn
from furlong.train.losses.corrections import CORRECTIONS, CorrectionFn, mismatch_metrics
from furlong.train.losses.distill import distill_advantages, reverse_kl_loss
from furlong.train.losses.kl import kl_estimate
from furlong.train.losses.policy import POLICY_LOSSES, LossFn, value_loss
from furlong.train.losses.reducers import REDUCERS, ReducerFn, masked_mean
from furlong.train.losses.sft import sft_loss

if TYPE_CHECKING:
    from furlong.config.schema import AlgoConfig

F = TypeVar("F", bound=Callable[..., Any])

_PER_TOKEN_KEYS = (
    "logprobs",
    "old_logprobs",
    "rollout_logprobs",
    "ref_logprobs",
    "advantages",
    "entropy",
    "teacher_logprobs",
    "values",
    "old_values",
    "returns",
)


def _resolve(fn: F | str | None, registry: Mapping[str, F], default: str, field: str) -> F:
    """A function given directly, or registry[name]; a clear error names the config field."""
    if fn is not None and not isinstance(fn, str):
        return fn
    name = default if fn is None else fn
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"{field}={name!r} is not one of {sorted(registry)}") from None


def _check_shapes(tensors: Mapping[str, Any], mask: Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"tensors['mask'] must be [B, T], got shape {tuple(mask.shape)}")
    for key in _PER_TOKEN_KEYS:
        t = tensors.get(key)
        if t is not None and tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"tensors[{key!r}] has shape {tuple(t.shape)}, expected {tuple(mask.shape)} like 'mask'")


def compute_advantages(
    algo: AlgoConfig,
    rewards: Tensor,
    group_index: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    kl: Tensor | None = None,
    *,
    advantage_fn: AdvantageFn | str | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Advantages `[B, T]` (zero where mask is 0) and returns `[B, T]` (token-level estimators) or None.

    `algo.advantage` selects the estimator (see `advantages.py`); `kl` is the per-token KL to
    the reference (`kl_estimate`), folded into the reward when `algo.kl_in_reward`; `values`
    are the critic's, needed by `gae`.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"mask must be [B, T] with B={rewards.shape[0]}, got shape {tuple(mask.shape)}")
    if tuple(group_index.shape) != tuple(rewards.shape):
        raise ValueError(f"group_index must be [B]={tuple(rewards.shape)}, got {tuple(group_index.shape)}")
    for name, t in (("values", values), ("kl", kl)):
        if t is not None and tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(mask.shape)} like mask")
    rewards = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    mask = mask.to(rewards.dtype)
    fn = _resolve(advantage_fn, ADVANTAGE_ESTIMATORS, algo.advantage, "algo.advantage")
    with torch.no_grad():
        return fn(algo, rewards, group_index, mask, values, kl)


def advantage_metrics(algo: AlgoConfig, advantages: Tensor, returns: Tensor | None, mask: Tensor) -> dict[str, float]:
    """What the estimator produced, under a key naming it: `advantage/<algo.advantage>/abs_mean` (and
    `.../std`, `.../returns_mean` for token-level estimators), so a run's metrics say which estimator ran.

    A zero `abs_mean` means every group agreed (nothing to learn from the batch)."""
    m = mask.to(advantages.dtype)
    name = f"advantage/{algo.advantage}"
    mean = masked_mean(advantages, m)
    out = {
        f"{name}/abs_mean": masked_mean(advantages.abs(), m).item(),
        f"{name}/std": masked_mean((advantages - mean) ** 2, m).sqrt().item(),
    }
    if returns is not None:
        out[f"{name}/returns_mean"] = masked_mean(returns.to(m.dtype), m).item()
    return out


def compute_policy_objective(
    algo: AlgoConfig,
    tensors: Mapping[str, Any],
    *,
    loss_fn: LossFn | str | None = None,
    correction_fn: CorrectionFn | str | None = None,
    reducer_fn: ReducerFn | str | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The scalar loss to backpropagate and its metrics, for every algorithm of `algo.name`.

    tensors (all `[B, T]` unless noted): logprobs (current, with grad), old_logprobs, mask;
    optional rollout_logprobs, ref_logprobs, advantages (required except for sft/distill),
    entropy, teacher_logprobs (distill), values/old_values/returns (PPO critic), and the
    scalars total_tokens/total_samples (global-batch counts for the reducer, see reducers.py).
    """
    mask = tensors["mask"]
    _check_shapes(tensors, mask)
    lp, old = tensors["logprobs"], tensors["old_logprobs"].detach()
    mask = mask.to(lp.dtype)
    reducer = _resolve(reducer_fn, REDUCERS, algo.loss_reducer, "algo.loss_reducer")

    def reduce(values: Tensor) -> Tensor:
        return reducer(
            values,
            mask,
            constant=algo.reducer_constant,
            total_tokens=_scalar(tensors.get("total_tokens")),
            total_samples=_scalar(tensors.get("total_samples")),
        )

    if algo.name == "sft":
        return sft_loss(
            lp,
            mask,
            reducer,
            constant=algo.reducer_constant,
            total_tokens=_scalar(tensors.get("total_tokens")),
            total_samples=_scalar(tensors.get("total_samples")),
        )

    metrics: dict[str, float] = {"policy/num_tokens": mask.sum().item()}
    adv, run_pg = _policy_advantages(algo, tensors, lp, old, mask, metrics)
    weights = _correction_weights(algo, tensors, adv, old, mask, lp.dtype, correction_fn, metrics)

    total = lp.new_zeros(())
    if run_pg:
        pg_tokens, pg_metrics = _resolve(loss_fn, POLICY_LOSSES, "ppo_clip", "loss")(algo, lp, old, adv, mask)
        metrics.update(pg_metrics)
        loss_pg = reduce(pg_tokens if weights is None else pg_tokens * weights)
        metrics["loss/policy"] = loss_pg.item()
        total = total + loss_pg
    total = _add_other_terms(algo, tensors, lp, mask, weights, reduce, metrics, total)
    metrics["loss/total"] = total.item()
    return total, metrics


def _policy_advantages(
    algo: AlgoConfig, tensors: Mapping[str, Any], lp: Tensor, old: Tensor, mask: Tensor, metrics: dict[str, float]
) -> tuple[Tensor, bool]:
    """(advantages, whether the policy-gradient term runs): the given ones, shaped by distillation if asked.

    Distillation may run with no advantages at all (reverse_kl mode): the policy term is then skipped and
    zeros stand in where advantages are still read (the `policy/advantage_mean` metric, the correction).
    """
    adv = tensors.get("advantages")
    distill = algo.name == "distill"
    teacher = tensors.get("teacher_logprobs")
    if distill:
        if teacher is None:
            raise ValueError("algo.name='distill' needs tensors['teacher_logprobs']")
        metrics["distill/reverse_kl"] = masked_mean((old - teacher).detach(), mask).item()
    run_pg = adv is not None or (distill and algo.distill_mode == "advantage")
    if adv is None:
        if not distill:
            raise ValueError(f"algo.name={algo.name!r} needs tensors['advantages'] (from compute_advantages)")
        adv = torch.zeros_like(lp).detach()
    adv = adv.detach().to(lp.dtype)
    if distill and algo.distill_mode == "advantage":
        adv = adv + distill_advantages(teacher, old, mask, algo.distill_coef)
    elif distill and algo.distill_mode != "reverse_kl":
        raise ValueError(f"algo.distill_mode={algo.distill_mode!r} is not one of ['advantage', 'reverse_kl']")
    metrics["policy/advantage_mean"] = masked_mean(adv, mask).item()
    return adv, run_pg


def _correction_weights(
    algo: AlgoConfig,
    tensors: Mapping[str, Any],
    adv: Tensor,
    old: Tensor,
    mask: Tensor,
    dtype: torch.dtype,
    correction_fn: CorrectionFn | str | None,
    metrics: dict[str, float],
) -> Tensor | None:
    """Off-policy correction weights `[B, T]` (None when no correction is asked), plus the mismatch metrics."""
    rollout = tensors.get("rollout_logprobs")
    if rollout is not None:
        metrics.update(mismatch_metrics(old, rollout, mask))
    if correction_fn is None and algo.correction == "none":
        return None
    corr = _resolve(correction_fn, CORRECTIONS, algo.correction, "algo.correction")(
        algo, {**tensors, "advantages": adv, "mask": mask}
    )
    metrics.update(corr.metrics)
    return corr.weights.detach().to(dtype)


def _add_other_terms(
    algo: AlgoConfig,
    tensors: Mapping[str, Any],
    lp: Tensor,
    mask: Tensor,
    weights: Tensor | None,
    reduce: Callable[[Tensor], Tensor],
    metrics: dict[str, float],
    total: Tensor,
) -> Tensor:
    """`total` plus the KL, entropy, reverse-KL distillation and value terms, added in that order.

    The order is part of the contract: floating-point sums in another order would change the loss bits.
    """
    ref = tensors.get("ref_logprobs")
    if ref is not None:
        kl_tokens = kl_estimate(lp, ref.detach(), algo.kl_type)
        metrics["policy/kl_ref"] = masked_mean(kl_tokens.detach(), mask).item()
        if algo.kl_coef and not algo.kl_in_reward:
            loss_kl = reduce(kl_tokens)
            metrics["loss/kl"] = loss_kl.item()
            total = total + algo.kl_coef * loss_kl

    entropy = tensors.get("entropy")
    if entropy is not None:
        loss_ent = reduce(entropy)
        metrics["loss/entropy"] = loss_ent.item()
        metrics["policy/entropy"] = masked_mean(entropy.detach(), mask).item()
        if algo.entropy_coef:
            total = total - algo.entropy_coef * loss_ent

    if algo.name == "distill" and algo.distill_mode == "reverse_kl":
        rkl = reverse_kl_loss(lp, tensors["teacher_logprobs"])
        loss_rkl = reduce(rkl if weights is None else rkl * weights)
        metrics["loss/distill"] = loss_rkl.item()
        total = total + algo.distill_coef * loss_rkl

    values, returns = tensors.get("values"), tensors.get("returns")
    if values is not None and returns is not None:
        old_values = tensors.get("old_values")
        old_values = values.detach() if old_values is None else old_values
        v_tokens, v_metrics = value_loss(values, old_values, returns, mask, algo.value_clip)
        loss_v = reduce(v_tokens)
        metrics.update(v_metrics)
        metrics["loss/value"] = loss_v.item()
        total = total + algo.vf_coef * loss_v
    return total


def _scalar(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item()) if isinstance(x, Tensor) else float(x)
