"""The GPU paths on a CUDA machine: engine on the device, CUDA IPC and NCCL weight sync, the trainer on NCCL.

Skipped (with the reason) without CUDA: they have NOT run in this repository yet, since no
session so far had a GPU. `scripts/gpu-check.sh` runs them after its figures. The CPU
halves of the same code are covered by tests/unit/test_engine_device.py,
test_weights_cuda_ipc.py and test_train_device.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a second GPU for the engine rank")
TOKEN = "gpu-test-token"
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [300, 2, 40, 41, 42, 43], [77] * 19]


def _engine_vs_hf(model_dir, dtype: str, tol: float) -> None:
    from transformers import AutoModelForCausalLM

    from furlong.engine.engine import Engine
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams

    eng = Engine(model_dir, dtype=dtype, device="cuda", kv_cache_mb=8, max_running=8, block_size=4).start()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).cuda().eval()
    try:
        assert eng.model.k_pool[0].is_cuda and all(p.is_cuda for p in eng.hf.parameters())
        params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
        reqs = eng.generate([Request(p, params, return_logprob=True) for p in PROMPTS], timeout=300)
    finally:
        eng.stop()
    for p, r in zip(PROMPTS, reqs):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p + r.output_ids], device="cuda")).logits[0].float(), -1)
        for i, t in enumerate(r.output_ids):
            row = lp[len(p) - 1 + i]
            assert row.max().item() - row[t].item() <= tol, (p, i)  # greedy: HF's best, up to a tie
            assert abs(row[t].item() - r.output_logprobs[i]) <= tol, (p, i)


@pytest.mark.timeout(360)
def test_engine_on_cuda_matches_hf_in_fp32(tiny_model_dir):
    _engine_vs_hf(tiny_model_dir, "float32", 1e-3)


@pytest.mark.timeout(360)
def test_engine_on_cuda_matches_hf_in_bf16_within_the_stated_tolerance(tiny_model_dir):
    _engine_vs_hf(tiny_model_dir, "bfloat16", 0.1)


def _serve(model_dir, tmp_path, device: str):
    from furlong.core.net import free_port
    from furlong.core.processes import Command, ManagedProcess, furlong_argv, token_env

    port = free_port()
    argv = furlong_argv("serve", "--model", str(model_dir), "--port", str(port), "--device", device)
    proc = ManagedProcess(
        "engine", Command(argv, token_env(TOKEN)), f"http://127.0.0.1:{port}", str(tmp_path / "e.log")
    )
    return proc.start(300)


def _push(transport: str, url: str, model_dir, **opts) -> None:
    from transformers import AutoModelForCausalLM

    from furlong.core.client import EngineControl
    from furlong.weights.factory import make_sender

    hf = AutoModelForCausalLM.from_pretrained(model_dir).cuda()
    named = [(n, t.detach() + 1e-3) for n, t in hf.state_dict().items()]
    sender = make_sender(transport, bucket_mb=1, verify=True, **opts)  # several buckets
    sender.connect([url], TOKEN)
    try:
        report = sender.push(iter(named), 1)
    finally:
        sender.close()
    assert report.verified and report.buckets > 1
    with EngineControl(url, admin_token=TOKEN) as ctl:
        assert ctl.weight_version() == 1


@pytest.mark.timeout(600)
def test_cuda_ipc_push_into_an_engine_process_is_verified(tiny_model_dir, tmp_path):
    proc = _serve(tiny_model_dir, tmp_path, "cuda")
    try:
        _push("cuda_ipc", proc.url, tiny_model_dir)
    finally:
        proc.stop()


@two_gpus
@pytest.mark.timeout(600)
def test_nccl_broadcast_into_an_engine_on_another_gpu_is_verified(tiny_model_dir, tmp_path):
    proc = _serve(tiny_model_dir, tmp_path, "cuda:1")
    try:
        _push("broadcast", proc.url, tiny_model_dir, backend="nccl")
    finally:
        proc.stop()


@pytest.mark.timeout(600)
def test_trainer_steps_on_cuda_with_nccl_backend_and_checkpointing():
    from furlong.config.schema import TrainConfig
    from furlong.models import create_model
    from furlong.train.trainer import Trainer
    from tests.unit.test_train_trainer import algo, samples

    cfg = TrainConfig(backend="nccl", dtype="bfloat16", gradient_checkpointing=True, lr=1e-3)
    tr = Trainer(create_model("qwen3", "tiny"), cfg, algo(entropy_coef=0.01))
    assert tr.device.type == "cuda" and next(tr.policy.parameters()).is_cuda
    m = tr.train_step(samples(0))
    assert m["grad_norm"] > 0 and all(t.is_cuda for _, t in tr.state_dict_for_sync())
