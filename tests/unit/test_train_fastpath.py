"""The trainer's fast paths keep the maths: fused AdamW equals the plain loop, and with one optimiser step
per rollout the training forward's log-probs stand in for pi_old (no separate old-logprob pass)."""

from __future__ import annotations

import torch

from furlong.config.schema import TrainConfig
from furlong.models import create_model
from furlong.train.optim import build_optimizer
from furlong.train.trainer import Trainer
from tests.unit.test_train_trainer import algo, samples

torch.set_num_threads(1)
MODEL = create_model("qwen3", "tiny")


def test_fused_adamw_equals_the_plain_loop_within_1e_6() -> None:
    """Tolerance 1e-6 (absolute, on weights of magnitude ~0.1): the fused kernel reorders fp32 arithmetic."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (7, 5, 3)]
    start = [torch.randn(s) * 0.1 for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    cfg = TrainConfig(lr=1e-2, weight_decay=0.01)
    results = []
    for kind in ("fused", "plain"):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        if kind == "fused":
            opt = build_optimizer(params, cfg)
            assert opt.defaults["fused"]  # the CPU build has the fused kernel
        else:
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=False, fused=False)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    moved = max((a - s).abs().max() for a, s in zip(results[1], start))
    assert moved > 0.03  # four steps of lr 1e-2 really moved the weights
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, atol=1e-6, rtol=0)


def _policy_forwards(tr: Trainer) -> list[int]:
    calls = [0]
    tr.policy.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_one_step_per_rollout_reuses_training_logprobs_as_old() -> None:
    """With a KL term in the loss, one step per rollout: no old-logprob forward, and the same loss, metrics
    and gradients as when pi_old is computed by its own pass first (fp32, 1e-5)."""
    a = algo(kl_coef=0.1)
    batch = samples(seed=3)
    tr = Trainer(MODEL, TrainConfig(lr=1e-3, micro_batch_tokens=40), a)
    calls = _policy_forwards(tr)
    prepared = tr.prepare(batch)
    assert prepared.old_logprobs is None and prepared.ref_logprobs is not None
    assert calls[0] == 0  # the reference is its own model: the policy ran no forward in prepare
    reused = tr._optimise(prepared, tr._policy_loss)
    assert calls[0] == len(tr._plan(prepared.seq_lengths))  # one forward per micro-batch, nothing else
    grads_reused = [p.grad.clone() for p in tr.policy.parameters()]

    ref = Trainer(MODEL, TrainConfig(lr=1e-3, micro_batch_tokens=40), a)
    full = ref.prepare(batch)
    full.old_logprobs = torch.zeros(full.mask.shape)
    lp = ref.compute_logprobs(full)
    for i, row in enumerate(lp):
        full.old_logprobs[i, : len(row)] = torch.tensor(row)
    separate = ref._optimise(full, ref._policy_loss)
    for k in ("loss", "mismatch/ess_ratio", "grad_norm"):
        assert abs(reused[k] - separate[k]) <= 1e-5 * max(1.0, abs(separate[k])), k
    for g, h in zip(grads_reused, (p.grad for p in ref.policy.parameters())):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=1e-4)


def test_kl_in_reward_still_computes_old_logprobs_first() -> None:
    tr = Trainer(MODEL, TrainConfig(lr=1e-3), algo(kl_coef=0.1, kl_in_reward=True))
    assert tr.prepare(samples()).old_logprobs is not None  # the reward needs KL(pi_old || ref) before training
