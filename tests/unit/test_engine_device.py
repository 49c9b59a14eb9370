"""`engine.device`: resolved and refused the same way everywhere; the CPU path is the device path with device=cpu.

No GPU here: `cuda` must fail at start with a message naming the setting (config check,
`Engine(...)`, `furlong serve --device cuda`), and an explicit `device=cpu` engine must give
exactly HF's greedy tokens and log-probs. `tests/gpu/` runs the same comparison on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.config import checks
from furlong.config.schema import Config, ConfigError
from furlong.engine.device import batch_to, resolve_device
from furlong.engine.engine import Engine
from furlong.engine.launch import engine_argv
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen")


def test_auto_and_cpu_resolve_to_the_host_here():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    with pytest.raises(ValueError, match="engine.device .* 'tpu' is not one of"):
        resolve_device("tpu")


@no_cuda
@pytest.mark.timeout(120)
def test_cuda_without_a_gpu_fails_at_start_naming_the_setting(tiny_model_dir, monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"^engine.device=cuda: no CUDA GPU is visible"):
        Engine(tiny_model_dir, device="cuda")
    monkeypatch.setattr(checks, "cuda_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"engine": {"device": "cuda:1"}})
    assert "engine.device" in e.value.fields and "CUDA" in str(e.value)
    from furlong.engine import cli

    with pytest.raises(SystemExit):
        cli.main(["--model", str(tiny_model_dir), "--device", "cuda", "--port", "1"])
    assert "engine.device=cuda: no CUDA GPU is visible" in capsys.readouterr().err


def test_device_reaches_both_backends_command_lines(tiny_model_dir):
    common = dict(model_dir=tiny_model_dir, host="127.0.0.1", port=1, dtype="bfloat16", kv_cache_mb=8, max_running=4)
    common.update(max_context=None, prefix_cache=True, threads=1, admin_token="t")
    builtin = engine_argv("builtin", **common, device="cuda:1")
    assert builtin[builtin.index("--device") + 1] == "cuda:1"
    assert "--device" not in engine_argv("builtin", **common)  # auto: the engine decides
    sglang = engine_argv("sglang", **common, device="cuda:1")
    assert sglang[sglang.index("--device") + 1] == "cuda" and sglang[sglang.index("--base-gpu-id") + 1] == "1"


def test_batch_to_moves_every_tensor_and_keeps_the_rest():
    from furlong.engine.model import Batch, Prefill

    b = Batch(
        input_ids=torch.tensor([1, 2]),
        positions=torch.tensor([0, 1]),
        write_slots=torch.tensor([0, 1]),
        n_decode=0,
        decode_blocks=None,
        decode_lens=None,
        prefills=[Prefill(0, 2, 0, torch.tensor([0, 1]))],
        logit_rows=torch.tensor([1]),
        token_seq=[0, 0],
    )
    moved = batch_to(b, torch.device("meta"))
    assert moved.input_ids.is_meta and moved.prefills[0].ctx_slots.is_meta and moved.logit_rows.is_meta
    assert moved.decode_blocks is None and moved.token_seq == [0, 0] and not b.input_ids.is_meta


@pytest.mark.timeout(180)
def test_explicit_cpu_engine_matches_hf_greedy_and_logprobs(tiny_model_dir):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    eng = Engine(tiny_model_dir, kv_cache_mb=2, max_running=4, block_size=4, device="cpu").start()
    try:
        assert eng.device == torch.device("cpu") and eng.model.k_pool[0].device == torch.device("cpu")
        params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        reqs = eng.generate([Request(p, params, return_logprob=True) for p in prompts], timeout=120)
    finally:
        eng.stop()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert r.output_ids == want[0, len(p) :].tolist()
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p + r.output_ids])).logits[0].float(), dim=-1)
        gap = max(
            abs(lp[len(p) - 1 + i, t].item() - got) for i, (t, got) in enumerate(zip(r.output_ids, r.output_logprobs))
        )
        assert gap < 1e-4
