"""Trainer acceptance across processes: world size 2 ≡ world size 1, and resume ≡ uninterrupted.

Each scenario runs this file as a worker script in fresh processes (two gloo
ranks on 127.0.0.1, or one process that saves and another that loads), so
nothing is shared but the files they write.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from furlong.core.net import free_port

ROOT = Path(__file__).resolve().parents[2]


def algo(**kw):
    from furlong.config.schema import AlgoConfig

    base = dict(
        name="grpo",
        advantage="grpo",
        norm_adv_by_std=True,
        gamma=1.0,
        lam=0.95,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip_c=None,
        ratio_type="token",
        log_ratio_clamp=20.0,
        kl_coef=0.05,
        kl_type="k3",
        kl_in_reward=False,
        entropy_coef=0.01,
        loss_reducer="token_mean",
        reducer_constant=None,
        correction="none",
        correction_level="token",
        correction_mode="truncate",
        correction_low=0.5,
        correction_high=2.0,
        vf_coef=0.5,
        value_clip=0.2,
        distill_mode="advantage",
        distill_coef=1.0,
    )
    base.update(kw)
    return AlgoConfig(**base)


def make_samples(step: int, n: int = 8):
    from furlong.core.sample import Sample

    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i in range(n):
        prompt = torch.randint(1, 500, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        resp = torch.randint(1, 500, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
        lps = (-torch.rand(len(resp), generator=g) * 8).tolist()
        s = Sample(index=i, group_index=i // 4, tokens=prompt, reward=float(torch.rand(1, generator=g)))
        s.append(resp, logprobs=lps)
        out.append(s)
    return out


# ----------------------------------------------------------------------------- workers
def _worker(mode: str, out: str, rank: int, world: int, extra: str) -> None:
    torch.set_num_threads(1)
    from furlong.config.schema import TrainConfig
    from furlong.models import create_model
    from furlong.train import dist
    from furlong.train.trainer import Trainer

    model = create_model("qwen3", "tiny")
    if mode == "ws":
        cfg = TrainConfig(world_size=world, backend="gloo", lr=1e-3, micro_batch_tokens=24, grad_clip=1.0)
        tr = Trainer(model, cfg, algo(), rank=rank, world_size=world, temperature=0.8)
        metrics = [tr.train_step(make_samples(s)) for s in range(2)]
        weights = dict(tr.state_dict_for_sync())
        if rank == 0:
            torch.save({"metrics": metrics, "weights": weights}, out)
        dist.close()  # both ranks leave the group together (an exiting rank must not abort the other)
        return
    # resume scenarios: PPO with a critic, a refreshed reference and a warm-up + cosine schedule
    cfg = TrainConfig(
        lr=2e-3, micro_batch_tokens=40, lr_schedule="cosine", warmup_steps=2, total_steps=6, ref_update_every=2
    )
    tr = Trainer(model, cfg, algo(name="ppo", advantage="gae"), temperature=0.9)
    k, total = 2, 4
    if mode == "second":
        tr.load(extra)
        assert tr.step == k
    steps = range(0, total) if mode == "full" else range(0, k) if mode == "first" else range(k, total)
    metrics = [tr.train_step(make_samples(s)) for s in steps]
    if mode == "first":
        tr.save(extra)
        return
    torch.save(
        {
            "metrics": metrics,
            "weights": dict(tr.state_dict_for_sync()),
            "critic": {k: v.clone() for k, v in tr.critic.state_dict().items()},
            "rand": torch.rand(3),
        },
        out,
    )


def _run(mode: str, out: Path, rank: int = 0, world: int = 1, extra: str = "", port: int = 0) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()))
    cmd = [sys.executable, __file__, mode, str(out), str(rank), str(world), extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def _wait(*procs: subprocess.Popen) -> None:
    for p in procs:
        assert p.wait(timeout=240) == 0, f"worker {p.args} failed"


@pytest.mark.timeout(540)
def test_world_size_two_equals_one(tmp_path: Path) -> None:
    port = free_port()
    ranks = [_run("ws", tmp_path / "ws2.pt", r, 2, port=port) for r in range(2)]
    _wait(*ranks)
    _wait(_run("ws", tmp_path / "ws1.pt"))
    one, two = torch.load(tmp_path / "ws1.pt"), torch.load(tmp_path / "ws2.pt")
    for m1, m2 in zip(one["metrics"], two["metrics"]):
        for key in ("loss", "grad_norm", "loss/policy", "loss/kl", "policy/entropy", "tokens"):
            assert m1[key] == pytest.approx(m2[key], abs=1e-5), key
    assert one["metrics"][1]["loss/kl"] > 0  # the reference is really used
    assert one["weights"].keys() == two["weights"].keys()
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=0, atol=1e-5, msg=name)
    from transformers import AutoModelForCausalLM

    from furlong.models import create_model

    base = AutoModelForCausalLM.from_pretrained(create_model("qwen3", "tiny")).state_dict()
    assert any(not torch.equal(base[n], w) for n, w in one["weights"].items())


@pytest.mark.timeout(780)
def test_resume_in_new_process_is_exact(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    full = _run("full", tmp_path / "full.pt")
    _wait(full)
    _wait(_run("first", tmp_path / "unused", extra=str(ckpt)))
    _wait(_run("second", tmp_path / "resumed.pt", extra=str(ckpt)))
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    clocks = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # MFU, tokens/s: wall-clock rates
    for m_full, m_resumed in zip(a["metrics"][2:], b["metrics"]):
        assert clocks(m_full) == clocks(m_resumed)  # every loss part, grad norm, lr: bit-identical
    for part in ("weights", "critic"):
        for name, w in a[part].items():
            assert torch.equal(w, b[part][name]), f"{part}.{name}"
    assert torch.equal(a["rand"], b["rand"])  # the RNG stream continues where it stopped


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")
