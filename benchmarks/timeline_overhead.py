"""Timeline overhead: what recording every worker's spans costs a `recipes/debug.yaml` step.

Two measurements, because the cost is far below a shared machine's run-to-run noise:

1. **Accounted cost** (the number that matters): one real `furlong train recipes/debug.yaml` run
   (sync; Ray, trainer ranks, engines, router) with the spans on. From its event store: spans
   recorded per step, how long the driver's loop waited on the background pull per step
   (`time/timeline_blocked_s`; the pull itself, `time/timeline_pull_s`, runs while the next step
   generates) and the step time (`time/step_s`). Each span's recording cost is measured here
   in-process (`SpanRecorder.record`, with and without folding). Overhead = (time blocked + spans
   × cost per span) / step time: what lengthens a step. The pull's own CPU time is not in it; on
   a machine with spare cores it overlaps generation, on a saturated 2-core one it competes.
2. **Side by side** (a sanity check): the same run with `FURLONG_SPANS=0` (every recorder off;
   the pulls still run and return nothing), median step times compared. Expect noise of ±20 %.

    python benchmarks/timeline_overhead.py [--steps 6] [--engines 2] [--ranks 2] [--no-compare]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def record_cost(n: int = 200_000) -> dict[str, float]:
    """Seconds per `SpanRecorder.record`, a plain span and a folded scheduler step."""
    from furlong.core.spans import SpanRecorder

    out = {}
    for merge in (False, True):
        rec, t = SpanRecorder(capacity=n), time.time()
        t0 = time.perf_counter()
        for i in range(n):
            rec.record("engine", "decode", t + i * 1e-4, t + i * 1e-4 + 5e-5, merge=merge, tokens=4, steps=1, batch=4)
        out["merged" if merge else "plain"] = (time.perf_counter() - t0) / n
    return out


def run(run_dir: Path, a: argparse.Namespace, spans: bool) -> dict[str, float]:
    args = [
        str(ROOT / "recipes" / "debug.yaml"),
        f"run_dir={run_dir}",
        "rollout.mode=sync",
        f"train.total_steps={a.steps}",
        f"engine.num_engines={a.engines}",
        f"train.world_size={a.ranks}",
        "observe.tensorboard=false",
        "train.checkpoint_every=0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FURLONG_SPANS": "1" if spans else "0"}
    done = subprocess.run(
        [sys.executable, "-m", "furlong.cli", "train", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    with closing(sqlite3.connect(run_dir / "events.sqlite")) as db:
        metric = dict(
            (name, [v for (v,) in db.execute("SELECT value FROM metrics WHERE name = ? AND step > 1", (name,))])
            for name in ("time/step_s", "time/timeline_pull_s", "time/timeline_blocked_s")
        )
        n_spans = db.execute("SELECT COUNT(*) FROM spans WHERE step > 1 AND step <= ?", (a.steps,)).fetchone()[0]
    return {
        "step_s": statistics.median(metric["time/step_s"]),
        "pull_s": statistics.median(metric["time/timeline_pull_s"]) if metric["time/timeline_pull_s"] else 0.0,
        "blocked_s": statistics.median(metric["time/timeline_blocked_s"]) if metric["time/timeline_blocked_s"] else 0.0,
        "spans_per_step": n_spans / max(1, a.steps - 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--no-compare", action="store_true", help="skip the side-by-side run with FURLONG_SPANS=0")
    a = p.parse_args()
    cost = record_cost()
    with tempfile.TemporaryDirectory() as tmp:
        on = run(Path(tmp) / "on", a, spans=True)
        off = None if a.no_compare else run(Path(tmp) / "off", a, spans=False)
    recording = on["spans_per_step"] * cost["plain"]
    overhead = (on["blocked_s"] + recording) / on["step_s"]
    result = {
        "record_us": {k: v * 1e6 for k, v in cost.items()},
        "spans_per_step": on["spans_per_step"],
        "pull_ms_per_step": on["pull_s"] * 1e3,
        "blocked_ms_per_step": on["blocked_s"] * 1e3,
        "step_s": on["step_s"],
        "overhead_accounted": overhead,
    }
    if off is not None:
        result["step_s_spans_off"] = off["step_s"]
        result["ratio_on_off"] = on["step_s"] / off["step_s"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
