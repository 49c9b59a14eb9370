"""The loss hub: advantage estimators, policy/value/KL/SFT/distillation losses, off-policy
corrections and reducers, as pure functions; `objective` ties them to an `AlgoConfig`."""

from furlong.train.losses.advantages import ADVANTAGE_ESTIMATORS, AdvantageFn
from furlong.train.losses.corrections import CORRECTIONS, Correction, CorrectionFn
from furlong.train.losses.kl import kl_estimate, token_entropy
from furlong.train.losses.objective import advantage_metrics, compute_advantages, compute_policy_objective
from furlong.train.losses.policy import POLICY_LOSSES, LossFn
from furlong.train.losses.reducers import REDUCERS, ReducerFn
from furlong.train.losses.sft import sft_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CORRECTIONS",
    "POLICY_LOSSES",
    "REDUCERS",
    "AdvantageFn",
    "Correction",
    "CorrectionFn",
    "LossFn",
    "ReducerFn",
    "advantage_metrics",
    "compute_advantages",
    "compute_policy_objective",
    "kl_estimate",
    "sft_loss",
    "token_entropy",
]
