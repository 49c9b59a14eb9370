"""PPO clip (asymmetric, dual), token and sequence (GSPO) ratios, value loss: references and gradients."""

import math

import pytest
import torch

from furlong.train.losses.policy import log_ratio, ppo_clip, value_loss
from furlong.train.losses.reducers import sample_mean, token_mean

EPS_LOW, EPS_HIGH, DUAL_C = 0.2, 0.28, 3.0


def ref_ppo_token(r, a, dual_c=None):
    clipped = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
    loss = max(-a * r, -a * clipped)
    if dual_c is not None and a < 0:
        loss = min(loss, -dual_c * a)
    return loss


def ref_ppo_grad_wrt_logprob(r, a, dual_c=None):
    """d loss / d log pi: -A r where the unclipped branch is active, 0 where clipped."""
    if a > 0 and r > 1 + EPS_HIGH:
        return 0.0
    if a < 0 and r < 1 - EPS_LOW:
        return 0.0
    if dual_c is not None and a < 0 and r > dual_c:
        return 0.0
    return -a * r


# each column exercises one region: inside, high-clipped, low-clipped, dual-clipped, inside (A<0, r>1), padding
RATIOS = [[1.05, 1.5, 0.5, 4.0, 1.2, 0.3]]
ADVS = [[1.0, 2.0, -1.0, -0.5, -2.0, 1.0]]
MASK = [[1, 1, 1, 1, 1, 0]]


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("dual", [None, DUAL_C])
def test_ppo_clip_values_gradients_and_fractions(dual):
    old = _t([[-1.0] * 6])
    lp = (old + _t(RATIOS).log()).requires_grad_(True)
    loss, m = ppo_clip(lp - old, _t(ADVS), _t(MASK), EPS_LOW, EPS_HIGH, dual)
    for t in range(6):
        assert loss[0, t].item() == pytest.approx(ref_ppo_token(RATIOS[0][t], ADVS[0][t], dual), abs=1e-12)
    (loss * _t(MASK)).sum().backward()
    for t in range(5):
        assert lp.grad[0, t].item() == pytest.approx(
            ref_ppo_grad_wrt_logprob(RATIOS[0][t], ADVS[0][t], dual), abs=1e-12
        )
    assert m["policy/clip_frac_high"] == pytest.approx(1 / 5)
    assert m["policy/clip_frac_low"] == pytest.approx(1 / 5)
    assert m["policy/clip_frac"] == pytest.approx(2 / 5)
    assert m["policy/clip_frac_dual"] == pytest.approx(1 / 5 if dual else 0.0)
    assert m["policy/ratio_mean"] == pytest.approx(sum(RATIOS[0][:5]) / 5)
    assert m["policy/ratio_max"] == pytest.approx(4.0)  # the padded 0.3 (and anything there) is ignored


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip(_t([[0.0]]), _t([[1.0]]), _t([[1]]), 0.2, 0.2, 1.0)


def test_gradcheck_away_from_kinks():
    old = _t([[-1.0] * 6])
    adv, mask = _t(ADVS), _t(MASK)
    lp = (old + _t(RATIOS).log()).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: token_mean(ppo_clip(x - old, adv, mask, EPS_LOW, EPS_HIGH, DUAL_C)[0], mask), (lp,)
    )


@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
def test_extreme_padding_values_do_not_poison_gradients(ratio_type):
    lp = torch.tensor([[-0.5, 0.0]], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[-0.4, -200.0]])  # padding: exp(200) overflows float32
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = ppo_clip(log_ratio(lp, old, mask, ratio_type, None), torch.tensor([[1.0, 1.0]]), mask, 0.2, 0.2)
    token_mean(loss, mask).backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 0].item() == pytest.approx(-math.exp(-0.1), rel=1e-6)
    assert lp.grad[0, 1].item() == 0.0


def test_log_ratio_clamp():
    lp, old, m = _t([[0.0, 0.0]]), _t([[-30.0, 25.0]]), _t([[1, 1]])
    assert log_ratio(lp, old, m, "token", 20.0).tolist() == [[20.0, -20.0]]
    assert log_ratio(lp, old, m, "token", None).tolist() == [[30.0, -25.0]]
    with pytest.raises(ValueError, match="algo.ratio_type"):
        log_ratio(lp, old, m, "chunk")


# ragged sequences for GSPO
LP = [[-0.3, -1.1, -0.7, -2.0], [-0.9, -0.2, -5.0, -5.0], [-1.5, -0.4, -0.6, -0.1]]
OLD = [[-0.35, -1.0, -0.9, -2.0], [-0.7, -0.25, 0.0, 0.0], [-1.2, -0.5, -0.4, -0.3]]
SEQ_MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1]]
SEQ_ADV = [1.0, -1.0, 0.5]


def ref_seq_ratio(i):
    ts = [t for t in range(4) if SEQ_MASK[i][t]]
    return math.exp(sum(LP[i][t] - OLD[i][t] for t in ts) / len(ts))


def test_sequence_ratio_is_geometric_mean_of_token_ratios():
    lr = log_ratio(_t(LP), _t(OLD), _t(SEQ_MASK), "sequence")
    for i in range(3):
        for t in range(4):
            if SEQ_MASK[i][t]:
                assert math.exp(lr[i, t].item()) == pytest.approx(ref_seq_ratio(i), abs=1e-12)


@pytest.mark.parametrize("reducer", [token_mean, sample_mean])
def test_gspo_token_form_gradient_equals_sequence_objective(reducer):
    """With a per-sequence advantage, the token form's gradient equals that of the pure sequence
    objective  sum_i w_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(lp - old)),
    where w_i = |y_i| / N (token_mean) or 1/S (sample_mean)."""
    mask = _t(SEQ_MASK)
    adv = _t([[a] * 4 for a in SEQ_ADV]) * mask
    lp = _t(LP).requires_grad_(True)
    old = _t(OLD)
    tok_loss, _ = ppo_clip(log_ratio(lp, old, mask, "sequence"), adv, mask, 0.0003, 0.0004)
    reducer(tok_loss, mask).backward()

    lp2 = _t(LP).requires_grad_(True)
    n_tok = mask.sum()
    total = 0
    for i in range(3):
        m = mask[i]
        s = torch.exp(((lp2[i] - old[i]) * m).sum() / m.sum())
        a = SEQ_ADV[i]
        seq_loss = torch.maximum(-a * s, -a * s.clamp(1 - 0.0003, 1 + 0.0004))
        total = total + seq_loss * (m.sum() / n_tok if reducer is token_mean else 1 / 3)
    total.backward()
    assert torch.allclose(lp.grad, lp2.grad, atol=1e-12)
    assert lp.grad.abs().sum() > 0


def test_gspo_clips_whole_sequences():
    mask = _t(SEQ_MASK)
    adv = _t([[a] * 4 for a in SEQ_ADV]) * mask
    _, m = ppo_clip(log_ratio(_t(LP), _t(OLD), mask, "sequence"), adv, mask, 0.1, 0.1)
    # s_0 = exp(0.15/3) ~ 1.051, s_1 = exp(-0.15/2) ~ 0.928, s_2 = exp(-0.3/3) ~ 0.905: all inside
    assert m["policy/clip_frac"] == 0.0
    _, m = ppo_clip(log_ratio(_t(LP), _t(OLD), mask, "sequence"), adv, mask, 0.05, 0.05)
    # now s_0 (A>0, r>1.05) is high-clipped: 3 tokens of 8; s_1 (A<0, r<0.95) low-clipped: 2 of 8;
    # s_2 has A>0 and r<1: not clipped
    assert m["policy/clip_frac_high"] == pytest.approx(3 / 8)
    assert m["policy/clip_frac_low"] == pytest.approx(2 / 8)


def ref_value(v, vo, r, c):
    unclipped = (v - r) ** 2
    if not c:
        return 0.5 * unclipped, False
    vc = vo + min(max(v - vo, -c), c)
    return 0.5 * max(unclipped, (vc - r) ** 2), (vc - r) ** 2 > unclipped


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss(clip):
    v, vo, r = [[1.0, 0.5, -0.3, 2.0]], [[0.5, 0.45, 0.2, 0.0]], [[2.0, 0.0, -1.0, 9.0]]
    mask = [[1, 1, 1, 0]]
    vt = _t(v).requires_grad_(True)
    loss, m = value_loss(vt, _t(vo), _t(r), _t(mask), clip)
    refs = [ref_value(v[0][t], vo[0][t], r[0][t], clip) for t in range(4)]
    assert loss[0].tolist() == pytest.approx([x for x, _ in refs], abs=1e-12)
    assert m["value/clip_frac"] == pytest.approx(sum(c for _, c in refs[:3]) / 3)
    assert m["value/return_mean"] == pytest.approx((2.0 + 0.0 - 1.0) / 3)
    if clip:
        assert m["value/clip_frac"] > 0  # the data is built to hit the clipped branch
        assert torch.autograd.gradcheck(lambda x: value_loss(x, _t(vo), _t(r), _t(mask), clip)[0].sum(), (vt,))
