"""Each estimator logs metrics under its own name, so a run's metrics say which one ran."""

from types import SimpleNamespace

import pytest
import torch

from furlong.train.losses import advantage_metrics, compute_advantages
from furlong.train.losses.policy import ppo_clip_loss, sequence_ratio_metrics


def _algo(**kw):
    base = dict(
        advantage="grpo",
        norm_adv_by_std=True,
        gamma=1.0,
        lam=0.95,
        kl_coef=0.0,
        kl_in_reward=False,
        ratio_type="token",
        log_ratio_clamp=20.0,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip_c=None,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_advantage_metrics_name_the_estimator(name):
    algo = _algo(advantage=name, norm_adv_by_std=name != "dr_grpo")
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    adv, ret = compute_advantages(algo, rewards, torch.tensor([0, 0, 1, 1]), mask)
    m = advantage_metrics(algo, adv, ret, mask)
    assert set(m) >= {f"advantage/{name}/abs_mean", f"advantage/{name}/std"}
    assert all(k.startswith(f"advantage/{name}/") for k in m)
    assert (f"advantage/{name}/returns_mean" in m) == (ret is not None)
    assert m[f"advantage/{name}/abs_mean"] == pytest.approx(float((adv.abs() * mask).sum() / mask.sum()))


def test_sequence_ratio_metrics_only_for_sequence_ratios():
    lp = torch.tensor([[-1.0, -1.0], [-2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.9], [-2.0, -0.5]])
    mask = torch.ones(2, 2)
    adv = torch.ones(2, 2)
    _, token = ppo_clip_loss(_algo(), lp, old, adv, mask)
    assert "policy/seq_ratio_mean" not in token
    _, seq = ppo_clip_loss(_algo(ratio_type="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4), lp, old, adv, mask)
    # row 0: mean log ratio (0.1 - 0.1) / 2 = 0 -> s = 1, inside; row 1: 0 -> s = 1
    assert seq["policy/seq_ratio_mean"] == pytest.approx(1.0)
    assert seq["policy/seq_clip_frac"] == 0.0
    m = sequence_ratio_metrics(torch.tensor([[0.01, 0.01], [0.0, 0.0]]), mask, 3e-4, 4e-4)
    assert m["policy/seq_clip_frac"] == pytest.approx(0.5)
    assert m["policy/seq_ratio_max"] == pytest.approx(float(torch.exp(torch.tensor(0.01))))
