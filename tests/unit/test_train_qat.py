"""INT4 QAT (`train.qat=int4`): the trainer computes with exactly the weights an INT4 rollout would use.

Checked bit for bit against `furlong.weights.quant` (the rollout side's quantiser and `QuantLinear`): the
fake-quantised weight, the forward, the straight-through gradient, and the weights sent at sync (on the INT4
grid: re-quantising them gives the same codes and scales). World size 2 runs in two gloo processes.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from furlong.config.schema import AlgoConfig, LoraConfig, TrainConfig
from furlong.core.net import free_port
from furlong.core.sample import Sample
from furlong.models import create_model
from furlong.train import dist
from furlong.train.qat import Int4QATLinear, apply_qat, fake_int4, int4_ste
from furlong.train.trainer import Trainer
from furlong.weights.quant import quantize, quantize_model_linears
from furlong.weights.quant.formats import int4_dequantize, int4_quantize

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
MODEL = create_model("qwen3", "tiny")


def _hf(qat: str = "none") -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    apply_qat(model, qat)
    return model


def _roundtrip(w: torch.Tensor) -> torch.Tensor:
    enc = int4_quantize(w.float())
    return int4_dequantize(enc.data, enc.scales, 128, tuple(w.shape), slice(None)).to(w.dtype)


def _samples(seed: int = 0, n: int = 8) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, 500, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        resp = torch.randint(1, 500, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
        s = Sample(index=i, group_index=i // 4, tokens=prompt, reward=float(torch.rand(1, generator=g)))
        s.append(resp, logprobs=(-torch.rand(len(resp), generator=g) * 8).tolist())
        out.append(s)
    return out


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


# ----------------------------------------------------------------------------- the fake quantiser
@pytest.mark.parametrize("shape", [(96, 256), (40, 200), (8, 64)])  # whole groups, ragged, one short group
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_int4_is_dequantize_of_quantize_bit_for_bit(shape, dtype):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    w[0, :] = 0  # an all-zero row: its groups get the clamped scale and decode to exact zeros
    fq = fake_int4(w)
    assert fq.dtype == dtype and torch.equal(fq, _roundtrip(w))
    assert torch.equal(fq, quantize(w, "int4").dequantize())  # the rollout side's QuantizedTensor
    assert not torch.equal(fq, w) and torch.equal(fq[0], torch.zeros_like(fq[0]))
    if dtype == torch.float32:  # on the grid it is idempotent (bf16(q·s) need not be on the fp32 grid)
        assert torch.equal(fake_int4(fq), fq)


def test_non_finite_weights_pass_through():
    w = torch.randn(4, 128)
    w[1, 3], w[2, 5] = float("nan"), float("inf")
    fq = fake_int4(w)
    assert torch.isnan(fq[1, 3]) and fq[2, 5] == float("inf")
    assert torch.equal(fq[3], _roundtrip(w[3:4])[0])  # other rows are untouched by the bad ones


def test_straight_through_gradient():
    w = torch.randn(16, 130, requires_grad=True)
    x = torch.randn(5, 130)
    out = x @ int4_ste(w).T
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(out.detach(), x @ fake_int4(w).T)
    assert torch.equal(w.grad, g.T @ x)  # dL/dW := dL/d fake_int4(W), unchanged


# ----------------------------------------------------------------------------- on the policy
def test_the_qat_layers_are_the_rollout_sides_int4_layers_and_names_do_not_change():
    plain, model = _hf(), _hf()
    names = apply_qat(model, "int4")
    assert names == quantize_model_linears(copy.deepcopy(plain), "int4")
    assert "lm_head" not in names and names and all(type(model.get_submodule(n)) is Int4QATLinear for n in names)
    assert isinstance(model.get_input_embeddings(), nn.Embedding)  # embeddings stay as they are
    assert list(model.state_dict()) == list(plain.state_dict())  # same names: checkpoints, sync, FSDP
    assert apply_qat(model, "int4") == [] and apply_qat(plain, "none") == []  # idempotent; none is a no-op
    with pytest.raises(ValueError, match="train.qat: unknown mode 'int8'"):
        apply_qat(plain, "int8")


def test_a_linear_subclass_is_refused_naming_it():
    class Odd(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Odd(4, 4))
    with pytest.raises(ValueError, match="1 is a Odd, not a plain nn.Linear"):
        apply_qat(model, "int4")


@torch.no_grad()
def test_forward_equals_the_int4_rollout_model_and_a_model_holding_the_dequantised_weights():
    qat, held, rollout = _hf("int4"), _hf(), _hf()
    names = quantize_model_linears(rollout, "int4")  # the INT4 engine's linears (QuantLinear)
    for n in names:
        held.get_submodule(n).weight.copy_(_roundtrip(held.get_submodule(n).weight))
    ids = _batch()["input_ids"]
    logits = qat(ids).logits
    assert torch.equal(logits, held(ids).logits)
    assert torch.equal(logits, rollout(ids).logits)
    assert not torch.equal(logits, _hf()(ids).logits)  # QAT does change the forward


def test_gradient_equals_the_gradient_at_the_fake_quantised_weights():
    qat, held = _hf("int4"), _hf()
    names = [n for n, m in qat.named_modules() if isinstance(m, Int4QATLinear)]
    with torch.no_grad():
        for n in names:
            held.get_submodule(n).weight.copy_(_roundtrip(held.get_submodule(n).weight))
    qat(**_batch()).loss.backward()
    held(**_batch()).loss.backward()
    for n in names:
        assert torch.equal(qat.get_submodule(n).weight.grad, held.get_submodule(n).weight.grad), n
    assert torch.equal(qat.lm_head.weight.grad, held.lm_head.weight.grad)


# ----------------------------------------------------------------------------- in the trainer
def test_a_train_step_moves_the_masters_and_sync_sends_int4_grid_weights():
    tr = Trainer(MODEL, TrainConfig(lr=1e-2, qat="int4"), AlgoConfig(kl_coef=0.1))
    names = {f"{n}.weight" for n, m in tr.policy.named_modules() if isinstance(m, Int4QATLinear)}
    assert tr.ref is not None and all(isinstance(tr.ref.get_submodule(n[:-7]), Int4QATLinear) for n in names)
    samples = _samples()
    # The reference is the initial policy as an INT4 rollout serves it: no KL at the start.
    assert tr.compute_logprobs(samples, "ref") == tr.compute_logprobs(samples)
    before = {k: v.clone() for k, v in tr.policy.state_dict().items()}
    tr.train_step(samples)
    masters = tr.policy.state_dict()
    assert any(not torch.equal(before[n], masters[n]) for n in names)  # the fp32 masters were trained
    synced = dict(tr.state_dict_for_sync())
    assert synced.keys() == masters.keys()
    for name, t in synced.items():
        if name in names:
            assert torch.equal(t, fake_int4(masters[name])), name
            assert not torch.equal(t, masters[name]), name
            again, first = int4_quantize(t), int4_quantize(masters[name])  # re-quantising: the same codes, scales
            assert torch.equal(again.data, first.data) and torch.equal(again.scales, first.scales), name
        else:  # lm_head, embeddings, norms: sent as they are
            assert torch.equal(t, masters[name]), name


def test_lora_with_qat_is_refused_by_the_trainer():
    cfg = TrainConfig(qat="int4", lora=LoraConfig(enabled=True))
    with pytest.raises(ValueError, match="train.qat=int4 with train.lora.enabled=true"):
        Trainer(MODEL, cfg, AlgoConfig())


# ----------------------------------------------------------------------------- world size 2 (FSDP2)
def _worker(out: str, rank: int, world: int) -> None:
    cfg = TrainConfig(world_size=world, backend="gloo", lr=1e-3, micro_batch_tokens=24, qat="int4")
    tr = Trainer(MODEL, cfg, AlgoConfig(), rank=rank, world_size=world)
    metrics = tr.train_step(_samples())
    masters = dict(dist.full_state(tr.policy))
    synced = dict(tr.state_dict_for_sync())
    qat = sorted(f"{n}.weight" for n, m in tr.policy.named_modules() if isinstance(m, Int4QATLinear))
    if rank == 0:
        torch.save({"metrics": metrics, "masters": masters, "synced": synced, "qat": qat}, out)
    dist.close()


def _run(out: Path, rank: int, world: int, port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen([sys.executable, __file__, str(out), str(rank), str(world)], cwd=ROOT, env=env)


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_world_size_two_trains_and_syncs_like_one(tmp_path):
    port = free_port()
    procs = [_run(tmp_path / "ws2.pt", r, 2, port) for r in range(2)]
    _worker(str(tmp_path / "ws1.pt"), 0, 1)  # world size 1 needs no process group: in this process
    for p in procs:
        assert p.wait(timeout=240) == 0, f"worker {p.args} failed"
    one, two = torch.load(tmp_path / "ws1.pt"), torch.load(tmp_path / "ws2.pt")
    assert one["qat"] == two["qat"] and len(one["qat"]) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    for key in ("loss", "grad_norm", "tokens"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], abs=1e-5), key
    for name, w in one["masters"].items():
        torch.testing.assert_close(two["masters"][name], w, rtol=0, atol=1e-5, msg=name)
    for name in two["qat"]:  # sharded masters, gathered, then put on the INT4 grid
        assert torch.equal(two["synced"][name], fake_int4(two["masters"][name])), name


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
