"""Agent turns on the engine: steps with prompt chunks run eagerly vs over the decode rows (`engine/mixed_step.py`).

Why: in agent work a step that decodes nearly always also takes in a turn just back from its tool (a few tool
tokens after a cached context). With `engine.compile` such mixed steps run over the decode rows, compiled; before,
they ran the eager forward, and the chunk's context was gathered into a decode row once more the next step.
This runs the environment-latency work of `async_speedup.py --env-latency` against an in-process engine (no
HTTP, no trainer): `--episodes` episode threads a batch, each `--turns` turns of 13 new tokens (temperature 1,
eos ignored, so every system does the same token work) with a tool call of 100-300 ms and 4 tool tokens
between turns. Both configurations compile their steps; the eager one only routes mixed steps to the eager
forward (`mixed_step.MAX_CHUNK = 0`). Each configuration runs in its own process (same process tree, in
rounds, so the machine's drift meets both), a warm-up batch first (the compiles), then `--batches` timed
ones; per configuration the median of `--runs` runs of: wall time per batch, engine seconds in steps with a
prompt chunk, and in decode-only steps.

    python benchmarks/agent_turns.py [--runs 3] [--episodes 64] [--batches 3] [--size small]

Last line: `RATIO rows_vs_eager_wall=<x> rows_vs_eager_prefill_steps=<y>` (eager over rows: above 1 means the
mixed steps over rows are faster).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402

MODES = ("eager", "rows")


def child(mode: str, size: str, episodes: int, turns: int, batches: int) -> dict[str, float]:
    """One configuration in this process: the engine, a warm-up batch, then timed batches."""
    from furlong.engine import mixed_step
    from furlong.engine.engine import Engine
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams
    from furlong.models import create_model

    if mode == "eager":
        mixed_step.MAX_CHUNK = 0  # no chunk fits: every step with a prompt runs the eager forward
    eng = Engine(str(create_model("qwen3", size)), kv_cache_mb=256, compile_decode=True).start()
    steps: list[tuple[float, bool]] = []
    step = eng._step

    def timed() -> None:
        t0, with_prompt = time.perf_counter(), bool(eng.waiting)
        step()
        steps.append((time.perf_counter() - t0, with_prompt))

    eng._step = timed  # the scheduler thread calls it each step

    def episode(seed: int, toks: list[int]) -> None:
        rng = random.Random(seed)
        for turn in range(turns):
            params = SamplingParams(max_new_tokens=13, temperature=1.0, ignore_eos=True)
            r = Request(list(toks), params)
            eng.generate([r], timeout=300)
            toks = toks + r.output_ids
            if turn < turns - 1:
                time.sleep(rng.uniform(0.1, 0.3))  # the tool call
                toks = toks + toks[:4]  # its answer: 4 tool tokens

    def batch(k: int) -> float:
        prompts = [[1] + [(7 * i + 3 * j) % 300 + 5 for j in range(13 + i % 4)] for i in range(episodes)]
        threads = [threading.Thread(target=episode, args=(k * 1000 + i, p)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    try:
        batch(0)  # warm-up: both steps compile here
        steps.clear()
        walls = [batch(k) for k in range(1, batches + 1)]
    finally:
        eng.stop()
    prompt_s = sum(d for d, p in steps if p) / batches
    decode_s = sum(d for d, p in steps if not p) / batches
    mixed = eng.graphs.mixed_steps if eng.graphs is not None else 0
    return {"wall_s": statistics.median(walls), "prefill_s": prompt_s, "decode_s": decode_s, "mixed_steps": mixed}


def run_child(mode: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--size", args.size]
    cmd += ["--episodes", str(args.episodes), "--turns", str(args.turns), "--batches", str(args.batches)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if out.returncode != 0:
        raise SystemExit(f"agent_turns: the {mode} run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per configuration; the median is reported")
    ap.add_argument("--episodes", type=int, default=64, help="episode threads a batch")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--batches", type=int, default=3, help="timed batches per run (after one warm-up batch)")
    ap.add_argument("--size", default="small", help="furlong.models size of the qwen3 model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(child(args.child, args.size, args.episodes, args.turns, args.batches)))
        return 0
    import torch

    _machine.header(torch.float32)
    print(f"work: qwen3-{args.size}, {args.episodes} episodes x {args.turns} turns a batch, {args.threads} threads")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(max(1, args.runs)):  # in rounds: the machine's drift meets both configurations alike
        for mode in MODES:
            runs[mode].append(run_child(mode, args))
            print(f"  measured {mode}: {runs[mode][-1]}", flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    if med["eager"]["mixed_steps"] or not med["rows"]["mixed_steps"]:
        raise SystemExit(f"agent_turns: the configurations did not run as intended: {med}")
    print(f"\n{'mixed steps':<14}{'wall s/batch':>14}{'engine s in steps with a prompt':>33}{'decode-only s':>15}")
    for m in MODES:
        print(f"{m:<14}{med[m]['wall_s']:>14.2f}{med[m]['prefill_s']:>33.2f}{med[m]['decode_s']:>15.2f}")
    wall = med["eager"]["wall_s"] / med["rows"]["wall_s"]
    prefill = med["eager"]["prefill_s"] / max(1e-9, med["rows"]["prefill_s"])
    print(_machine.load_line(args.threads))
    print(f"RATIO rows_vs_eager_wall={wall:.2f} rows_vs_eager_prefill_steps={prefill:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
