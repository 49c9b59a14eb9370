"""compute_policy_objective end to end against totals assembled by hand from Python floats,
plus plug points, errors, micro-batch equivalence and the docs listing every metric."""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from furlong.train.losses import compute_advantages, compute_policy_objective
from furlong.train.losses.corrections import Correction

DOCS = Path(__file__).resolve().parents[2] / "docs" / "algorithms"


def algo(**kw):
    base = dict(
        name="grpo",
        advantage="grpo",
        norm_adv_by_std=True,
        gamma=1.0,
        lam=1.0,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip_c=3.0,
        ratio_type="token",
        log_ratio_clamp=20.0,
        kl_coef=0.0,
        kl_type="k3",
        kl_in_reward=False,
        entropy_coef=0.0,
        loss_reducer="token_mean",
        reducer_constant=None,
        correction="none",
        correction_level="token",
        correction_mode="truncate",
        correction_low=0.5,
        correction_high=2.0,
        vf_coef=0.5,
        value_clip=0.2,
        distill_mode="advantage",
        distill_coef=1.0,
    )
    base.update(kw)
    return SimpleNamespace(**base)


LP = [[-0.5, -1.0, -2.0, -0.7], [-0.3, -0.9, -1.2, -0.1], [-1.0, -0.2, -0.6, -2.5]]
OLD = [[-0.6, -0.7, -2.0, -0.7], [-0.3, -1.3, -1.0, 3.0], [-0.5, -0.3, -0.6, -2.0]]
ROLL = [[-0.6, -0.9, -1.5, -0.7], [-0.2, -1.3, -1.0, 0.0], [-0.5, -1.4, -0.7, -2.1]]
REF = [[-0.4, -1.2, -2.2, -0.7], [-0.5, -0.8, -1.0, 0.0], [-1.1, -0.25, -0.5, -2.0]]
ENT = [[1.2, 0.8, 0.5, 9.0], [0.3, 0.4, 0.9, 9.0], [1.5, 1.1, 0.7, 0.2]]
ADV = [[1.0, 1.0, 1.0, 0.0], [-0.5, -0.5, -0.5, 0.0], [-1.0, -1.0, -1.0, -1.0]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 1, 1]]  # padding and a tool token
TEACHER = [[-0.2, -2.0, -1.0, 0.0], [-0.1, -0.5, -3.0, 0.0], [-2.0, -0.1, -0.3, -1.0]]


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def tensors(**extra):
    out = dict(logprobs=_t(LP).requires_grad_(True), old_logprobs=_t(OLD), mask=_t(MASK), advantages=_t(ADV))
    out.update(extra)
    return out


def cells():
    return [(i, t) for i in range(3) for t in range(4) if MASK[i][t]]


def ref_clip(r, a, lo=0.2, hi=0.28, c=3.0):
    loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    return min(loss, -c * a) if (c is not None and a < 0) else loss


def ref_k3(x):
    return math.exp(-x) - 1 + x


# ------------------------------------------------------------------ totals by hand
def test_grpo_with_tis_kl_and_entropy():
    a = algo(kl_coef=0.1, entropy_coef=0.01, correction="tis", correction_high=1.5)
    loss, m = compute_policy_objective(a, tensors(rollout_logprobs=_t(ROLL), ref_logprobs=_t(REF), entropy=_t(ENT)))
    n = len(cells())
    pg = (
        sum(
            min(math.exp(OLD[i][t] - ROLL[i][t]), 1.5) * ref_clip(math.exp(LP[i][t] - OLD[i][t]), ADV[i][t])
            for i, t in cells()
        )
        / n
    )
    kl = sum(ref_k3(LP[i][t] - REF[i][t]) for i, t in cells()) / n
    ent = sum(ENT[i][t] for i, t in cells()) / n
    assert m["loss/policy"] == pytest.approx(pg, abs=1e-12)
    assert m["loss/kl"] == pytest.approx(kl, abs=1e-12)
    assert m["loss/entropy"] == pytest.approx(ent, abs=1e-12)
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * ent, abs=1e-12)
    assert m["loss/total"] == pytest.approx(loss.item())
    assert m["mismatch/logprob_abs_diff"] == pytest.approx(sum(abs(OLD[i][t] - ROLL[i][t]) for i, t in cells()) / n)
    assert 0 < m["correction/ess_ratio"] <= 1


def test_gradcheck_full_objective():
    # token ratio: the sequence (GSPO-token) ratio has a designed stop-gradient gradient, which
    # test_loss_policy checks against the sequence objective instead of finite differences
    a = algo(
        kl_coef=0.1,
        entropy_coef=0.01,
        correction="mis",
        correction_mode="mask",
        correction_low=0.3,
        correction_high=3.0,
        loss_reducer="sample_mean",
    )
    base = tensors(rollout_logprobs=_t(ROLL), ref_logprobs=_t(REF))

    def f(lp, ent):
        return compute_policy_objective(a, {**base, "logprobs": lp, "entropy": ent})[0]

    assert torch.autograd.gradcheck(f, (_t(LP).requires_grad_(True), _t(ENT).requires_grad_(True)))


def test_gspo_with_opsm_by_hand():
    a = algo(
        name="gspo",
        ratio_type="sequence",
        correction="opsm",
        correction_high=0.05,
        dual_clip_c=None,
        clip_eps_low=3e-4,
        clip_eps_high=4e-4,
    )
    loss, m = compute_policy_objective(a, tensors(rollout_logprobs=_t(ROLL)))
    total, n = 0.0, len(cells())
    for i in range(3):
        ts = [t for t in range(4) if MASK[i][t]]
        s = math.exp(sum(LP[i][t] - OLD[i][t] for t in ts) / len(ts))
        seq_kl = sum(ROLL[i][t] - LP[i][t] for t in ts) / len(ts)
        for t in ts:
            keep = 0.0 if (ADV[i][t] < 0 and seq_kl > 0.05) else 1.0
            total += keep * ref_clip(s, ADV[i][t], 3e-4, 4e-4, None)
    assert loss.item() == pytest.approx(total / n, abs=1e-12)
    assert m["correction/opsm_seq_frac"] == pytest.approx(1 / 3)  # row 2 only (row 1: seq_kl < 0.05)


def test_ppo_with_gae_and_value_loss():
    rewards, groups = _t([1.0, 0.0, 0.5]), torch.tensor([0, 1, 2])
    values = [[0.1, 0.2, 0.3, 0.0], [0.5, 0.4, 0.3, 0.0], [0.2, 0.0, 0.1, 0.4]]
    old_values = [[0.0, 0.25, 0.6, 0.0], [0.5, 0.4, 0.3, 0.0], [0.2, 0.0, 0.4, 0.4]]
    a = algo(name="ppo", advantage="gae", gamma=0.9, lam=0.8, norm_adv_by_std=False, vf_coef=0.5, value_clip=0.2)
    adv, ret = compute_advantages(a, rewards, groups, _t(MASK), values=_t(old_values))
    v = _t(values).requires_grad_(True)
    loss, m = compute_policy_objective(a, tensors(advantages=adv, values=v, old_values=_t(old_values), returns=ret))
    n = len(cells())
    pg = sum(ref_clip(math.exp(LP[i][t] - OLD[i][t]), adv[i, t].item()) for i, t in cells()) / n
    vl = 0.0
    for i, t in cells():
        r, vv, vo = ret[i, t].item(), values[i][t], old_values[i][t]
        vc = vo + min(max(vv - vo, -0.2), 0.2)
        vl += 0.5 * max((vv - r) ** 2, (vc - r) ** 2)
    assert m["loss/value"] == pytest.approx(vl / n, abs=1e-12)
    assert loss.item() == pytest.approx(pg + 0.5 * vl / n, abs=1e-12)
    loss.backward()
    assert v.grad[0, 3] == 0 and v.grad.abs().sum() > 0


def test_distill_advantage_mode():
    a = algo(name="distill", advantage="none", distill_mode="advantage", distill_coef=0.5, dual_clip_c=None)
    t = tensors(teacher_logprobs=_t(TEACHER))
    del t["advantages"]
    loss, m = compute_policy_objective(a, t)
    n = len(cells())
    want = (
        sum(ref_clip(math.exp(LP[i][t] - OLD[i][t]), 0.5 * (TEACHER[i][t] - OLD[i][t]), c=None) for i, t in cells()) / n
    )
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert m["distill/reverse_kl"] == pytest.approx(sum(OLD[i][t] - TEACHER[i][t] for i, t in cells()) / n)


def test_distill_reverse_kl_mode():
    a = algo(name="distill", advantage="none", distill_mode="reverse_kl", distill_coef=2.0)
    t = tensors(teacher_logprobs=_t(TEACHER))
    del t["advantages"]
    loss, m = compute_policy_objective(a, t)
    n = len(cells())
    want = 2.0 * sum(0.5 * (LP[i][t] - TEACHER[i][t]) ** 2 for i, t in cells()) / n
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert "loss/policy" not in m and m["loss/distill"] == pytest.approx(want / 2)


def test_sft_through_the_objective():
    loss, m = compute_policy_objective(
        algo(name="sft", advantage="none"), {"logprobs": _t(LP), "old_logprobs": _t(LP), "mask": _t(MASK)}
    )
    assert loss.item() == pytest.approx(-sum(LP[i][t] for i, t in cells()) / len(cells()))
    assert m["loss/sft"] == pytest.approx(loss.item())


def test_kl_in_reward_logs_kl_but_adds_no_loss_term():
    loss, m = compute_policy_objective(algo(kl_coef=1.0, kl_in_reward=True), tensors(ref_logprobs=_t(REF)))
    assert "loss/kl" not in m and "policy/kl_ref" in m
    assert loss.item() == pytest.approx(m["loss/policy"])


# ------------------------------------------------------------------ reducers and micro-batches
@pytest.mark.parametrize("reducer", ["token_mean", "sample_mean", "constant"])
def test_micro_batches_reproduce_full_batch_loss_and_gradient(reducer):
    a = algo(loss_reducer=reducer, reducer_constant=8.0, kl_coef=0.05, entropy_coef=0.02)
    full = tensors(ref_logprobs=_t(REF), entropy=_t(ENT))
    loss, _ = compute_policy_objective(a, full)
    loss.backward()
    totals = {"total_tokens": float(sum(map(sum, MASK))), "total_samples": 3.0}
    lp = _t(LP).requires_grad_(True)
    parts = 0
    for rows in ([0], [1, 2]):
        mb = {k: v[rows] for k, v in full.items() if isinstance(v, torch.Tensor) and k != "logprobs"}
        parts = parts + compute_policy_objective(a, {**mb, "logprobs": lp[rows], **totals})[0]
    parts.backward()
    assert parts.item() == pytest.approx(loss.item(), abs=1e-12)
    assert torch.allclose(lp.grad, full["logprobs"].grad, atol=1e-12)


# ------------------------------------------------------------------ plug points and errors
def test_plug_points_by_name_and_by_function():
    a = algo()
    by_name, _ = compute_policy_objective(a, tensors(), reducer_fn="sample_mean")
    by_cfg, _ = compute_policy_objective(algo(loss_reducer="sample_mean"), tensors())
    assert by_name.item() == pytest.approx(by_cfg.item())

    def reinforce(algo_, lp, old, adv, mask):
        return -adv * lp, {"custom/seen": 1.0}

    loss, m = compute_policy_objective(a, tensors(), loss_fn=reinforce)
    assert m["custom/seen"] == 1.0
    assert loss.item() == pytest.approx(-sum(ADV[i][t] * LP[i][t] for i, t in cells()) / len(cells()))

    def drop_row_two(algo_, t):
        w = t["mask"].clone()
        w[2] = 0
        return Correction(w, {"correction/custom": 1.0})

    loss, m = compute_policy_objective(a, tensors(), loss_fn=reinforce, correction_fn=drop_row_two)
    assert m["correction/custom"] == 1.0
    assert loss.item() == pytest.approx(-sum(ADV[i][t] * LP[i][t] for i, t in cells() if i < 2) / len(cells()))


def test_clear_errors():
    with pytest.raises(ValueError, match=r"needs tensors\['advantages'\]"):
        compute_policy_objective(algo(), {k: v for k, v in tensors().items() if k != "advantages"})
    with pytest.raises(ValueError, match=r"tensors\['ref_logprobs'\] has shape"):
        compute_policy_objective(algo(), tensors(ref_logprobs=_t([[0.0]])))
    with pytest.raises(ValueError, match="algo.correction='magic'"):
        compute_policy_objective(algo(correction="magic"), tensors())
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_policy_objective(algo(correction="tis"), tensors())
    with pytest.raises(ValueError, match="algo.loss_reducer"):
        compute_policy_objective(algo(loss_reducer="median"), tensors())
    with pytest.raises(ValueError, match="teacher_logprobs"):
        compute_policy_objective(algo(name="distill"), tensors())


# ------------------------------------------------------------------ docs list every metric
def _all_metric_names():
    names = set()
    full = tensors(
        rollout_logprobs=_t(ROLL),
        ref_logprobs=_t(REF),
        entropy=_t(ENT),
        values=_t(LP),
        old_values=_t(OLD),
        returns=_t(REF),
    )
    for corr in ["tis", "mis", "icepop", "opsm"]:
        names |= set(compute_policy_objective(algo(kl_coef=0.1, correction=corr), full)[1])
    for mode in ["advantage", "reverse_kl"]:
        names |= set(
            compute_policy_objective(
                algo(name="distill", distill_mode=mode), {**full, "teacher_logprobs": _t(TEACHER)}
            )[1]
        )
    names |= set(compute_policy_objective(algo(name="sft"), full)[1])
    return names


def test_every_metric_is_documented_with_its_exact_name():
    documented = set()
    for page in DOCS.glob("*.md"):
        documented |= set(re.findall(r"`([a-z_]+/[a-z_0-9]+)`", page.read_text()))
    missing = _all_metric_names() - documented
    assert not missing, f"metrics not named in docs/algorithms/*.md: {sorted(missing)}"
