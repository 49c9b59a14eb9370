"""LoRA adapters served by the built-in engine: PEFT's numerics, mixed-adapter batches, load/unload over HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.engine.engine import Engine
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams
from furlong.engine.server import ServerThread
from furlong.models import create_model

MODEL = create_model("qwen3", "tiny")
TOKEN = "adm"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [9, 3, 77, 12, 30]]
TARGETS = {
    "a": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "b": ["v_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
}


def peft_model(targets: list[str], seed: int):
    """A PEFT model whose adapters are random (B != 0), so they change what the model computes."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(MODEL)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # keep the deltas small: the outputs change, the model stays a language model
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.mul_(0.05)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for i, (name, targets) in enumerate(TARGETS.items()):
        out[name] = tmp_path_factory.mktemp(f"adapter-{name}")
        peft_model(targets, seed=i).save_pretrained(out[name])
    return out


@pytest.fixture(scope="module")
def engine(adapters):
    eng = Engine(MODEL, kv_cache_mb=2).start()
    for name, path in adapters.items():
        ad = eng.model.adapters.load_dir(name, path)
        eng.call(lambda ad=ad: eng.model.adapters.install(ad)).result(timeout=30)
    yield eng
    eng.stop()


def request(prompt: list[int], lora: str | None, **kw) -> Request:
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    return Request(list(prompt), sp, return_logprob=True, lora=lora, **kw)


def test_served_adapter_matches_peft_forward(engine) -> None:
    """Prompt log-probs under each adapter equal PEFT's own forward of base + adapter (fp32, 1e-5)."""
    for i, (name, targets) in enumerate(TARGETS.items()):
        ref = peft_model(targets, seed=i)
        for prompt in PROMPTS:
            (r,) = engine.generate([request(prompt, name, logprob_start_len=0)], timeout=60)
            with torch.no_grad():
                lp = torch.log_softmax(ref(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
            want = lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(r.input_logprobs[1:]), want, atol=1e-5, rtol=0)
            (base,) = engine.generate([request(prompt, None, logprob_start_len=0)], timeout=60)
            assert max(abs(x - y) for x, y in zip(base.input_logprobs[1:], r.input_logprobs[1:])) > 1e-3


def test_mixed_adapter_batch_equals_each_alone(engine) -> None:
    """One batch of adapter a, adapter b and base requests: each gets what its adapter gives served alone."""
    mix = [(p, lora) for p in PROMPTS for lora in ("a", None, "b")]
    alone = [engine.generate([request(p, lora)], timeout=60)[0] for p, lora in mix]
    steps = engine.stats["steps_total"]
    together = engine.generate([request(p, lora) for p, lora in mix], timeout=60)
    assert engine.stats["steps_total"] - steps <= 9  # one batch (8 new tokens, the prefill among them), not 9 runs
    for (p, lora), one, many in zip(mix, alone, together):
        assert many.output_ids == one.output_ids, (p, lora)
        torch.testing.assert_close(
            torch.tensor(many.output_logprobs), torch.tensor(one.output_logprobs), atol=1e-5, rtol=0
        )
    assert len({tuple(r.output_ids) for r in alone[:3]}) > 1  # the adapters really differ from the base


def test_http_load_generate_unload(engine, adapters) -> None:
    with ServerThread(engine, admin_token=TOKEN) as srv:
        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = httpx.post(srv.url + "/generate", json={**body, "lora_path": "nope"}, timeout=30)
        assert r.status_code == 400 and "lora_path" in r.text and "nope" in r.text
        r = httpx.post(srv.url + "/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["a"])})
        assert r.status_code == 401  # changes what the engine serves: admin token
        load = {"lora_name": "c", "lora_path": str(adapters["a"])}
        r = httpx.post(srv.url + "/load_lora_adapter", json=load, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["loaded_adapters"]["c"] == str(adapters["a"])
        r = httpx.post(srv.url + "/load_lora_adapter", json=load, headers=AUTH, timeout=30)
        assert r.status_code == 400 and "lora_name" in r.text and "already loaded" in r.text
        r = httpx.post(srv.url + "/load_lora_adapter", json={"lora_name": "d", "lora_path": "/no/such"}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        via_c = httpx.post(srv.url + "/generate", json={**body, "lora_path": "c"}, timeout=30).json()
        via_a = httpx.post(srv.url + "/generate", json={**body, "lora_path": "a"}, timeout=30).json()
        assert via_c["output_ids"] == via_a["output_ids"]
        assert sorted(httpx.get(srv.url + "/get_model_info").json()["lora_adapters"]) == ["a", "b", "c"]
        r = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "c"}, headers=AUTH, timeout=30)
        assert r.status_code == 200 and "c" not in r.json()["loaded_adapters"]
        r = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "c"}, headers=AUTH, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        r = httpx.post(srv.url + "/generate", json={**body, "lora_path": "c"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_hf_fallback_refuses_adapters_naming_the_field() -> None:
    eng = Engine(MODEL, kv_cache_mb=1, backend="hf").start()
    try:
        with ServerThread(eng, admin_token=TOKEN) as srv:
            body = {"input_ids": [5, 6], "lora_path": "a", "sampling_params": {"max_new_tokens": 1}}
            r = httpx.post(srv.url + "/generate", json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path" and "native" in r.text
    finally:
        eng.stop()
