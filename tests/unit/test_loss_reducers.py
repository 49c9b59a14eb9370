"""Reducers against hand-computed sums over Python floats; micro-batch splits; gradients."""

import math

import pytest
import torch

from furlong.train.losses.reducers import REDUCERS, constant_divisor, masked_mean, sample_mean, token_mean

VALUES = [
    [1.0, 2.0, 3.0, float("nan")],  # padding holds garbage (NaN) and must not leak
    [4.0, 0.5, -1.0, -2.0],
    [7.0, 9.0, 9.0, 9.0],  # a row that is only tool tokens: nothing trained
    [-3.0, 5.0, 1.5, 0.0],
]
MASK = [
    [1, 1, 1, 0],
    [1, 0, 1, 1],  # a tool token in the middle
    [0, 0, 0, 0],
    [1, 1, 0, 0],
]


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def ref_token_mean(v, m):
    num = sum(v[i][t] for i in range(len(v)) for t in range(len(v[0])) if m[i][t])
    return num / sum(map(sum, m))


def ref_sample_mean(v, m):
    rows = [sum(v[i][t] for t in range(len(v[0])) if m[i][t]) / sum(m[i]) for i in range(len(v)) if sum(m[i])]
    return sum(rows) / len(rows)


def ref_constant(v, m, c):
    num = sum(v[i][t] for i in range(len(v)) for t in range(len(v[0])) if m[i][t])
    return num / (len(v) * c)


def test_token_mean_matches_reference_and_ignores_padding_nan():
    got = token_mean(_t(VALUES), _t(MASK)).item()
    assert got == pytest.approx(ref_token_mean(VALUES, MASK), abs=1e-12)
    assert math.isfinite(got)


def test_sample_mean_skips_empty_rows():
    got = sample_mean(_t(VALUES), _t(MASK)).item()
    # rows: (1+2+3)/3 = 2, (4-1-2)/3 = 1/3, (-3+5)/2 = 1 -> (2 + 1/3 + 1) / 3
    assert got == pytest.approx((2 + 1 / 3 + 1) / 3, abs=1e-12)
    assert got == pytest.approx(ref_sample_mean(VALUES, MASK), abs=1e-12)


@pytest.mark.parametrize("c", [None, 10.0])
def test_constant_divisor(c):
    got = constant_divisor(_t(VALUES), _t(MASK), constant=c).item()
    assert got == pytest.approx(ref_constant(VALUES, MASK, c if c is not None else 4), abs=1e-12)


def test_constant_divisor_rejects_nonpositive_constant():
    with pytest.raises(ValueError, match="reducer_constant"):
        constant_divisor(_t(VALUES), _t(MASK), constant=0.0)


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(_t([[1.0, 2.0]]), _t([[0, 0]])).item() == 0.0


@pytest.mark.parametrize("name", sorted(REDUCERS))
def test_micro_batches_with_global_counts_sum_to_the_full_batch(name):
    """Each micro-batch reduced with the global counts is its exact share of the global loss."""
    v, m = _t(VALUES).nan_to_num(0.0), _t(MASK)
    fn = REDUCERS[name]
    full = fn(v, m, constant=6.0)
    totals = dict(total_tokens=m.sum().item(), total_samples=3.0 if name == "sample_mean" else 4.0)
    parts = fn(v[:1], m[:1], constant=6.0, **totals) + fn(v[1:], m[1:], constant=6.0, **totals)
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)


@pytest.mark.parametrize("name", sorted(REDUCERS))
def test_reducer_gradients(name):
    v = _t(VALUES).nan_to_num(0.0).requires_grad_(True)
    m = _t(MASK)
    assert torch.autograd.gradcheck(lambda x: REDUCERS[name](x, m, constant=5.0), (v,))
    REDUCERS[name](v, m, constant=5.0).backward()
    # d L / d l_{i,t}: token_mean 1/N, sample_mean 1/(S |y_i|), constant 1/(B C); zero where masked
    g = v.grad
    assert g[2].abs().sum() == 0 and g[0, 3] == 0 and g[1, 1] == 0
    expected = {"token_mean": 1 / 8, "sample_mean": 1 / (3 * 3), "constant": 1 / (4 * 5.0)}[name]
    assert g[0, 0].item() == pytest.approx(expected)
