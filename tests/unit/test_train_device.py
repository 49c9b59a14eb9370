"""Trainer options for GPUs that run (and are tested) on CPU: activation checkpointing, bf16 mixed precision.

NCCL itself needs GPUs (`tests/gpu/`); the FSDP2 calls are the same over gloo, so the
mixed-precision policy is checked here on a one-rank gloo group in a child process (a
process group in the test process would change what other tests see).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from furlong.config.schema import Config, TrainConfig
from furlong.models import create_model
from tests.unit.test_train_trainer import algo, samples

MODEL = create_model("qwen3", "tiny")


def _trainer(checkpointing: bool):
    from furlong.train.trainer import Trainer

    torch.manual_seed(0)
    tr = Trainer(MODEL, TrainConfig(lr=1e-3, gradient_checkpointing=checkpointing), algo(entropy_coef=0.01))
    calls = []
    tr.policy.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))  # pre: recompute stops early
    tr.train_step(samples(0))
    return {n: p.grad.clone() for n, p in tr.policy.named_parameters()}, len(calls)


@pytest.mark.timeout(120)
def test_activation_checkpointing_recomputes_and_keeps_the_gradients():
    plain, plain_calls = _trainer(False)
    ckpt, ckpt_calls = _trainer(True)
    assert ckpt_calls > plain_calls  # the block ran again in backward: its activations were not kept
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=0, msg=name)


CHILD = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from furlong.core.net import free_port
    from furlong.train import dist as fdist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    fdist.shard(model, torch.device("cpu"), "bf16")
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model(torch.tensor([[1, 2, 3]])).logits.float().sum().backward()
    p = next(model.parameters())
    print("compute", seen[0], "master", p.dtype, "grad", p.grad.dtype)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_fsdp2_bf16_mixed_precision_computes_in_bf16_with_fp32_master_weights():
    out = subprocess.run([sys.executable, "-c", CHILD, str(MODEL)], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compute torch.bfloat16 master torch.float32 grad torch.float32" in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_one_rank_bf16_autocast_computes_in_bf16_with_fp32_master_weights_and_log_probs():
    """train.mixed_precision=bf16 on one rank: matmuls in bf16 (a linear's output), parameters, gradients and
    log-probs in fp32; the log-probs close to the fp32 ones (bf16 has an 8-bit mantissa) but not equal."""
    from furlong.train.trainer import Trainer

    assert Config.from_dict({"train": {"mixed_precision": "bf16"}}).train.mixed_precision == "bf16"
    torch.manual_seed(0)
    plain = Trainer(MODEL, TrainConfig(lr=1e-3), algo())
    torch.manual_seed(0)
    mixed = Trainer(MODEL, TrainConfig(lr=1e-3, mixed_precision="bf16"), algo())
    seen = []
    mixed.policy.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    lp_plain, lp_mixed = plain.compute_logprobs(samples(0)), mixed.compute_logprobs(samples(0))
    assert seen and set(seen) == {torch.bfloat16}, seen
    diff = max(abs(a - b) for x, y in zip(lp_plain, lp_mixed) for a, b in zip(x, y))
    assert 0 < diff < 0.1, diff
    mixed.train_step(samples(0))
    p = next(mixed.policy.parameters())
    assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
