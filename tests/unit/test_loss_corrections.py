"""TIS, MIS (token / sequence / geometric, truncate / mask), IcePop, OPSM, ESS and mismatch metrics
against references computed with Python floats."""

import math

import pytest
import torch

from furlong.train.losses.corrections import ess_ratio, icepop, mis, mismatch_metrics, opsm, tis

OLD = [[-0.5, -1.0, -2.0, -0.1], [-0.3, -0.3, -9.0, -0.2], [-1.0, -1.0, -1.0, -1.0]]
ROLL = [[-0.6, -0.2, -2.1, 5.0], [-0.3, -1.5, -0.5, -0.2], [-1.1, -0.95, -1.0, -0.9]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1]]  # padding in row 0, a tool token in row 1


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def ref_log_rho(level):
    out = []
    for o, r, m in zip(OLD, ROLL, MASK):
        toks = [o[t] - r[t] if m[t] else 0.0 for t in range(4)]
        if level == "token":
            out.append(toks)
        else:
            s = sum(toks)
            s = s / sum(m) if level == "geometric" else s
            out.append([s] * 4)
    return out


def ref_weights(level, mode, low, high):
    w = []
    for row, m in zip(ref_log_rho(level), MASK):
        out = []
        for lr, mt in zip(row, m):
            rho = math.exp(lr)
            if not mt:
                out.append(0.0)
            elif mode == "truncate":
                out.append(min(max(rho, low), high))
            else:
                out.append(rho if low <= rho <= high else 0.0)
        w.append(out)
    return w


def ref_ess(w, mask):
    vals = [w[i][t] for i in range(len(w)) for t in range(len(w[0])) if mask[i][t]]
    return sum(vals) ** 2 / (len(vals) * sum(v * v for v in vals))


def assert_rows(got, want):
    for g, w in zip(got.tolist(), want):
        assert g == pytest.approx(w, abs=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_tis_truncates_from_above_only(level):
    c = tis(_t(OLD), _t(ROLL), _t(MASK), cap=1.5, level=level)
    assert_rows(c.weights, ref_weights(level, "truncate", 0.0, 1.5))
    assert c.metrics["correction/ess_ratio"] == pytest.approx(ref_ess(ref_weights(level, "truncate", 0.0, 1.5), MASK))
    assert c.metrics["correction/low_frac"] == 0.0
    assert c.metrics["correction/keep_frac"] == 1.0


def test_tis_token_values_by_hand():
    # row 1 token 1: rho = exp(-0.3 + 1.5) = exp(1.2) = 3.32 -> truncated to 2
    c = tis(_t(OLD), _t(ROLL), _t(MASK), cap=2.0)
    assert c.weights[1, 1].item() == pytest.approx(2.0)
    assert c.weights[0, 1].item() == pytest.approx(math.exp(-0.8))
    assert c.weights[1, 2].item() == 0.0  # tool token: never weighted
    assert c.metrics["correction/high_frac"] == pytest.approx(1 / 10)
    assert not c.weights.requires_grad


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_mis(level, mode):
    c = mis(_t(OLD), _t(ROLL), _t(MASK), level, mode, 0.8, 1.2)
    want = ref_weights(level, mode, 0.8, 1.2)
    assert_rows(c.weights, want)
    kept = [want[i][t] > 0 for i in range(3) for t in range(4) if MASK[i][t]]
    assert c.metrics["correction/keep_frac"] == pytest.approx(sum(kept) / len(kept))
    assert c.metrics["correction/ess_ratio"] == pytest.approx(ref_ess(want, MASK))
    rho = [math.exp(x) for i, row in enumerate(ref_log_rho(level)) for t, x in enumerate(row) if MASK[i][t]]
    assert c.metrics["correction/low_frac"] == pytest.approx(sum(r < 0.8 for r in rho) / len(rho))
    assert c.metrics["correction/high_frac"] == pytest.approx(sum(r > 1.2 for r in rho) / len(rho))


def test_mis_sequence_mask_drops_whole_sequences():
    c = mis(_t(OLD), _t(ROLL), _t(MASK), "sequence", "mask", 0.8, 1.2)
    # row 0: sum log rho = 0.1 - 0.8 + 0.1 = -0.6 -> rho 0.55: dropped; row 2: 0.1 - 0.05 + 0 - 0.1 -> kept
    assert c.weights[0].abs().sum() == 0
    assert (c.weights[2] > 0).all()


def test_mis_rejects_bad_bounds_and_modes():
    with pytest.raises(ValueError, match="correction_low"):
        mis(_t(OLD), _t(ROLL), _t(MASK), "token", "mask", 2.0, 1.0)
    with pytest.raises(ValueError, match="correction_mode"):
        mis(_t(OLD), _t(ROLL), _t(MASK), "token", "clip", 0.5, 2.0)
    with pytest.raises(ValueError, match="correction_level"):
        mis(_t(OLD), _t(ROLL), _t(MASK), "chunk", "mask", 0.5, 2.0)


def test_icepop_masks_tokens_outside_band_and_keeps_is_weight_inside():
    c = icepop(_t(OLD), _t(ROLL), _t(MASK), 0.5, 2.0)
    want = []
    for o, r, m in zip(OLD, ROLL, MASK):
        row = []
        for t in range(4):
            k = math.exp(o[t] - r[t])
            row.append(k if m[t] and 0.5 <= k <= 2.0 else 0.0)
        want.append(row)
    assert_rows(c.weights, want)
    # exp(-0.8) = 0.449 (row 0) and exp(1.2) = 3.32 (row 1) are popped; the rest kept
    assert c.metrics["correction/keep_frac"] == pytest.approx(8 / 10)


def test_opsm():
    cur = [[-0.5, -1.0, -2.0, 0.0], [-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]]
    sampling = [[-0.4, -0.9, -1.9, 0.0], [-0.3, -0.2, -0.1, -0.2], [-1.0, -1.0, -1.0, -1.0]]
    adv = [[-1.0, -1.0, -1.0, 0.0], [-1.0, 0.5, 0.0, -1.0], [-2.0, -2.0, -2.0, -2.0]]
    delta = 0.5
    c = opsm(_t(cur), _t(sampling), _t(adv), _t(MASK), delta)
    want = []
    for i in range(3):
        ts = [t for t in range(4) if MASK[i][t]]
        kl = sum(sampling[i][t] - cur[i][t] for t in ts) / len(ts)
        want.append([0.0 if not MASK[i][t] else (0.0 if adv[i][t] < 0 and kl > delta else 1.0) for t in range(4)])
    assert_rows(c.weights, want)
    # row 0: kl = 0.1 < delta, kept; row 1: kl ~0.77 > delta, its negative-advantage tokens (0 and 3)
    # dropped, the positive one kept; row 2: kl = 0 kept
    assert want[1] == [0.0, 1.0, 0.0, 0.0]
    assert c.metrics["correction/opsm_seq_frac"] == pytest.approx(1 / 3)
    assert c.metrics["correction/keep_frac"] == pytest.approx(8 / 10)


def test_ess_ratio():
    assert ess_ratio(_t([[1.0, 1.0, 1.0]]), _t([[1, 1, 1]])) == pytest.approx(1.0)
    assert ess_ratio(_t([[3.0, 0.0, 0.0, 9.0]]), _t([[1, 1, 1, 0]])) == pytest.approx(1 / 3)
    assert ess_ratio(_t([[0.0]]), _t([[1]])) == 0.0


def test_mismatch_metrics():
    m = mismatch_metrics(_t(OLD), _t(ROLL), _t(MASK))
    pairs = [(OLD[i][t], ROLL[i][t]) for i in range(3) for t in range(4) if MASK[i][t]]
    assert m["mismatch/logprob_abs_diff"] == pytest.approx(sum(abs(o - r) for o, r in pairs) / len(pairs))
    k3 = [math.exp(o - r) - 1 - (o - r) for o, r in pairs]
    assert m["mismatch/kl"] == pytest.approx(sum(k3) / len(k3))
    w = [[math.exp(OLD[i][t] - ROLL[i][t]) for t in range(4)] for i in range(3)]
    assert m["mismatch/ess_ratio"] == pytest.approx(ref_ess(w, MASK))
