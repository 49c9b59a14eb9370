"""Multi-LoRA through the real driver: recipes/multi_lora_arithmetic.yaml, two adapters on two tasks, one run.

Shortened (tiny model, 4 prompts x 4 samples a step, 8-token responses, 8 steps) on a topology this test
starts and keeps after the run, so the engine can be read afterwards. Asserted:
- both adapters are resident in the engine, under their own names, with different tensors;
- the engine generated each sample with its own adapter: per adapter, the rollout's log-probs equal the
  trainer's under that adapter (`lora/<adapter>/mismatch/logprob_abs_diff` < `MATCH`; 0.15 when the adapter
  is not sent);
- every stored sample names its own task's adapter (`metadata["adapter"]`, what the rollout sent as `lora_path`);
- each adapter trained on its own task only: the per-adapter sample counts add up to the batch, whole groups
  each (tests/unit/test_multi_lora.py proves a step on one adapter's samples leaves the other bit-identical);
- learning: the reward is task-specific and opposite (`odd_even`: arithmetic rewards odd token ids, reverse
  even ones — a tiny model's real task reward is 0 everywhere, which teaches nothing in 8 steps), so one
  adapter trained on both would cancel; each adapter's mean reward over the last 2 steps it trained in beats its first 2
  by `MARGIN`. With `FURLONG_TEST_MULTILORA_LR=1e-9` the margin assertion fails (no learning).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from furlong.weights.tensors import checksum

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS, WINDOW = 8, 2
MARGIN = 0.08  # mean reward gain, its last WINDOW trained steps over its first WINDOW, for each adapter
MATCH = 1e-4  # mean |rollout - trainer log-prob| per token under the sample's adapter (fp32; measured ~1e-7)
ADAPTERS = {"add": "arithmetic", "rev": "reverse"}


def odd_even(sample: Any) -> float:
    """arithmetic: the fraction of response tokens with an odd id; reverse: with an even id."""
    resp = sample.tokens[sample.prompt_length :]
    odd = sum(t % 2 for t in resp) / max(len(resp), 1)
    return odd if sample.metadata["task"] == "arithmetic" else 1.0 - odd


@pytest.mark.timeout(400)
def test_two_adapters_train_on_two_tasks_in_one_run(tmp_path):
    from furlong.config import load_config
    from furlong.core.client import EngineControl
    from furlong.driver import build
    from furlong.driver.run import Run
    from furlong.driver.rundir import admin_token
    from tests.integration.test_recipes import SHORT

    cfg = load_config(
        str(ROOT / "recipes/multi_lora_arithmetic.yaml"),
        [
            *SHORT,  # the recipe tests' shortening; the steps and the learning rate below are this test's own
            f"train.total_steps={STEPS}",
            f"train.lr={os.environ.get('FURLONG_TEST_MULTILORA_LR', '2e-2')}",
            f"rollout.reward_fn={__name__}:odd_even",
            "cluster.threads_per_process=1",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    build.start_ray(cfg)
    (tmp_path / "top").mkdir()
    token = admin_token(tmp_path / "top")
    top = build.topology(cfg, tmp_path / "top", build.model_dir(cfg.model), token, build.plugins(cfg))
    try:
        result = asyncio.run(Run(cfg, progress=False, topology=top).run())
        (url,) = top.engine_urls
        sums = EngineControl(url, admin_token=token).weights_checksum()["tensors"]
    finally:
        top.shutdown()
    assert result["steps"] == STEPS
    # both adapters resident, each under its name, with different tensors
    for name in ADAPTERS:
        assert f"lora::{name}::config" in sums
    add = {k.split("::", 2)[2]: v["crc32"] for k, v in sums.items() if k.startswith("lora::add::")}
    rev = {k.split("::", 2)[2]: v["crc32"] for k, v in sums.items() if k.startswith("lora::rev::")}
    assert add.keys() == rev.keys() and len(add) > 1
    differ = [m for m in add if m != "config" and add[m] != rev[m]]
    assert len(differ) == len(add) - 1, "every A and B of the two adapters should differ"
    for k, v in sums.items():  # B starts at 0: each adapter's B moved, so each adapter trained
        if k.endswith("lora_B"):
            zero = checksum(torch.zeros(v["shape"], dtype=getattr(torch, v["dtype"])))
            assert v["crc32"] != zero, f"{k} is still all zeros"
    # each sample was generated with its own task's adapter (the tag the rollout sent as lora_path) ...
    run_dir = Path(result["run_dir"])
    for f in sorted((run_dir / "samples").glob("step_*.jsonl")):
        for line in f.read_text().splitlines():
            meta = json.loads(line)["metadata"]
            assert ADAPTERS[meta["adapter"]] == meta["task"], f"{f.name}: {meta['task']} sample sent {meta['adapter']}"
    # ... and trained only its own adapter: the per-adapter step counts add up to the batch, whole groups each
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"lora/' in line]
    assert len(rows) == STEPS
    for r in rows:
        counts = [r.get(f"lora/{name}/samples", 0.0) for name in ADAPTERS]
        assert sum(counts) == 16 and all(c % 4 == 0 for c in counts), r
    # the engine generated each sample with its adapter: its log-probs equal the trainer's under that adapter
    # (from step 2 on, once the adapters differ from the base and from each other; the wrong adapter is
    # off by far more: with no lora_path sent, `add` differed by 0.15 at step 2)
    for r in rows[1:]:
        for name in ADAPTERS:
            diff = r.get(f"lora/{name}/mismatch/logprob_abs_diff")
            assert diff is None or diff < MATCH, f"step {r['step']}: adapter {name} rollout/train |Δ logprob| {diff}"
    for name in ADAPTERS:
        vals = [r[f"lora/{name}/reward_mean"] for r in rows if f"lora/{name}/reward_mean" in r]
        assert len(vals) >= 2 * WINDOW, f"adapter {name} trained in only {len(vals)} steps"
        gain = sum(vals[-WINDOW:]) / WINDOW - sum(vals[:WINDOW]) / WINDOW
        assert gain >= MARGIN, f"adapter {name}: reward gain {gain:.3f} < {MARGIN} over {STEPS} steps ({vals})"
