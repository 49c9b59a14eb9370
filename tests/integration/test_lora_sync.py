"""Adapter-only LoRA sync: the engine serving base + synced adapter gives what a merged-weights sync gives.

A LoRA trainer takes real steps; one engine receives only the adapters (`train.lora.sync=adapter`,
through the run's transports), another the merged W + B·A·scale (`merged`). Both then generate
greedily with log-probs: the same tokens, log-probs within 1e-5 (fp32). The bytes moved are the
transport's own count (`SyncReport.bytes`), against the full weights of the m25 model at rank 8.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_train_trainer import algo, samples  # noqa: E402

from furlong.config.schema import LoraConfig, TrainConfig  # noqa: E402
from furlong.engine.engine import Engine  # noqa: E402
from furlong.engine.server import ServerThread  # noqa: E402
from furlong.models import create_model  # noqa: E402
from furlong.train.trainer import Trainer  # noqa: E402
from furlong.weights import make_sender  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "adm"
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48], [9, 3, 77, 12, 30, 2]]


def lora_trainer(model: Path, r: int, targets: list[str]) -> Trainer:
    cfg = TrainConfig(lr=3e-2, lora=LoraConfig(enabled=True, r=r, alpha=2 * r, target_modules=targets))
    return Trainer(model, cfg, algo())


def sync_stream(tr: Trainer, mode: str) -> list[tuple[str, torch.Tensor]]:
    tr.cfg.lora.sync = mode
    try:
        return list(tr.state_dict_for_sync())
    finally:
        tr.cfg.lora.sync = "adapter"


def greedy(url: str) -> list[dict]:
    body = {"sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}, "return_logprob": True}
    return [httpx.post(url + "/generate", json={**body, "input_ids": p}, timeout=60).json() for p in PROMPTS]


def assert_same(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        lx = torch.tensor([t[0] for t in x["meta_info"]["output_token_logprobs"]])
        ly = torch.tensor([t[0] for t in y["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(lx, ly, atol=1e-5, rtol=0)


@pytest.mark.timeout(240)
def test_adapter_sync_serves_what_merged_sync_serves(tmp_path) -> None:
    model = create_model("qwen3", "tiny")
    tr = lora_trainer(model, 4, ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    engines = [Engine(model, kv_cache_mb=2).start() for _ in range(2)]
    with ServerThread(engines[0], TOKEN) as adapter_srv, ServerThread(engines[1], TOKEN) as merged_srv:
        base_out = greedy(adapter_srv.url)
        for version, (transport, verify) in enumerate([("shm", True), ("delta", False), ("disk", True)], start=1):
            tr.train_step(samples(version))
            # disk needs its folder; shm goes in ~2 KB buckets, so the first adapter lands over several requests
            opts = {"directory": tmp_path / "weights"} if transport == "disk" else {"bucket_mb": 0.002}
            with make_sender(transport, verify=verify, **opts) as a, make_sender("shm") as m:
                a.connect([adapter_srv.url], TOKEN)
                m.connect([merged_srv.url], TOKEN)
                rep_a = a.push(sync_stream(tr, "adapter"), version)
                rep_m = m.push(sync_stream(tr, "merged"), version)
            assert rep_a.verified == verify and rep_a.bytes < rep_m.bytes / 10
            assert rep_a.buckets > 1 or transport == "disk"
            got = greedy(adapter_srv.url)
            assert all(o["meta_info"]["weight_version"] == version for o in got)
            assert_same(got, greedy(merged_srv.url))
        assert any(x["output_ids"] != y["output_ids"] for x, y in zip(base_out, got)), "training changed nothing"
        info = httpx.get(adapter_srv.url + "/get_model_info").json()
        assert info["lora_adapters"] == ["policy"]
    for eng in engines:
        eng.stop()


@pytest.mark.timeout(300)
def test_rank8_adapter_sync_moves_under_5pct_of_m25() -> None:
    """Rank 8 on q/k/v/o of the m25 model (512 hidden, 8 layers): the adapter sync's bytes against the full sync's."""
    model = create_model("qwen3", "m25")
    tr = lora_trainer(model, 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    tr.train_step(samples(0))
    eng = Engine(model, kv_cache_mb=4).start()
    try:
        with ServerThread(eng, TOKEN) as srv, make_sender("shm") as sender:
            sender.connect([srv.url], TOKEN)
            report = sender.push(sync_stream(tr, "adapter"), 1)
    finally:
        eng.stop()
    full = sum(t.numel() * t.element_size() for _, t in sync_stream(tr, "merged"))
    print(f"m25 rank 8: adapter sync {report.bytes} B vs full {full} B = {report.bytes / full:.4f}")
    assert report.bytes <= 0.05 * full
    assert report.bytes >= 8 * 4 * (512 * 4)  # it did carry the adapters (A and B of 32 modules, fp32)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_furlong_train_with_adapter_sync(tmp_path) -> None:
    """A short `furlong train` (the debug recipe, LoRA on): every sync carries adapters only and is verified."""
    from furlong.config import load_config
    from furlong.driver.run import Run

    cfg = load_config(
        str(ROOT / "recipes" / "debug.yaml"),
        [
            f"run_dir={tmp_path / 'run'}",
            "train.total_steps=2",
            "data.n_eval=1",
            "observe.tensorboard=false",
            "train.lora.enabled=true",
            "train.lr=0.01",
            "weights.verify=true",
            "algo.entropy_coef=0.01",
        ],
    )
    import ray

    try:
        result = asyncio.run(Run(cfg, progress=False).run())
    finally:
        ray.shutdown()
    assert result["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["weight_sync/version"] for m in rows] == [1, 2]
    assert all(m["weight_sync/verified"] == 1 for m in rows)
    from transformers import AutoModelForCausalLM

    full = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(create_model("qwen3", "tiny")).parameters())
    assert all(0 < m["weight_sync/bytes"] < 0.1 * full for m in rows), ([m["weight_sync/bytes"] for m in rows], full)
