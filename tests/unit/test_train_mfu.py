"""MFU of a training step: FLOPs counted from the model config per processed token, against one shared peak."""

from __future__ import annotations

import math

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from furlong.models import flops
from furlong.train import mfu


def test_step_mfu_counts_forward_and_backward_for_every_token():
    m = mfu.step_mfu(flops_per_token=20.0, tokens=5, seconds=2.0, peak=100.0)
    assert m["perf/mfu"] == 3 * 20.0 * 5 / 2.0 / 100.0  # forward 1 + backward 2, every token
    assert m["perf/train_tokens_per_s"] == 2.5 and m["perf/peak_gflops"] == 1e-7
    assert "perf/mfu" not in mfu.step_mfu(20.0, 5, 2.0, None)  # no peak known (a GPU not in the table)


def test_the_trainer_and_the_timeline_share_one_flop_count_and_one_measured_peak():
    peak, source = flops.peak_flops("float32", "cpu")
    assert math.isfinite(peak) and peak > 0 and "measured" in source
    assert flops.peak_flops("float32", "cpu")[0] == peak  # one probe per process, not per step
    cfg = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=100,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    per_token = flops.forward_flops_per_token(cfg.to_dict())
    # 2 FLOPs per matmul weight: q, o (32x32 each), k, v (32x16 each), gate/up/down (3x32x64) per layer + LM head
    assert per_token == 2.0 * (2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64) + 32 * 100)
    out = mfu.for_step(model, torch.float32, torch.device("cpu"), tokens=8, t0=0.0)
    assert out["perf/mfu"] > 0 and out["perf/peak_gflops"] == peak / 1e9
