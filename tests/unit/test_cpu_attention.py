"""`furlong.train.cpu_attention`: a CPU trainer's attention runs in fp32 when it would run in bf16 with a backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from furlong.config.schema import TrainConfig
from furlong.models import create_model
from furlong.train import cpu_attention
from tests.unit.test_train_trainer import algo, samples

MODEL = create_model("qwen3", "tiny")


class Heads(nn.Module):
    """What transformers' SDPA function reads off an attention module."""

    is_causal = True
    num_key_value_groups = 2


def qkv(dtype: torch.dtype, grad: bool = False):
    gen = torch.Generator().manual_seed(0)
    shapes = ((3, 4, 9, 16), (3, 2, 9, 16), (3, 2, 9, 16))
    return [torch.randn(*s, generator=gen).to(dtype).requires_grad_(grad) for s in shapes]


def reference(q, k, v, dtype: torch.dtype) -> torch.Tensor:
    """Causal GQA attention computed in `dtype`, [B, L, H, hd] like transformers' SDPA function returns."""
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True).transpose(1, 2)


@pytest.mark.timeout(60)
def test_bf16_inputs_with_grad_are_attended_in_fp32_and_the_gradient_flows():
    q, k, v = qkv(torch.bfloat16, grad=True)
    out, _ = cpu_attention.cpu_sdpa(Heads(), q, k, v, None, scaling=16**-0.5)
    assert out.dtype == torch.bfloat16
    exact = reference(q.detach(), k.detach(), v.detach(), torch.float32)
    assert torch.equal(out.detach(), exact.to(torch.bfloat16))  # fp32 attention, rounded once at the end
    assert not torch.equal(out.detach(), reference(q.detach(), k.detach(), v.detach(), torch.bfloat16))
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 and t.grad.abs().sum() > 0 for t in (q, k, v))


@pytest.mark.timeout(60)
def test_fp32_inputs_under_bf16_autocast_are_attended_in_fp32():
    """Under `mixed_precision=bf16` RoPE hands fp32 q and k over, which autocast would cast down for SDPA."""
    q, k, v = qkv(torch.float32, grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = cpu_attention.cpu_sdpa(Heads(), q, k, v, None, scaling=16**-0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.detach(), reference(q.detach(), k.detach(), v.detach(), torch.float32))


@pytest.mark.timeout(60)
def test_without_grad_or_in_fp32_it_is_transformers_sdpa_unchanged():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for dtype, grad in ((torch.bfloat16, False), (torch.float32, True)):
        q, k, v = qkv(dtype)
        with torch.set_grad_enabled(grad):
            ours, _ = cpu_attention.cpu_sdpa(Heads(), q, k, v, None, scaling=16**-0.5)
            theirs, _ = sdpa_attention_forward(Heads(), q, k, v, None, scaling=16**-0.5)
        assert ours.dtype == dtype and torch.equal(ours, theirs), dtype


@pytest.mark.timeout(120)
def test_a_cpu_trainer_attends_through_it_with_fp32_log_probs_unchanged():
    """The switch is exact in fp32 (the plain call); in bf16 the trainer's attention runs in fp32 under grad."""
    from transformers import AutoModelForCausalLM

    from furlong.train.trainer import Trainer

    torch.manual_seed(0)
    tr = Trainer(MODEL, TrainConfig(lr=1e-3), algo())
    assert tr.policy.config._attn_implementation == cpu_attention.NAME
    plain = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    assert plain.config._attn_implementation == "sdpa"  # a model loaded elsewhere is left alone
    ids = torch.tensor([[5, 9, 2, 7, 3, 8]])
    with torch.no_grad():
        assert torch.equal(tr.policy(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert not cpu_attention.apply(plain, torch.device("cuda"))  # a GPU keeps sdpa's own bf16 kernels
    assert plain.config._attn_implementation == "sdpa"

    mixed = Trainer(MODEL, TrainConfig(lr=1e-3, mixed_precision="bf16"), algo())
    seen = []
    real = cpu_attention.sdpa_forward
    try:
        cpu_attention.sdpa_forward = lambda m, q, *a, **kw: (
            seen.append((q.dtype, torch.is_autocast_enabled("cpu"), torch.is_grad_enabled())) or real(m, q, *a, **kw)
        )
        mixed.compute_logprobs(samples(0))  # no grad: the plain call, inside autocast (bf16)
        mixed.train_step(samples(0))
    finally:
        cpu_attention.sdpa_forward = real
    assert (torch.float32, True, False) in seen  # the forward-only pass kept autocast (SDPA in bf16)
    assert {s for s in seen if s[2]} == {(torch.float32, False, True)}, seen  # with grad: fp32, autocast off
