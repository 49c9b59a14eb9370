"""Quantised rollout weights end to end: trainer -> sender (quantises once) -> engine (holds codes + scales).

1. A sync from a real `Trainer` after one optimiser step (every transport for fp8; shm and disk for the
   other formats) leaves a quantised engine holding exactly `quantize(trained weight)` for every
   projection, moves fewer bytes than a dense sync (the sender's `report.bytes`, counted exactly against
   the same sync unquantised), and `weights.verify` passes on what the engine holds.
2. A short `furlong train` run on the debug recipe with `engine.quantization=fp8` still learns: the
   recipe test's dense `odd_tokens` reward gains the recipe tests' margin (slow: its own topology).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from furlong.config.schema import AlgoConfig, TrainConfig
from furlong.core.sample import Sample
from furlong.engine.engine import Engine
from furlong.engine.quantized import held_state_dict
from furlong.engine.server import ServerThread
from furlong.weights import make_sender
from furlong.weights.quant.payload import quantize_for_sync
from furlong.weights.tensors import checksum


def one_trained_step(path) -> dict[str, torch.Tensor]:
    """A real trainer after one GRPO step on made-up samples: the weights a sync carries."""
    from furlong.train.trainer import Trainer

    trainer = Trainer(path, TrainConfig(lr=1e-2, micro_batch_tokens=256), AlgoConfig(entropy_coef=0.01))
    batch = []
    for i in range(4):
        s = Sample(index=i, group_index=0, tokens=[5, 6, 7, 8])
        s.append([9 + i, 10 + i, 11], logprobs=[-1.0, -1.0, -1.0])
        s.reward = float(i % 2)
        batch.append(s)
    trainer.train_rollout(batch)
    return {n: t.detach().clone() for n, t in trainer.state_dict_for_sync()}


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    return one_trained_step(tiny_model_dir)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "transport, fmt",
    [(t, "fp8") for t in ("shm", "disk", "broadcast", "delta", "p2p")]
    + [(t, f) for t in ("shm", "disk") for f in ("mxfp8", "nvfp4", "int4")],
)
def test_sync_leaves_the_engine_holding_the_quantised_trained_weights(
    tiny_model_dir, trained, transport, fmt, tmp_path
):
    eng = Engine(tiny_model_dir, kv_cache_mb=2, block_size=4, quantization=fmt).start()
    try:
        with ServerThread(eng) as srv:
            reports = {}
            for q in ("none", fmt):
                opts = {"directory": tmp_path / q} if transport == "disk" else {}
                sender = make_sender(transport, quantization=q, verify=q != "none", bucket_mb=1, **opts)
                sender.connect([srv.url], None)
                try:
                    reports[q] = sender.push(list(trained.items()), version=1 if q == "none" else 2)
                finally:
                    sender.close()
            want = dict(quantize_for_sync(list(trained.items()), fmt))
            held = eng.call(lambda: held_state_dict(eng.hf, eng.model)).result(30)
    finally:
        eng.stop()
    assert reports[fmt].verified and eng.weight_version == 2
    assert held.keys() == want.keys()
    assert all(checksum(held[k]) == checksum(want[k]) for k in want)  # bit for bit
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    # Exact accounting: the dense sync moved every trained tensor, the quantised one codes + scales instead of
    # each projection (on this tiny model embeddings and lm_head dominate; benchmarks/weight_sync_quant.py: m25).
    assert reports["none"].bytes == size(trained.values())
    if transport == "delta":  # the engine quantised the dense sync itself, to the very codes the sender makes
        assert reports[fmt].unchanged == len(want) - 1  # so nothing changed (one tensor carries the version)
    else:
        assert reports[fmt].bytes == size(want.values()) < reports["none"].bytes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp8_rollout_recipe_still_learns(tmp_path):
    from furlong.config import load_config
    from furlong.driver.run import Run
    from tests.integration.test_recipes import RECIPES, SHORT, _metrics, assert_learned

    cfg = load_config(
        str(RECIPES / "fp8_rollout.yaml"),
        [*SHORT, f"run_dir={tmp_path / 'fp8'}", "rollout.reward_fn=tests.integration.test_recipes:odd_tokens"],
    )
    assert (cfg.engine.quantization, cfg.weights.verify) == ("fp8", True)  # the recipe's, not an override's
    result = asyncio.run(Run(cfg, progress=False).run())
    rows = _metrics(cfg.run_dir)
    assert result["steps"] == len(rows) and all(r.get("weight_sync/verified") == 1 for r in rows)
    assert_learned(result, cfg.name)
