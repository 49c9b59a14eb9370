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
  adapter trained on both would cancel. Judged after the run, not on the training reward (whose 2-step
  windows moved by sampling noise alone: -0.06 at a learning rate of 1e-9): each adapter, in the run's
  engine, and the base model, in an engine of its own, sample `PROBE` seeded responses to each prompt of
  the adapter's task, and each adapter's reward under `odd_even` beats the base's by `MARGIN` (measured over
  seeds 0-3, `FURLONG_TEST_RECIPES_SEED`: +0.18 to +0.53; 0.000 at a learning rate of 1e-9). With
  `FURLONG_TEST_MULTILORA_LR=1e-9` that assertion fails (no learning).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from furlong.core.sample import Sample
from furlong.weights.tensors import checksum

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
PROBE = 8  # seeded responses per prompt, per adapter and for the base, after the run
MARGIN = 0.1  # each adapter's probe reward over the base's on the same prompts (its task's)
MATCH = 1e-4  # mean |rollout - trainer log-prob| per token under the sample's adapter (fp32; measured ~1e-7)
ADAPTERS = {"add": "arithmetic", "rev": "reverse"}


def odd_even(sample: Any) -> float:
    """arithmetic: the fraction of response tokens with an odd id; reverse: with an even id."""
    resp = sample.tokens[sample.prompt_length :]
    odd = sum(t % 2 for t in resp) / max(len(resp), 1)
    return odd if sample.metadata["task"] == "arithmetic" else 1.0 - odd


def probe_params(seed: int) -> dict[str, Any]:
    """How the probe samples: as the run does (the recipe tests' temperature 1 and top-k 4, 8 tokens), seeded."""
    return {"max_new_tokens": 8, "temperature": 1.0, "top_k": 4, "seed": seed, "ignore_eos": True}


def mean_reward(outputs: list[list[int]], task: str) -> float:
    fake = lambda ids: SimpleNamespace(tokens=ids, prompt_length=0, metadata={"task": task})
    return sum(odd_even(fake(ids)) for ids in outputs) / len(outputs)


async def adapter_rewards(url: str, prompts: dict[str, list[list[int]]]) -> dict[str, float]:
    """Per adapter, its `odd_even` reward over `PROBE` seeded responses to each of its task's prompts, from the
    run's engine with the adapter named (`lora_path`)."""
    from furlong.core.client import EngineClient

    client = EngineClient(url, timeout_s=120)
    try:
        out = {}
        for name, task in ADAPTERS.items():
            asks = [client.generate(p, probe_params(s), lora_path=name) for p in prompts[task] for s in range(PROBE)]
            out[name] = mean_reward([o["output_ids"] for o in await asyncio.gather(*asks)], task)
        return out
    finally:
        await client.aclose()


def base_rewards(model_dir: Path, prompts: dict[str, list[list[int]]]) -> dict[str, float]:
    """The same probe on the base model without adapters, in an engine of its own (the run's engine serves
    requests naming no adapter with its policy adapter, the last one synced)."""
    from furlong.engine.engine import Engine
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams

    engine = Engine(model_dir, kv_cache_mb=8, max_running=64, device="cpu").start()
    try:
        out = {}
        for name, task in ADAPTERS.items():
            reqs = [Request(p, SamplingParams(**probe_params(s))) for p in prompts[task] for s in range(PROBE)]
            out[name] = mean_reward([r.output_ids for r in engine.generate(reqs, timeout=120)], task)
        return out
    finally:
        engine.stop()


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
        prompts: dict[str, list[list[int]]] = {task: [] for task in ADAPTERS.values()}
        for f in sorted((Path(result["run_dir"]) / "samples").glob("step_*.jsonl")):
            for s in map(Sample.from_json, f.read_text().splitlines()):
                prompt = s.tokens[: s.prompt_length]
                if prompt not in prompts[s.metadata["task"]]:
                    prompts[s.metadata["task"]].append(prompt)
        trained = asyncio.run(adapter_rewards(url, prompts))
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
    # each adapter learned its own task's reward: its responses beat the base model's on the same prompts
    base = base_rewards(build.model_dir(cfg.model), prompts)
    print(f"probe rewards: adapters {trained}, base {base}")
    for name in ADAPTERS:
        gain = trained[name] - base[name]
        assert gain >= MARGIN, f"adapter {name}: probe reward {trained[name]:.3f}, base {base[name]:.3f} (< +{MARGIN})"
