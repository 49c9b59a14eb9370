"""One trainer's RL step alone (no engine, no Ray): the work `vs_trl.py`'s furlong rows give the trainer.

The same GRPO work as `rl_bench.Work`: the locally built qwen3 `m25` model (25.7M parameters,
fp32), 64 samples per optimiser step (8 prompts x 8), prompts of 12-16 tokens, every response
exactly 64 tokens, one optimiser step per rollout batch, no KL. Samples are synthetic (random
token ids, random rewards): the trainer's cost does not depend on what the tokens say.

What is timed: `Trainer.train_rollout` (old-logprob pass if any, advantages, forward + backward
of every micro-batch, clip, AdamW) for `--steps` steps after one untimed warm-up step; the
median step is reported (`--profile`: a torch.profiler top-10 of one more, untimed step). One row
per `--budgets` value (`train.micro_batch_tokens`). The roofline counts every processed token
(prompt + response), forward and backward (3 x the forward's 2·params FLOPs per token,
`furlong.train.mfu`), against this run's GEMM peak (in bf16 with `--set mixed_precision=bf16`: the
matmuls' dtype).

The same script runs against an older tree (`PYTHONPATH=<old tree>`) to measure a change, or
against other settings in the same run: `--against KEY=VALUE` (repeatable) runs every budget a
second time with those settings on top of `--set`, the two configurations in rounds (`--runs`,
each once per round: this machine's speed drifts over minutes) and each one's median run reported,
and prints the step-time ratio `against / this`.

    python benchmarks/trainer_step.py [--steps 5] [--budgets 512,2048] [--threads 2] [--size m25]
        [--set KEY=VALUE] [--against KEY=VALUE] [--runs 3] [--profile]

Last line: `RATIO trainer_of_roofline=<x>` (the first budget's row), with `speedup_vs_against=<y>`
(its step-time ratio) when `--against` is given.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import time

import _machine


def make_samples(n: int, new_tokens: int, seed: int = 0) -> list:
    from furlong.core.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = Sample(index=i, group_index=i // 8, tokens=[rng.randrange(1, 500) for _ in range(rng.randint(12, 16))])
        s.append([rng.randrange(1, 500) for _ in range(new_tokens)], logprobs=[-6.0] * new_tokens)
        s.reward = float(rng.random() < 0.5)
        out.append(s)
    return out


def run(
    size: str, budget: int, steps: int, n: int, new_tokens: int, extra: dict, profile: bool = False
) -> dict[str, float]:
    import torch

    from furlong.config.schema import AlgoConfig, TrainConfig
    from furlong.models import create_model
    from furlong.train import mfu
    from furlong.train.trainer import Trainer

    path = create_model("qwen3", size)
    trainer = Trainer(path, TrainConfig(lr=1e-5, global_batch_size=n, micro_batch_tokens=budget, **extra), AlgoConfig())
    times = []
    for step in range(steps + 1):
        batch = make_samples(n, new_tokens, seed=step)
        t0 = time.perf_counter()
        trainer.train_rollout(batch)
        if step:  # the first step is the warm-up
            times.append(time.perf_counter() - t0)
    if profile:  # one more step, untimed: the profiler's own cost stays out of the figures
        _machine.profile_top10(
            functools.partial(trainer.train_rollout, make_samples(n, new_tokens, steps + 1)), "one step"
        )
    tokens = sum(len(s.tokens) for s in batch)
    per_token = mfu.forward_flops_per_token(trainer.policy.config.to_dict())
    step_s = statistics.median(times)
    del trainer
    torch.manual_seed(0)
    gflops = 3 * per_token * tokens / step_s / 1e9
    return {"step_s": step_s, "tokens": tokens, "gflops": gflops, "samples_per_s": n / step_s}


def settings(items: list[str]) -> dict:
    """`KEY=VALUE` strings as TrainConfig keyword arguments (true / false as booleans)."""
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        out[k] = {"true": True, "false": False}.get(v, v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budgets", default="512", help="comma-separated train.micro_batch_tokens values")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", default="m25")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], help="extra TrainConfig field=value (e.g. compile=true)")
    ap.add_argument("--against", action="append", default=[], help="field=value of a second configuration")
    ap.add_argument("--runs", type=int, default=1, help="runs of each configuration (in rounds); the median run")
    ap.add_argument(
        "--profile", action="store_true", default=_machine.profiling(), help="torch.profiler top-10 of one more step"
    )
    args = ap.parse_args(argv)
    import torch
    from rl_bench import median_rounds

    import furlong

    torch.set_num_threads(args.threads)
    extra = settings(args.set)
    configs = {"this": extra} | ({"against": {**extra, **settings(args.against)}} if args.against else {})
    # The peak in the dtype the matmuls run in: bf16 under mixed precision (on AMX, about 4x the fp32 peak).
    info = _machine.header(torch.bfloat16 if extra.get("mixed_precision") == "bf16" else torch.float32)
    print(f"furlong from {os.path.dirname(furlong.__file__)}; {args.samples} samples x {args.new_tokens} tokens")
    for name, cfg in configs.items():
        print(f"  {name}: {cfg}")
    print(f"{'budget':>8} {'config':<8}{'s/step':>9}{'tok/s':>9}{'GFLOP/s':>9}{'of peak':>9}")
    first = speedup = None
    for budget in [int(b) for b in args.budgets.split(",")]:
        fns = {
            name: (
                lambda cfg=cfg, budget=budget: run(
                    args.size, budget, args.steps, args.samples, args.new_tokens, cfg, args.profile
                )
            )
            for name, cfg in configs.items()
        }
        rows = median_rounds(fns, args.runs)
        for name, r in rows.items():
            share = r["gflops"] / info["gemm"]["peak"]
            first = share if first is None else first
            print(
                f"{budget:>8} {name:<8}{r['step_s']:>9.2f}{r['tokens'] / r['step_s']:>9.0f}{r['gflops']:>9.1f}"
                f"{share:>8.0%}",
                flush=True,
            )
        if "against" in rows:
            ratio = rows["against"]["step_s"] / rows["this"]["step_s"]
            speedup = ratio if speedup is None else speedup
            per_round = [
                f"{a / b:.2f}"
                for a, b in zip(rows["this"]["round_samples_per_s"], rows["against"]["round_samples_per_s"])
            ]
            print(f"{budget:>8} against / this: {ratio:.2f}x the step time (rounds {' '.join(per_round)})")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"RATIO trainer_of_roofline={first:.2f}" + (f" speedup_vs_against={speedup:.2f}" if speedup else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
