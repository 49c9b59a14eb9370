"""KL estimators (k1, k2, k3) and token entropy against their formulas and Monte-Carlo truth."""

import math

import pytest
import torch

from furlong.train.losses.kl import kl_estimate, token_entropy

LP = [[-0.5, -1.2, -3.0], [-0.1, -2.5, -0.7]]
REF = [[-0.7, -1.0, -1.0], [-0.1, -4.0, -0.2]]


def ref_kl(lp, ref, kind):
    out = []
    for a_row, b_row in zip(lp, ref):
        row = []
        for a, b in zip(a_row, b_row):
            x = a - b
            row.append({"k1": x, "k2": x * x / 2, "k3": math.exp(-x) - 1 + x}[kind])
        out.append(row)
    return out


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_estimators_match_formulas(kind):
    got = kl_estimate(torch.tensor(LP, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64), kind)
    for g_row, r_row in zip(got.tolist(), ref_kl(LP, REF, kind)):
        assert g_row == pytest.approx(r_row, abs=1e-12)


def test_unknown_estimator_names_the_field():
    with pytest.raises(ValueError, match="algo.kl_type"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_k1_and_k3_are_unbiased_k3_nonnegative():
    """On samples y ~ p, mean(k1) and mean(k3) approach KL(p || q); k3 is never negative."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    true_kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    y = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    lp, lq = p.log()[y][None], q.log()[y][None]
    k1, k3 = kl_estimate(lp, lq, "k1"), kl_estimate(lp, lq, "k3")
    assert k1.mean().item() == pytest.approx(true_kl, abs=0.01)
    assert k3.mean().item() == pytest.approx(true_kl, abs=0.01)
    assert (k3 >= 0).all()
    assert k3.var().item() < k1.var().item()  # the point of k3


def test_k2_gradient_is_the_score_function_gradient():
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(REF, dtype=torch.float64)
    kl_estimate(lp, ref, "k2").sum().backward()
    assert torch.allclose(lp.grad, lp.detach() - ref)


def test_token_entropy_matches_hand_sum():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    got = token_entropy(logits).tolist()
    for row, h in zip(logits.tolist(), got):
        z = sum(math.exp(v) for v in row)
        probs = [math.exp(v) / z for v in row]
        assert h == pytest.approx(-sum(pi * math.log(pi) for pi in probs), abs=1e-6)
    assert got[1] == pytest.approx(math.log(3), abs=1e-6)
