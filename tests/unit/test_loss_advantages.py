"""Advantage estimators against references written as plain Python loops over floats."""

import math
from types import SimpleNamespace

import pytest
import torch

from furlong.train.losses import compute_advantages
from furlong.train.losses.advantages import gae, grpo_advantages, rloo_advantages

# 7 samples in 3 groups (one a singleton), ragged lengths, a tool span mid-trajectory in sample 1.
REWARDS = [1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 0.25]
GROUPS = [0, 0, 0, 5, 5, 5, 9]
MASK = [
    [1, 1, 1, 0, 0],
    [1, 0, 0, 1, 1],
    [1, 1, 1, 1, 1],
    [1, 1, 0, 0, 0],
    [1, 1, 1, 1, 0],
    [0, 1, 1, 1, 0],  # leading template token
    [1, 1, 0, 0, 0],
]
VALUES = [[0.1 * (i + 1) + 0.03 * t for t in range(5)] for i in range(7)]
KL = [[0.01 * ((i + 2 * t) % 5) - 0.01 for t in range(5)] for i in range(7)]


def algo(**kw):
    base = dict(
        advantage="grpo",
        norm_adv_by_std=True,
        gamma=1.0,
        lam=1.0,
        kl_coef=0.0,
        kl_in_reward=False,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def _t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


# ----------------------------------------------------------------- references
def ref_groups(groups):
    out = {}
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def ref_grpo(rewards, groups, std, eps=1e-6):
    adv = [0.0] * len(rewards)
    for members in ref_groups(groups).values():
        xs = [rewards[i] for i in members]
        n = len(xs)
        mean = sum(xs) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
        for i in members:
            adv[i] = (rewards[i] - mean) / (sd + eps) if std else rewards[i] - mean
    return adv


def ref_rloo(rewards, groups):
    adv = [0.0] * len(rewards)
    for members in ref_groups(groups).values():
        for i in members:
            others = [rewards[j] for j in members if j != i]
            adv[i] = rewards[i] - sum(others) / len(others) if others else 0.0
    return adv


def ref_broadcast(per_sample, mask):
    return [[per_sample[i] if m else 0.0 for m in row] for i, row in enumerate(mask)]


def ref_token_rewards(rewards, mask, kl, coef):
    out = []
    for i, row in enumerate(mask):
        steps = [t for t, m in enumerate(row) if m]
        r = [0.0] * len(row)
        for t in steps:
            r[t] = (rewards[i] if t == steps[-1] else 0.0) - (coef * kl[i][t] if kl else 0.0)
        out.append(r)
    return out


def ref_returns(tok_r, mask, gamma):
    out = []
    for r_row, m_row in zip(tok_r, mask):
        g, row = 0.0, [0.0] * len(r_row)
        for t in reversed([t for t, m in enumerate(m_row) if m]):
            g = r_row[t] + gamma * g
            row[t] = g
        out.append(row)
    return out


def ref_whiten(x, mask, scale=True, eps=1e-6):
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[0])) if mask[i][t]]
    mean = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    div = (sd + eps) if scale else 1.0
    return [[(x[i][t] - mean) / div if mask[i][t] else 0.0 for t in range(len(x[0]))] for i in range(len(x))]


def ref_gae(tok_r, values, mask, gamma, lam):
    adv_out, ret_out = [], []
    for r_row, v_row, m_row in zip(tok_r, values, mask):
        steps = [t for t, m in enumerate(m_row) if m]
        adv, ret = [0.0] * len(r_row), [0.0] * len(r_row)
        a_next, v_next = 0.0, 0.0
        for t in reversed(steps):
            delta = r_row[t] + gamma * v_next - v_row[t]
            a_next = delta + gamma * lam * a_next
            v_next = v_row[t]
            adv[t], ret[t] = a_next, a_next + v_row[t]
        adv_out.append(adv)
        ret_out.append(ret)
    return adv_out, ret_out


def assert_close(got, want, tol=1e-9):
    got = got.tolist()
    for g_row, w_row in zip(got, want):
        assert g_row == pytest.approx(w_row, abs=tol)


# ----------------------------------------------------------------- tests
@pytest.mark.parametrize("std", [True, False])
def test_grpo(std):
    got = grpo_advantages(_t(REWARDS), torch.tensor(GROUPS), norm_by_std=std)
    assert got.tolist() == pytest.approx(ref_grpo(REWARDS, GROUPS, std), abs=1e-9)
    assert got[6].item() == 0.0  # singleton group: no baseline, no signal


def test_grpo_identical_rewards_give_zero_not_nan():
    got = grpo_advantages(_t([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert got.tolist() == [0.0, 0.0, 0.0]


def test_rloo():
    got = rloo_advantages(_t(REWARDS), torch.tensor(GROUPS))
    assert got.tolist() == pytest.approx(ref_rloo(REWARDS, GROUPS), abs=1e-12)


@pytest.mark.parametrize(
    "name,std,expect",
    [
        ("grpo", True, lambda: ref_grpo(REWARDS, GROUPS, True)),
        ("grpo", False, lambda: ref_grpo(REWARDS, GROUPS, False)),
        ("dr_grpo", True, lambda: ref_grpo(REWARDS, GROUPS, False)),  # Dr.GRPO never divides by std
        ("rloo", True, lambda: ref_rloo(REWARDS, GROUPS)),
    ],
)
def test_outcome_estimators_broadcast_over_mask(name, std, expect):
    adv, ret = compute_advantages(
        algo(advantage=name, norm_adv_by_std=std), _t(REWARDS), torch.tensor(GROUPS), _t(MASK)
    )
    assert ret is None
    assert_close(adv, ref_broadcast(expect(), MASK))


def test_outcome_estimators_fold_sequence_kl_into_reward():
    a = algo(advantage="dr_grpo", kl_in_reward=True, kl_coef=0.5)
    adv, _ = compute_advantages(a, _t(REWARDS), torch.tensor(GROUPS), _t(MASK), kl=_t(KL))
    shaped = [REWARDS[i] - 0.5 * sum(KL[i][t] for t in range(5) if MASK[i][t]) for i in range(7)]
    assert_close(adv, ref_broadcast(ref_grpo(shaped, GROUPS, False), MASK))


@pytest.mark.parametrize("gamma,kl_in_reward,std", [(1.0, False, True), (0.9, True, True), (0.9, True, False)])
def test_reinforce_pp(gamma, kl_in_reward, std):
    a = algo(advantage="reinforce_pp", gamma=gamma, kl_in_reward=kl_in_reward, kl_coef=0.2, norm_adv_by_std=std)
    adv, ret = compute_advantages(a, _t(REWARDS), torch.tensor(GROUPS), _t(MASK), kl=_t(KL))
    want_ret = ref_returns(ref_token_rewards(REWARDS, MASK, KL if kl_in_reward else None, 0.2), MASK, gamma)
    assert_close(ret, want_ret)
    assert_close(adv, ref_whiten(want_ret, MASK, scale=std))


def test_reinforce_pp_tool_tokens_are_not_discount_steps():
    """Sample 1 has trained tokens at 0, 3, 4: with gamma, position 0 is two steps from the end, not four."""
    a = algo(advantage="reinforce_pp", gamma=0.5)
    _, ret = compute_advantages(a, _t([0.0, 8.0]), torch.tensor([0, 0]), _t([[1, 0, 0, 0, 0], MASK[1]]))
    assert ret[1].tolist() == [2.0, 0.0, 0.0, 4.0, 8.0]


def test_reinforce_pp_baseline():
    a = algo(advantage="reinforce_pp_baseline", gamma=1.0, kl_in_reward=True, kl_coef=0.1)
    adv, ret = compute_advantages(a, _t(REWARDS), torch.tensor(GROUPS), _t(MASK), kl=_t(KL))
    means = {g: sum(REWARDS[i] for i in m) / len(m) for g, m in ref_groups(GROUPS).items()}
    centred = [REWARDS[i] - means[GROUPS[i]] for i in range(7)]
    want_ret = ref_returns(ref_token_rewards(centred, MASK, KL, 0.1), MASK, 1.0)
    assert_close(ret, want_ret)
    assert_close(adv, ref_whiten(want_ret, MASK))


@pytest.mark.parametrize("gamma,lam,whiten", [(1.0, 1.0, False), (0.99, 0.95, False), (0.9, 0.8, True)])
def test_gae_over_trained_positions_only(gamma, lam, whiten):
    a = algo(advantage="gae", gamma=gamma, lam=lam, kl_in_reward=True, kl_coef=0.3, norm_adv_by_std=whiten)
    # garbage values at untrained positions must never be read
    values = [[v if MASK[i][t] else 1e6 for t, v in enumerate(row)] for i, row in enumerate(VALUES)]
    adv, ret = compute_advantages(a, _t(REWARDS), torch.tensor(GROUPS), _t(MASK), values=_t(values), kl=_t(KL))
    want_adv, want_ret = ref_gae(ref_token_rewards(REWARDS, MASK, KL, 0.3), VALUES, MASK, gamma, lam)
    assert_close(ret, want_ret)
    assert_close(adv, ref_whiten(want_adv, MASK) if whiten else want_adv)


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    tok_r = _t([[0.0, 0.0, 1.0]])
    v = _t([[0.2, 0.5, 0.7]])
    adv, ret = gae(tok_r, v, _t([[1, 1, 1]]), 1.0, 1.0)
    assert adv.tolist()[0] == pytest.approx([0.8, 0.5, 0.3])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])


def test_none_estimator_and_errors():
    adv, ret = compute_advantages(algo(advantage="none"), _t(REWARDS), torch.tensor(GROUPS), _t(MASK))
    assert adv.abs().sum() == 0 and ret is None
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(algo(advantage="gae"), _t(REWARDS), torch.tensor(GROUPS), _t(MASK))
    with pytest.raises(ValueError, match="algo.advantage='bogus'"):
        compute_advantages(algo(advantage="bogus"), _t(REWARDS), torch.tensor(GROUPS), _t(MASK))
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages(algo(), _t(REWARDS), torch.tensor(GROUPS[:3]), _t(MASK))
    with pytest.raises(ValueError, match="values has shape"):
        compute_advantages(algo(advantage="gae"), _t(REWARDS), torch.tensor(GROUPS), _t(MASK), values=_t([[0.0]]))


def test_custom_advantage_fn_plug_point():
    def const(a, rewards, group_index, mask, values, kl):
        return torch.full_like(mask, 2.0) * mask, None

    adv, _ = compute_advantages(algo(), _t(REWARDS), torch.tensor(GROUPS), _t(MASK), advantage_fn=const)
    assert adv.sum().item() == 2.0 * sum(map(sum, MASK))
