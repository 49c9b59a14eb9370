"""What held-out eval costs the training loop: no eval vs `rollout.eval_mode` blocking | async | dedicated.

The same GRPO work through furlong's real driver (Ray, router, engine process, trainer actor, weight
sync; `rl_bench.Work`, sync rollout mode, every response exactly `--tokens` tokens) run four times:
without eval, and with an eval of `--n-eval` held-out prompts (one sampled + one greedy answer each, the
same exact length) at every step in each eval mode. Blocking waits for it; async sends it through the
training router at low priority (`priority=-1`, admitted when rollouts leave room) while training goes
on; dedicated runs it on an engine of its own, synced at each eval step (one more process on the same
cores here: on a cluster it takes its own device). Every process gets `--process-threads` threads in
every mode, so the extra process does not change the others' thread counts.

What is timed: steady-state seconds per step after `--warmup` untimed steps (`rl_bench.steady_state`:
the driver's wall clock from `metrics.jsonl`). The issue's bar: async's step time is not worse than no
eval's by more than the engine share the eval uses (eval tokens / (eval + rollout tokens) per step,
printed as `eval share`). The machine line (`_machine.header`) is printed first.

    python benchmarks/async_eval.py [--steps 5] [--warmup 2] [--size small] [--prompts 4] [--group 4]
        [--tokens 32] [--n-eval 8] [--threads 2] [--process-threads 1] [--runs 1] [--smoke]

Last line: `EVAL_COST blocking=<x> async=<y> dedicated=<z>` (step time / step time without eval).
"""

from __future__ import annotations

import argparse
import os
import sys

import _machine
from rl_bench import Work, run_furlong, shutdown_ray

EVALS = ("none", "blocking", "async", "dedicated")


def eval_overrides(kind: str, n_eval: int) -> tuple[str, ...]:
    if kind == "none":
        return ("rollout.eval_every=0",)
    return (f"rollout.eval_mode={kind}", "rollout.eval_every=1", f"data.n_eval={n_eval}", "rollout.eval_n_samples=1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--runs", type=int, default=1, help="rounds over the modes; each mode's median run is reported")
    ap.add_argument("--size", default="small", choices=("tiny", "small", "m25"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--n-eval", type=int, default=8, help="held-out prompts per eval")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--process-threads",
        type=int,
        default=1,
        help="threads per process, the same in every mode (dedicated adds one)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 timed step: proves the script runs")
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    work = Work(
        size="tiny" if args.smoke else args.size,
        prompts=args.prompts,
        group=args.group,
        new_tokens=args.tokens,
        steps=1 if args.smoke else args.steps,
        warmup=1 if args.smoke else args.warmup,
        threads=args.threads,
        n_train=64,
    )
    share = 2 * args.n_eval / (2 * args.n_eval + work.samples_per_step)  # same length: sequences = tokens
    _machine.header()
    print(
        f"work: qwen3-{work.size}, {work.prompts} prompts x {work.group} samples x {work.new_tokens} tokens per step, "
        f"eval {args.n_eval} prompts x (1 sampled + 1 greedy) every step (eval share {share:.2f} of engine tokens), "
        f"{work.warmup} warm-up + {work.steps} timed steps, {work.threads} threads; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in EVALS}
    try:
        for r in range(args.runs):  # round-robin: a change in the machine's load falls on every mode alike
            for kind in EVALS:
                extra = (*eval_overrides(kind, args.n_eval), f"cluster.threads_per_process={args.process_threads}")
                runs[kind].append(run_furlong(work, "sync", extra=extra))
                shutdown_ray()  # each run sizes its own Ray (dedicated places one more engine bundle)
                print(f"  run {r + 1} {kind}: {runs[kind][-1]['step_s']:.2f} s/step", flush=True)
    finally:
        shutdown_ray()
    res = {kind: sorted(rs, key=lambda x: x["step_s"])[len(rs) // 2] for kind, rs in runs.items()}  # median run
    base = res["none"]["step_s"]
    print(f"\n{'eval':<11}{'s/step':>9}{'vs none':>10}{'samples/s':>11}")
    for kind in EVALS:
        r = res[kind]
        print(f"{kind:<11}{r['step_s']:>9.2f}{r['step_s'] / base:>9.2f}x{r['samples_per_s']:>11.2f}")
    print(f"\nthe bar for async: <= {1 + share:.2f}x (1 + eval share {share:.2f})")
    print(_machine.load_line(args.threads))
    print("EVAL_COST " + " ".join(f"{k}={res[k]['step_s'] / base:.2f}" for k in EVALS[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
