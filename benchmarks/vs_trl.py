"""GRPO throughput: TRL's `GRPOTrainer` vs furlong (sync and fully async) on the same work.

Same work for every system: the locally built qwen3 `m25` model (25.7M parameters, fp32),
the same pool of chat prompts from the synthetic `arithmetic` task, 8 prompts per step ×
group size 8 = 64 samples per optimiser step, every completion exactly 64 tokens (TRL:
`min_new_tokens = max_completion_length = 64`; furlong: `ignore_eos` with
`max_new_tokens = 64`), temperature 1, AdamW at the same constant learning rate, grad clip
1.0, no KL term (TRL `beta=0`, furlong `kl_coef=0`), one optimiser step per rollout batch
(TRL: one `[64, T]` micro-batch; furlong: its default packing). The loss reductions differ
(TRL's default `dapo` token mean, furlong GRPO's sample mean) at the same compute.
Both run in this process tree on the same number of cores (`--threads`: TRL's torch threads;
furlong's `cluster.num_cpus`, which its topology divides among engine and trainer).

What is timed (steady state only: untimed warm-up steps first, then `--steps` timed steps):
- TRL (one warm-up step: it generates and trains in turn, so its steps are all alike): from
  the end of the warm-up optimiser step to the end of the last step
  (`TrainerCallback.on_step_end` wall clock), i.e. generation + reward + loss + backward +
  optimiser for each step. Model loading and trainer construction are outside the window.
- furlong (`--warmup` steps, default 2, so the async buffer reaches its steady state): from
  the end of the last warm-up RL step to the end of the last step, from the
  per-step wall clock in the run's `metrics.jsonl`, i.e. rollout + train + weight sync +
  logging. Ray, engine and trainer start-up, eval and the final checkpoint are outside it.
samples/s = samples trained in the window / window seconds.

    python benchmarks/vs_trl.py [--steps 2] [--warmup 2] [--threads 2] [--smoke]

Last line: `RATIO furlong_sync_vs_trl=<x> furlong_async_vs_trl=<y>`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from rl_bench import Work, breakdown, run_furlong, shutdown_ray


def run_trl(work: Work) -> dict[str, float]:
    """TRL 1.16 `GRPOTrainer` on `work`, CPU fp32, transformers `generate` (no vLLM)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from furlong.data.tasks import get_task
    from furlong.models import create_model

    torch.set_num_threads(work.threads)
    task = get_task(work.task)
    prompts = task.make("train", work.n_train, seed=work.seed, chat=True)  # the pool furlong draws from
    data = Dataset.from_list([{"prompt": p.prompt, "label": p.label} for p in prompts])

    def reward(prompts: list[Any], completions: list[Any], label: list[Any], **_: Any) -> list[float]:
        return [task.score(c[-1]["content"] if isinstance(c, list) else c, y) for c, y in zip(completions, label)]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.lengths: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

    path = create_model("qwen3", work.size)
    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        args = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            use_vllm=False,
            activation_checkpointing=False,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_steps=1,
            seed=work.seed,
            per_device_train_batch_size=work.samples_per_step,
            gradient_accumulation_steps=1,
            num_generations=work.group,
            max_completion_length=work.new_tokens,
            generation_kwargs={"min_new_tokens": work.new_tokens},
            temperature=1.0,
            learning_rate=work.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=1.0,
            beta=0.0,
            max_steps=work.warmup + work.steps,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path),
            reward_funcs=reward,
            args=args,
            train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(path),
            callbacks=[clock],
        )
        trainer.train()
    if len(clock.ends) != work.warmup + work.steps:
        raise RuntimeError(f"TRL ran {len(clock.ends)} optimiser steps, expected {work.warmup + work.steps}")
    window = clock.ends[-1] - clock.ends[work.warmup - 1]
    return {
        "samples_per_s": work.steps * work.samples_per_step / window,
        "step_s": window / work.steps,
        "response_len_mean": sum(clock.lengths) / max(1, len(clock.lengths)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="timed steps per system")
    ap.add_argument("--warmup", type=int, default=2, help="untimed furlong steps first (TRL: always 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model, 2x2 samples of 8 tokens, 1 timed step: proves the script runs"
    )
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    work = Work(steps=args.steps, warmup=args.warmup, threads=args.threads, lr=args.lr)
    if args.smoke:
        work = Work(
            size="tiny",
            prompts=2,
            group=2,
            new_tokens=8,
            steps=1,
            warmup=1,
            threads=args.threads,
            lr=args.lr,
            n_train=16,
        )
    print(
        f"work: qwen3-{work.size}, {work.prompts} prompts x {work.group} samples x {work.new_tokens} tokens per step, "
        f"lr {work.lr}, {work.warmup} (TRL: 1) warm-up + {work.steps} timed steps, {work.threads} threads; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    res: dict[str, dict[str, float]] = {}
    try:
        for mode, name in (("sync", "furlong sync"), ("async", "furlong async")):
            res[name] = run_furlong(work, mode)
            print(f"  measured {name}: {res[name]['samples_per_s']:.2f} samples/s", flush=True)
    finally:
        shutdown_ray()
    res["TRL GRPOTrainer"] = run_trl(
        replace(work, warmup=1)
    )  # last: TRL/accelerate set process-wide state furlong should not inherit
    print(f"  measured TRL: {res['TRL GRPOTrainer']['samples_per_s']:.2f} samples/s", flush=True)

    trl = res["TRL GRPOTrainer"]["samples_per_s"]
    print(f"\n{'system':<18}{'samples/s':>11}{'s/step':>9}{'resp len':>10}{'vs TRL':>9}")
    for name in ("TRL GRPOTrainer", "furlong sync", "furlong async"):
        r = res[name]
        print(
            f"{name:<18}{r['samples_per_s']:>11.2f}{r['step_s']:>9.2f}{r['response_len_mean']:>10.1f}{r['samples_per_s'] / trl:>8.2f}x"
        )
    print("\nfurlong per-step time, as its driver logs it:")
    for name in ("furlong sync", "furlong async"):
        print(breakdown(name, res[name]))
    load = os.getloadavg()[0]
    print(
        f"\nload average {load:.1f} on {os.cpu_count()} cores"
        + (" - other work shared the CPU; these figures understate every system" if load > args.threads + 0.5 else "")
    )
    print(
        f"RATIO furlong_sync_vs_trl={res['furlong sync']['samples_per_s'] / trl:.2f} "
        f"furlong_async_vs_trl={res['furlong async']['samples_per_s'] / trl:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
