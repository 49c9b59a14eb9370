"""LR schedules against hand-computed values, and through a real optimiser."""

from __future__ import annotations

import math

import pytest
import torch

from furlong.config.schema import TrainConfig
from furlong.train.optim import build_optimizer, build_scheduler, lr_factor


def test_schedules_by_hand() -> None:
    # warm-up 2 of 6 steps: factors (s+1)/2 for s < 2, then decay over the 4 remaining
    assert [lr_factor(s, "constant", 2, 6) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_factor(s, "linear", 2, 6) for s in range(2, 8)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    cos = [lr_factor(s, "cosine", 2, 6) for s in range(2, 7)]
    assert cos == pytest.approx(
        [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0]
    )
    assert lr_factor(0, "cosine", 0, 10) == 1.0


def test_bad_schedule_names_the_field() -> None:
    with pytest.raises(ValueError, match="train.lr_schedule"):
        lr_factor(0, "exp", 0, 10)
    with pytest.raises(ValueError, match="train.total_steps"):
        build_scheduler(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
            TrainConfig(lr_schedule="cosine", warmup_steps=5, total_steps=5),
        )


def test_scheduler_drives_adamw_lr() -> None:
    cfg = TrainConfig(lr=0.1, lr_schedule="linear", warmup_steps=1, total_steps=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer([p], cfg)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(2)
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.1, 0.05, 0.0])
