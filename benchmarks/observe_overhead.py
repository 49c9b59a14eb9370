"""Event-store overhead: the same short `furlong train` run with `observe.event_store` on and off, side by side.

Each run is a real `furlong train` subprocess (Ray, trainer, engine, router) on the
debug recipe's tiny qwen3 model, in sync mode (the least noisy), with a step
enlarged to `--prompts` × `--samples` samples of `--tokens` new tokens so each step
records a realistic amount: every sample with per-token provenance, ~60 metrics,
the driver's and trainer's spans. "off" is `observe.event_store=false`: the same
calls, no queue, no writer thread, no file (metrics.jsonl is written either way).

What is timed: the driver writes one `metrics.jsonl` line per step, stamped with
the wall clock; a step's time is the gap between its line and the previous one, so
it covers the whole loop (rollout, reward, train, weight sync, recording, eval
when asked). Start-up and the first `--warmup` steps are left out. Runs alternate
off/on (then on/off) to spread machine noise; the medians over all kept steps of
each setting are compared. The tiny model makes a step short (well under a
second), so the store's cost is as large a share of it as it gets: an upper bound
for bigger models.

    python benchmarks/observe_overhead.py [--reps 3] [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PARTS = {"rollout": "time/rollout_wait_s", "train": "time/train_s", "sync": "weight_sync/seconds"}


def run_once(run_dir: Path, store: bool, a: argparse.Namespace) -> tuple[list[float], list[dict]]:
    """One `furlong train` run: the wall time of each step after the warm-up, and those steps' metrics."""
    args = [
        str(ROOT / "recipes" / "debug.yaml"),
        f"run_dir={run_dir}",
        "rollout.mode=sync",
        f"train.total_steps={a.steps}",
        f"rollout.rollout_batch_size={a.prompts}",
        f"rollout.n_samples_per_prompt={a.samples}",
        f"rollout.max_new_tokens={a.tokens}",
        f"observe.event_store={str(store).lower()}",
        "observe.tensorboard=false",
        "train.checkpoint_every=0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    done = subprocess.run(
        [sys.executable, "-m", "furlong.cli", "train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"furlong train failed ({done.returncode}):\n{done.stderr[-4000:]}")
    if (run_dir / "events.sqlite").exists() != store:
        raise SystemExit(
            f"{run_dir}: events.sqlite {'missing' if store else 'written'} with observe.event_store={store}"
        )
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if len(rows) != a.steps:
        raise SystemExit(f"{run_dir}: {len(rows)} metrics lines for {a.steps} steps")
    stamps = [r["time/started_unix"] for r in rows]  # the rows' own `time` is when they were written (later)
    return [b - t for t, b in zip(stamps, stamps[1:])][a.warmup :], rows[a.warmup :]  # step k: start k+1 - start k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="runs per setting (alternating off/on)")
    p.add_argument("--steps", type=int, default=8, help="RL steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    p.add_argument("--prompts", type=int, default=8, help="rollout.rollout_batch_size")
    p.add_argument("--samples", type=int, default=4, help="rollout.n_samples_per_prompt")
    p.add_argument("--tokens", type=int, default=32, help="rollout.max_new_tokens")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if not 1 <= a.warmup < a.steps:
        raise SystemExit("--warmup must be at least 1 and less than --steps")
    times: dict[str, list[float]] = {"off": [], "on": []}
    parts: dict[str, list[dict]] = {"off": [], "on": []}
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                kept, rows = run_once(Path(tmp) / f"{name}-{rep}", name == "on", a)
                times[name] += kept
                parts[name] += rows
                load.append(os.getloadavg()[0])
                print(
                    f"rep {rep} store {name:<3}: median step {statistics.median(kept) * 1e3:7.1f} ms over {len(kept)} steps",
                    flush=True,
                )
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"workload: recipes/debug.yaml (qwen3 tiny), sync, {a.prompts}x{a.samples} samples x {a.tokens} new tokens "
        f"per step, {a.steps} steps ({a.warmup} warm-up) x {a.reps} runs per setting, {a.threads} threads; "
        f"{time.perf_counter() - t0:.0f}s; 1-min load average {min(load):.1f}-{max(load):.1f}"
    )
    for k in ("off", "on"):
        print(
            f"store {k:<3}: median step {med[k] * 1e3:.1f} ms (n={len(times[k])}, "
            f"quartiles {statistics.quantiles(times[k], n=4)[0] * 1e3:.1f}-{statistics.quantiles(times[k], n=4)[2] * 1e3:.1f} ms); "
            + ", ".join(
                f"{part} {statistics.median(r[key] for r in parts[k]) * 1e3:.1f}" for part, key in PARTS.items()
            )
            + " ms"
        )
    print(f"overhead ratio (on/off, median step): {med['on'] / med['off']:.3f}x")


if __name__ == "__main__":
    main()
