"""The async spectrum on the same work: furlong sync vs one-step overlap vs fully async.

Each mode runs the same GRPO work through furlong's real driver (Ray, router, engine process,
trainer actor, weight sync): the qwen3 `m25` model, 8 prompts × group size 8 per step, every
response exactly 64 tokens (`ignore_eos`), one optimiser step per rollout batch, the same
seed, learning rate and core budget (`--threads`, given as `cluster.num_cpus`; the topology
gives engine and trainer every core in sync mode, where they take turns, and splits them
when they run at the same time). Overlap and async run with `max_staleness=1`. `--shared`
adds a row of fully async with the cores time-shared instead (`cluster.share_cores=true`:
every process takes a sync run's threads, the engines at lower priority), on the same work. `--lend`
adds fully async with the cores split but lent (`cluster.lend_idle_cores=true`: the engines compute
with every core while the trainer waits for a batch, with their share while it computes). `--borrow`
adds fully async with the cores split but borrowed (`cluster.borrow_idle_cores=true`: the trainer
computes with every core once the engines have generated the next batch).
`--in-place` adds a twin of each fully async row (`async` and any `--shared` / `--lend` / `--borrow`) whose weight
syncs keep the requests in flight and their KV cache (`engine.pause_mode=in_place`, rows `*_inplace`;
the default, `retract`, recomputes them on the new weights).

What is timed: steady state only. After `--warmup` untimed steps, from the end of the last
warm-up step to the end of the last of `--steps` timed steps, from the per-step wall clock in
each run's `metrics.jsonl` (rollout + train + weight sync + logging); Ray and engine start-up,
eval and the final checkpoint are outside the window. samples/s = samples trained in the
window / window seconds. Each mode runs `--runs` times (default 3), in rounds (every mode once,
then again: the machine's drift over minutes meets every mode alike); the median run is
reported. Async modes prefetch up to their buffer bound, so a short window can flatter them
by at most that much work; the default warm-up of 2 steps lets the buffer settle.

`--env-latency`: the agentic workload async is for — each episode makes 4 tool calls of
100-300 ms between its 5 generation turns (`rl_bench.env_latency_generate`; same policy tokens).
The machine line (`_machine.header`) is printed first.

    python benchmarks/async_speedup.py [--steps 5] [--runs 3] [--warmup 2] [--threads 2] [--size m25]
        [--env-latency] [--shared] [--lend] [--borrow] [--in-place] [--set KEY=VALUE ...] [--smoke]

Each mode's breakdown adds the seconds per step its engines and trainer computed (their timeline
spans), and the sync run gives the time-shared ceiling: sync step / (engine + trainer compute),
the most any overlap can gain where the two take turns on the same cores.

Last line: `SPEEDUP overlap_vs_sync=<x> async_vs_sync=<y>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import _machine
from rl_bench import MODES, Work, breakdown, median_rounds, run_furlong, shutdown_ray

SHARED = ("cluster.share_cores=true",)  # time-shared cores: a sync run's threads each, engines at lower priority
LENT = ("cluster.lend_idle_cores=true",)  # split cores, the trainer's lent to the engines while it waits
BORROWED = ("cluster.borrow_idle_cores=true",)  # split cores, the engines' lent to the trainer once they are idle
IN_PLACE = ("engine.pause_mode=in_place",)  # a weight sync keeps the requests in flight and their KV


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode; the median run is reported")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", default="m25", choices=("tiny", "small", "m25"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model, 2x2 samples of 32 tokens, 2 timed steps: proves the script runs",
    )
    ap.add_argument("--env-latency", action="store_true", help="episodes with 4 tool calls of 100-300 ms each")
    ap.add_argument("--shared", action="store_true", help="also fully async on time-shared cores (share_cores=true)")
    ap.add_argument("--lend", action="store_true", help="also fully async on lent cores (lend_idle_cores=true)")
    ap.add_argument("--borrow", action="store_true", help="also fully async, borrowed cores (borrow_idle_cores=true)")
    ap.add_argument(
        "--in-place",
        action="store_true",
        help="also each fully async row with weight syncs in place (pause_mode=in_place)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a furlong setting for every mode, e.g. engine.compile=true (repeatable)",
    )
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    work = Work(size=args.size, steps=args.steps, warmup=args.warmup, threads=args.threads)
    if args.smoke:
        # two timed steps: every mode then generates a whole batch inside the window (the second step's: in
        # overlap and async it starts once the first is taken), long enough to read on the timeline
        work = Work(size="tiny", prompts=2, group=2, new_tokens=32, steps=2, warmup=1, threads=args.threads, n_train=16)
    if args.env_latency:
        work = dataclasses.replace(work, generate_fn="rl_bench:env_latency_generate")
    # The GEMM peak in the dtype the systems compute in (bf16 when --set asks for it of the trainer or the engines).
    import torch

    half = any(s.endswith(("mixed_precision=bf16", "dtype=bfloat16")) for s in args.set)
    _machine.header(torch.bfloat16 if half else torch.float32)
    print(
        f"work: qwen3-{work.size}, {work.prompts} prompts x {work.group} samples x {work.new_tokens} tokens per step, "
        f"{work.warmup} warm-up + {work.steps} timed steps, {work.threads} threads; workload {work.generate_fn}; "
        f"settings {list(args.set) or 'defaults'}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    given = tuple(args.set)
    rows = [(mode, mode, given) for mode in MODES]
    rows += [("async_shared", "async", (*SHARED, *given))] if args.shared else []
    rows += [("async_lent", "async", (*LENT, *given))] if args.lend else []
    rows += [("async_borrowed", "async", (*BORROWED, *given))] if args.borrow else []
    rows += [(f"{n}_inplace", m, (*IN_PLACE, *x)) for n, m, x in rows if m == "async"] if args.in_place else []
    fns = {name: (lambda mode=mode, extra=extra: run_furlong(work, mode, extra=extra)) for name, mode, extra in rows}
    say = lambda name, r: print(f"  measured {name}: {r['samples_per_s']:.2f} samples/s", flush=True)
    try:
        res = median_rounds(fns, 1 if args.smoke else args.runs, say)
    finally:
        shutdown_ray()
    base = res["sync"]["samples_per_s"]
    print(f"\n{'mode':<22}{'samples/s':>11}{'s/step':>9}{'vs sync':>10}")
    for name in res:
        r = res[name]
        print(f"{name:<22}{r['samples_per_s']:>11.2f}{r['step_s']:>9.2f}{r['samples_per_s'] / base:>9.2f}x")
    if len(res["sync"]["round_samples_per_s"]) > 1:
        print("each round against that round's sync (the spread the medians hide):")
        for name in res:
            pairs = zip(res[name]["round_samples_per_s"], res["sync"]["round_samples_per_s"])
            print(f"  {name:<22}" + " ".join(f"{x / y:.2f}x" for x, y in pairs))
    print("\nper-step time, as the driver logs it (in overlap/async, generation also runs during train):")
    for name in res:
        print(breakdown(name, res[name]))
    print(
        f"time-shared ceiling: the sync step over its engine + trainer compute = {res['sync']['ceiling']:.2f}x "
        "(no overlap of the two can beat it on cores they take turns on)"
    )
    load = os.getloadavg()[0]
    print(
        f"\nload average {load:.1f} on {os.cpu_count()} cores"
        + (" - other work shared the CPU; these figures understate every mode" if load > args.threads + 0.5 else "")
    )
    extra = "".join(
        f" {n}_vs_sync={res[n]['samples_per_s'] / base:.2f}"
        for n in ("async_inplace", "async_shared", "async_lent", "async_shared_inplace", "async_lent_inplace")
        if n in res
    )
    print(
        f"SPEEDUP overlap_vs_sync={res['overlap']['samples_per_s'] / base:.2f} "
        f"async_vs_sync={res['async']['samples_per_s'] / base:.2f}" + extra
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
