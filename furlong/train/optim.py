"""AdamW and learning-rate schedules.

The schedule is a pure function of the step (`lr_factor`) so it can be tested by
hand and so a resumed run only needs the scheduler's step counter back: the
function itself is rebuilt from the config, never pickled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from furlong.config.schema import TrainConfig

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base lr for optimiser step `step` (0-based).

    Linear warm-up `(step+1)/warmup_steps` for the first `warmup_steps` steps, then
    `constant` 1; `cosine` 0.5·(1+cos(π·p)); `linear` 1−p, with
    p = (step − warmup_steps)/(total_steps − warmup_steps) clipped to [0, 1].
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"train.lr_schedule: unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    if schedule != "constant" and total_steps <= warmup_steps:
        raise ValueError(
            f"train.total_steps={total_steps} must exceed train.warmup_steps={warmup_steps} "
            f"for lr_schedule={schedule!r}"
        )
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    p = min(1.0, max(0.0, (step - warmup_steps) / (total_steps - warmup_steps)))
    return 0.5 * (1.0 + math.cos(math.pi * p)) if schedule == "cosine" else 1.0 - p


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: TrainConfig, lr: float | None = None
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; `lr` overrides `cfg.lr` (the critic's own lr).

    The fused kernel where torch has one for the parameters' device and dtype (CPU and CUDA in
    torch 2.13): one pass over each tensor instead of ~10 elementwise ops, ≈ 5.7x faster on the
    m25 model on CPU, equal to the plain loop within 1e-6 (tests/unit/test_train_fastpath.py).
    Elsewhere the multi-tensor `foreach` form.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("optimiser: the model has no trainable parameters")
    kw = dict(lr=cfg.lr if lr is None else lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except RuntimeError:  # "`fused=True` requires all the params to be floating point Tensors of supported devices"
        return torch.optim.AdamW(params, foreach=True, **kw)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    lr_factor(0, cfg.lr_schedule, cfg.warmup_steps, cfg.total_steps)  # fail at start, naming the field
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.lr_schedule, cfg.warmup_steps, cfg.total_steps)
    )
