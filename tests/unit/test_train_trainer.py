"""The trainer in-process: accumulation ≡ one big batch, temperature log-probs, SFT learns, PPO critic, reference refresh."""

from __future__ import annotations

import pytest
import torch

from furlong.config.schema import AlgoConfig, TrainConfig
from furlong.core.sample import Sample
from furlong.models import create_model, load_tokenizer
from furlong.train.trainer import Trainer

torch.set_num_threads(1)
MODEL = create_model("qwen3", "tiny")


def algo(**kw):
    base = dict(
        name="grpo",
        advantage="grpo",
        norm_adv_by_std=True,
        gamma=1.0,
        lam=0.95,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip_c=None,
        ratio_type="token",
        log_ratio_clamp=20.0,
        kl_coef=0.0,
        kl_type="k3",
        kl_in_reward=False,
        entropy_coef=0.0,
        loss_reducer="sample_mean",
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
    return AlgoConfig(**base)


def samples(seed: int = 0, n: int = 8) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, 500, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        resp = torch.randint(1, 500, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
        s = Sample(index=i, group_index=i // 4, tokens=prompt, reward=float(torch.rand(1, generator=g)))
        s.append(resp, logprobs=(-torch.rand(len(resp), generator=g) * 8).tolist())
        s.loss_mask[0] = 0 if len(resp) > 2 else 1  # a tool-like untrained token
        out.append(s)
    return out


def weights(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.state_dict_for_sync()}


@pytest.mark.parametrize("reducer", ["token_mean", "sample_mean", "constant"])
def test_grad_accumulation_equals_one_big_batch(reducer: str) -> None:
    """Several padded micro-batches give the one-batch loss and gradients (up to fp32 rounding).

    Gradients are compared rather than weights after Adam: Adam's first update is
    ≈ lr·sign(g), which turns rounding noise on near-zero gradients into lr-sized moves.
    """
    results = []
    for budget in (10_000, 20):  # one micro-batch vs several
        tr = Trainer(
            MODEL,
            TrainConfig(lr=1e-3, micro_batch_tokens=budget),
            algo(loss_reducer=reducer, reducer_constant=16.0, kl_coef=0.1, entropy_coef=0.01),
        )
        assert len(tr._plan(tr.prepare(samples()).seq_lengths)) == (1 if budget > 1000 else 6)
        m = [tr.train_step(samples(0))]
        grads = {n: p.grad.clone() for n, p in tr.policy.named_parameters()}
        m.append(tr.train_step(samples(1)))
        results.append((m, grads))
    (m1, g1), (m2, g2) = results
    for a, b in zip(m1, m2):
        for key in ("loss", "grad_norm", "loss/policy", "loss/kl", "policy/entropy", "mismatch/ess_ratio"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert m1[1]["loss/kl"] > 0
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-6, rtol=0, msg=name)


def test_logprobs_at_rollout_temperature() -> None:
    from transformers import AutoModelForCausalLM

    batch = samples(3, n=3)
    tr = Trainer(MODEL, TrainConfig(micro_batch_tokens=16), algo(), temperature=0.6)
    got = tr.compute_logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    for s, lp in zip(batch, got):
        logits = model(torch.tensor([s.tokens])).logits[0, s.prompt_length - 1 : -1] / 0.6
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(lp), want, atol=1e-5, rtol=0)


def test_metrics_and_reference_refresh() -> None:
    tr = Trainer(MODEL, TrainConfig(lr=1e-2, ref_update_every=2, grad_clip=0.5), algo(kl_coef=0.1))
    m = tr.train_step(samples(0))
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "tokens",
        "policy/clip_frac",
        "policy/kl_ref",
        "policy/entropy",
        "mismatch/logprob_abs_diff",
        "mismatch/kl",
        "mismatch/ess_ratio",
        "loss/policy",
        "loss/kl",
    ):
        assert key in m, key
    assert m["tokens"] == sum(sum(s.loss_mask) for s in samples(0))
    assert 0 < m["mismatch/ess_ratio"] <= 1
    assert m["policy/kl_ref"] == 0  # the first step starts at the reference
    tr.train_step(samples(1))  # step 2: the reference is refreshed to the policy
    policy = dict(tr.policy.named_parameters())
    assert all(torch.equal(p, policy[n]) for n, p in tr.ref.named_parameters())


def test_ppo_trains_the_critic() -> None:
    tr = Trainer(MODEL, TrainConfig(lr=1e-2), algo(name="ppo", advantage="gae"))
    before = {k: v.clone() for k, v in tr.critic.state_dict().items()}
    m = tr.train_step(samples(0))
    assert m["loss/value"] > 0 and m["critic/grad_norm"] > 0
    tr.train_step(samples(1))  # the zero-initialised head first has to move before the backbone gets gradient
    after = tr.critic.state_dict()
    assert not torch.equal(before["head.weight"], after["head.weight"])
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("backbone."))


def _sft_samples(split: str, n: int, tok) -> list[Sample]:
    from furlong.data.tasks import get_task

    out = []
    for i, p in enumerate(get_task("arithmetic").make(split, n=n, seed=1)):
        s = Sample(index=i, tokens=tok.encode(p.prompt))
        s.append(tok.encode(f" {p.label}") + [tok.eos_token_id])
        out.append(s)
    return out


def test_sft_lowers_held_out_loss() -> None:
    tok = load_tokenizer(MODEL)
    train, held_out = _sft_samples("train", 64, tok), _sft_samples("eval", 32, tok)
    tr = Trainer(MODEL, TrainConfig(lr=3e-3, micro_batch_tokens=512), algo(name="sft"))

    def held_out_nll() -> float:
        lps = tr.compute_logprobs(held_out)
        return -sum(sum(lp) for lp in lps) / sum(len(lp) for lp in lps)

    before = held_out_nll()
    for step in range(30):
        m = tr.sft_step(train[(step % 4) * 16 : (step % 4 + 1) * 16])
    after = held_out_nll()
    assert m["sft/num_tokens"] > 0
    assert after < before - 1.0, (before, after)


def test_sft_lr_applies_to_sft_steps_only() -> None:
    """`sft_lr` is the warm-up's rate: an SFT step under it equals one with lr=sft_lr, and RL gets lr back."""
    tok = load_tokenizer(MODEL)
    batch = _sft_samples("train", 16, tok)
    warm = Trainer(MODEL, TrainConfig(lr=1e-5, sft_lr=3e-3, micro_batch_tokens=512), algo(name="sft"))
    plain = Trainer(MODEL, TrainConfig(lr=3e-3, micro_batch_tokens=512), algo(name="sft"))
    assert warm.sft_step(batch)["lr"] == 3e-3
    plain.sft_step(batch)
    a, b = weights(warm), weights(plain)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [g["lr"] for g in warm.optimizer.param_groups] == [1e-5] * len(warm.optimizer.param_groups)
    before = weights(warm)
    warm.train_step(samples())
    moved = max(float((weights(warm)[k] - before[k]).abs().max()) for k in before)
    assert 0 < moved < 1e-3, moved  # an AdamW step moves a weight by about lr, not sft_lr
