"""Train-vs-rollout log-prob gap per rollout weight format, with and without INT4 QAT and TIS/MIS.

The rollout side is the real engine: one in-process built-in engine per arm (`Engine(...,
quantization=fmt)`, or `dtype=bfloat16` for the bf16 arm) receives the trainer's weights each step the way
a sync delivers them (`quantize_for_sync`: the sender's codes + scales, loaded by
`Engine.apply_weights` into the engine's quantised store, `furlong/engine/quantized.py`), samples the
responses (temperature 1, seeded per request) and reports their log-probs (`return_logprob`): the engine
computes with its codes + scales (dequantised per block inside each projection, on CPU). lm_head,
embeddings and norms stay fp32, as on a real quantised engine.

The trainer (fp32, `train.qat=none` or `int4`, `algo.correction=none|tis|mis`) then takes a GRPO step on
those samples, and the gap is what its loss hub logs for that step, from the training forward's
log-probs against the rollout's: `mismatch/logprob_abs_diff` (mean over response tokens of
|log pi_train - log pi_rollout|) and `mismatch/kl` (the k3 estimate of KL(pi_rollout || pi_train)); with a
correction, also its `correction/keep_frac` and `correction/ess_ratio` (how much of the batch the
importance weights keep / their effective sample size: what bounds the gap's effect on the update).
Printed: the mean over `--steps` steps.

The model is the locally built qwen3 `--size` (random init), first given `--warmup` steps of
next-token training on a fixed synthetic rule (t_{i+1} = 5 t_i + 3 mod 500, a quarter of the
tokens replaced by random ones) so that its distributions are peaked but not one-hot, as a trained
model's are (a random-init model is near uniform, and every format's gap would look small). The
reward is the fraction of response tokens that follow the rule. Each arm starts from the same
warmed-up weights and draws the same prompts.

    python benchmarks/precision_mismatch.py [--size small] [--steps 3] [--prompts 8] [--samples 4]
                                            [--new-tokens 24] [--warmup 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402

RULE_MOD, RULE_A, RULE_B, VOCAB_LOW = 500, 5, 3, 4  # token ids 4.. are ordinary tokens in the tiny vocab
NOISE = 0.25  # warm-up data: a quarter of the next tokens are random, so the model keeps some entropy
ARMS = (  # (rollout format, train.qat, algo.correction)
    ("fp32", "none", "none"),
    ("bf16", "none", "none"),
    ("fp8", "none", "none"),
    ("mxfp8", "none", "none"),
    ("nvfp4", "none", "none"),
    ("int4", "none", "none"),
    ("int4", "int4", "none"),
    ("nvfp4", "none", "tis"),
    ("int4", "none", "tis"),
    ("int4", "none", "mis"),
)


def rule_next(t: torch.Tensor) -> torch.Tensor:
    return (RULE_A * (t - VOCAB_LOW) + RULE_B) % RULE_MOD + VOCAB_LOW


def rule_sequences(n: int, length: int, gen: torch.Generator, noise: float = 0.0) -> torch.Tensor:
    """Sequences following the rule, each next token replaced by a uniformly random one with prob. `noise`."""
    seq = [torch.randint(VOCAB_LOW, VOCAB_LOW + RULE_MOD, (n,), generator=gen)]
    for _ in range(length - 1):
        rand = torch.randint(VOCAB_LOW, VOCAB_LOW + RULE_MOD, (n,), generator=gen)
        seq.append(torch.where(torch.rand(n, generator=gen) < noise, rand, rule_next(seq[-1])))
    return torch.stack(seq, dim=1)


def warm_up(model_dir: Path, out: Path, steps: int, lr: float = 3e-3) -> float:
    """Next-token training on the rule, saved as an HF model directory; returns the final loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    loss = float("nan")
    for _ in range(steps):
        ids = rule_sequences(16, 24, gen, noise=NOISE)
        out_loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        out_loss.backward()
        opt.step()
        loss = float(out_loss.detach())
    model.save_pretrained(out)
    for f in Path(model_dir).iterdir():  # the tokenizer files: the engine serves this directory
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return loss


def start_engine(warm: Path, fmt: str):
    """The arm's rollout engine: fp32 (fmt fp32), bf16 weights and activations (bf16), or a quantised store."""
    from furlong.engine.engine import Engine

    dtype = "bfloat16" if fmt == "bf16" else "float32"
    quant = fmt if fmt not in ("fp32", "bf16") else "none"
    return Engine(warm, dtype=dtype, kv_cache_mb=32, max_running=64, quantization=quant).start()


def sync(engine, synced: list[tuple[str, torch.Tensor]], fmt: str, version: int) -> None:
    """What a weight sync does: the sender quantises once (codes + scales), the engine loads them as they are."""
    from furlong.weights.quant.payload import quantize_for_sync

    named = dict(quantize_for_sync(synced, fmt) if fmt not in ("fp32", "bf16") else synced)
    engine.call(lambda: engine.apply_weights(named, version)).result(120)


def roll_out(engine, prompts: torch.Tensor, samples: int, new_tokens: int, seed: int) -> list:
    """Sample `samples` responses per prompt on the engine (its own log-probs); one group per prompt."""
    from furlong.core.sample import Sample
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams

    reqs = [
        Request(
            prompts[i // samples].tolist(),
            SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=seed * 1000 + i),
            return_logprob=True,
        )
        for i in range(prompts.shape[0] * samples)
    ]
    out = []
    for i, r in enumerate(engine.generate(reqs, timeout=600)):
        resp = torch.tensor(r.output_ids)
        follows = (resp[1:] == rule_next(resp[:-1])).float().mean()
        s = Sample(index=i, group_index=i // samples, tokens=list(r.prompt_ids), reward=float(follows))
        s.append(r.output_ids, logprobs=r.output_logprobs)
        out.append(s)
    return out


def run_arm(warm: Path, fmt: str, qat: str, correction: str, args: argparse.Namespace) -> dict[str, float]:
    """`args.steps` rollout + train steps; the mean of the loss hub's mismatch metrics over them."""
    from furlong.config.schema import AlgoConfig, TrainConfig
    from furlong.train.trainer import Trainer

    trainer = Trainer(
        warm, TrainConfig(lr=args.lr, qat=qat, micro_batch_tokens=1024), AlgoConfig(correction=correction)
    )
    engine = start_engine(warm, fmt)
    gen = torch.Generator().manual_seed(1)
    rows = []
    try:
        for step in range(args.steps):
            sync(engine, list(trainer.state_dict_for_sync()), fmt, step + 1)
            prompts = rule_sequences(args.prompts, 6, gen)
            batch = roll_out(engine, prompts, args.samples, args.new_tokens, seed=100 + step)
            m = trainer.train_rollout(batch)["metrics"][0]
            rows.append(
                (
                    m["mismatch/logprob_abs_diff"],
                    m["mismatch/kl"],
                    statistics.mean(s.reward for s in batch),
                    m.get("correction/keep_frac", float("nan")),
                    m.get("correction/ess_ratio", float("nan")),
                )
            )
    finally:
        engine.stop()
    abs_diff, kl, reward, keep, ess = (statistics.mean(col) for col in zip(*rows))
    return {"abs_diff": abs_diff, "kl": kl, "reward": reward, "keep": keep, "ess": ess}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=["tiny", "small", "m25"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _machine.header()
    from furlong.models import create_model

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm"
        loss = warm_up(create_model("qwen3", args.size), warm, args.warmup)
        print(f"qwen3 {args.size}: warm-up {args.warmup} steps, final next-token loss {loss:.3f}")
        print(f"{args.steps} steps x {args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens")
        print(
            f"{'rollout':<8} {'train.qat':<10} {'correction':<11} {'mean |dlogp|':>13} {'k3 KL':>10} "
            f"{'reward':>7} {'keep':>6} {'ess':>6}"
        )
        for fmt, qat, corr in ARMS:
            r = run_arm(warm, fmt, qat, corr, args)
            print(
                f"{fmt:<8} {qat:<10} {corr:<11} {r['abs_diff']:>13.2e} {r['kl']:>10.2e} {r['reward']:>7.3f} "
                f"{r['keep']:>6.3f} {r['ess']:>6.3f}",
                flush=True,
            )
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
