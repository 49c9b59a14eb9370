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
samples/s = samples trained in the window / window seconds. Each system runs `--runs` times
(default 3) and its median run is reported.

TRL runs twice, with plain `generate` ("TRL GRPOTrainer") and with its transformers
continuous-batching generation ("TRL GRPOTrainer CB"); each ratio is against the faster of
the two. CB's paged cache is sized to the step's sequences (`cb_config`): at its defaults it
takes half of the *host's* RAM on a CPU (12 GB on a 24 GB machine) and every step's attention
masks span the whole cache, which made it 2.2x slower on this work (2.29 vs 4.98 samples/s, one
step each, on the AVX2 EPYC of the round-12 rows). Its generation drops `min_new_tokens` (a logits processor
it does not support), so its responses may end early: the table's `resp len` column shows it.
The machine line (`_machine.header`) is printed first.

`--bf16`: every system in bf16 where it computes — TRL `bf16=True` (autocast), furlong
`train.mixed_precision=bf16` (autocast on its one rank), `engine.dtype=bfloat16` and
`train.micro_batch_tokens=4096` (fewer, fuller micro-batches pay once matmuls are cheap); the
machine line's GEMM peak is then measured in bf16.

`--set KEY=VALUE` adds a furlong setting to both furlong runs (`engine.compile=true`: its
compile falls in the warm-up steps).

    python benchmarks/vs_trl.py [--steps 5] [--runs 3] [--warmup 2] [--threads 2] [--bf16] [--set K=V] [--smoke]

furlong's breakdown adds each mode's engine and trainer compute per step (their timeline spans),
and a bound follows: no sync step is shorter than its trainer's compute, so the faster TRL step
over that compute is the most furlong sync could reach against TRL with rollouts that took no time.

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

import _machine
from rl_bench import Work, breakdown, median_run, run_furlong, shutdown_ray

BF16 = ("train.mixed_precision=bf16", "engine.dtype=bfloat16", "train.micro_batch_tokens=4096")  # furlong, --bf16


def cb_config(work: Work, prompt_tokens: int, page: int = 256) -> dict[str, int]:
    """TRL CB's paged cache for one step: every sequence of the step (its longest prompt plus the response)
    in whole pages of transformers' default size, and the whole step's prefill in one batch."""
    n = work.samples_per_step
    return {
        "page_size": page,
        "num_blocks": n * -(-(prompt_tokens + work.new_tokens) // page),
        "max_batch_tokens": n * prompt_tokens,
    }


def run_trl(work: Work, continuous: bool = False, bf16: bool = False) -> dict[str, float]:
    """TRL 1.16 `GRPOTrainer` on `work`, CPU fp32: transformers `generate` (no vLLM), or with `continuous`
    its transformers continuous-batching generation (`use_transformers_continuous_batching`)."""
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
    tokenizer = AutoTokenizer.from_pretrained(path)
    longest = max(
        len(tokenizer.apply_chat_template(p.prompt, add_generation_prompt=True)["input_ids"]) for p in prompts
    )
    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        args = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=bf16,
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
            use_transformers_continuous_batching=continuous,
            transformers_continuous_batching_config=cb_config(work, longest) if continuous else None,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path),
            reward_funcs=reward,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
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


def measured(r: dict[str, float]) -> str:
    """The median run's samples/s, and every run's (sorted) when there were several: the spread shows drift."""
    runs = r.get("all_samples_per_s", [])
    return f"{r['samples_per_s']:.2f} samples/s" + (
        f" (runs {' '.join(f'{x:.2f}' for x in runs)})" if len(runs) > 1 else ""
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per system")
    ap.add_argument("--runs", type=int, default=3, help="runs per system; the median run is reported")
    ap.add_argument("--warmup", type=int, default=2, help="untimed furlong steps first (TRL: always 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--bf16", action="store_true", help="every system computes in bf16 (see the docstring)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a furlong setting for both furlong runs, e.g. engine.compile=true (repeatable)",
    )
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
    import torch

    _machine.header(torch.bfloat16 if args.bf16 else torch.float32)
    print(
        f"work: qwen3-{work.size}, {'bf16' if args.bf16 else 'fp32'}, {work.prompts} prompts x {work.group} samples x {work.new_tokens} tokens per step, "
        f"lr {work.lr}, {work.warmup} (TRL: 1) warm-up + {work.steps} timed steps, {work.threads} threads; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    runs = 1 if args.smoke else args.runs
    res: dict[str, dict[str, float]] = {}
    try:
        for mode, name in (("sync", "furlong sync"), ("async", "furlong async")):
            extra = (*(BF16 if args.bf16 else ()), *args.set)
            res[name] = median_run(lambda mode=mode, extra=extra: run_furlong(work, mode, extra=extra), runs)
            print(f"  measured {name}: {measured(res[name])}", flush=True)
    finally:
        shutdown_ray()
    # Last: TRL/accelerate set process-wide state furlong should not inherit. Both TRL generation paths run,
    # and the ratios are taken against the faster, so furlong is never compared with a weaker TRL than it has.
    failed: dict[str, str] = {}
    for name, continuous in (("TRL GRPOTrainer", False), ("TRL GRPOTrainer CB", True)):
        try:
            trl = lambda c=continuous: run_trl(replace(work, warmup=1), continuous=c, bf16=args.bf16)
            res[name] = median_run(trl, runs)
            print(f"  measured {name}: {measured(res[name])}", flush=True)
        except Exception as e:  # an option this TRL / transformers build cannot run on CPU: say so, keep going
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            print(f"  {name} failed: {failed[name]}", flush=True)
    trl_names = [n for n in ("TRL GRPOTrainer", "TRL GRPOTrainer CB") if n in res]
    best = max(trl_names, key=lambda n: res[n]["samples_per_s"])
    trl = res[best]["samples_per_s"]
    print(f"\nratios against the faster TRL configuration: {best}")
    print(f"{'system':<20}{'samples/s':>11}{'s/step':>9}{'resp len':>10}{'vs TRL':>9}")
    for name in (*trl_names, "furlong sync", "furlong async"):
        r = res[name]
        print(
            f"{name:<20}{r['samples_per_s']:>11.2f}{r['step_s']:>9.2f}{r['response_len_mean']:>10.1f}"
            f"{r['samples_per_s'] / trl:>8.2f}x"
        )
    for name, why in failed.items():
        print(f"{name:<20} failed: {why}")
    print("\nfurlong per-step time, as its driver logs it:")
    for name in ("furlong sync", "furlong async"):
        print(breakdown(name, res[name]))
    sync = res["furlong sync"]
    print(
        f"a sync step is no shorter than its trainer's compute ({sync['trainer_busy_s']:.2f} s): furlong sync "
        f"could reach {res[best]['step_s'] / sync['trainer_busy_s']:.2f}x {best} with rollouts that took no time"
    )
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
