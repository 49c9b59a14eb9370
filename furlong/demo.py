"""`furlong demo`: one command to a model that visibly learns, on a laptop CPU.

It runs `recipes/demo.yaml` through the real system — Ray, router, engine
process, FSDP2 trainer actor, shared-memory weight sync, fully async GRPO — and
prints held-out accuracy before and after RL. The warm-up data is deliberately
imperfect (half the demonstrations copy instead of reverse; see the recipe), so
the gain measured is what RL with a verifier adds over SFT on flawed demos.

The last line is machine-readable:
    RESULT baseline_accuracy=<float> final_accuracy=<float> steps=<int> minutes=<float>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo.yaml"


def write_demonstrations(path: Path, n: int, seed: int, flawed: float = 0.5, difficulty: int = 1) -> Path:
    """Reverse-task demonstrations; a `flawed` fraction copies the string instead of reversing it."""
    from furlong.data import TASKS

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p in TASKS["reverse"].make("train", n, seed=seed + 7, difficulty=difficulty):
            original = p.metadata["question"].split()[-1].rstrip(".")
            response = f" {original}" if rng.random() < flawed else f" {p.label}"
            f.write(json.dumps({"prompt": p.prompt, "response": response, "task": "reverse"}) + "\n")
    return path


def main(argv: list[str]) -> int:
    from furlong.config import load_config
    from furlong.driver.run import Run

    p = argparse.ArgumentParser(prog="furlong demo", description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted overrides of recipes/demo.yaml, e.g. train.total_steps=10")
    p.add_argument("--run-dir", default=None, help="where the run is written (default: runs/demo-<time>)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    run_dir = args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    demos = write_demonstrations(Path(run_dir) / "demonstrations.jsonl", n=6000, seed=0)
    cfg = load_config(
        str(RECIPE), [f"run_dir={run_dir}", f"data.sft_path={demos}", "data.metadata_keys=[task]", *args.overrides]
    )
    result = asyncio.run(Run(cfg).run())
    before = result["before"].get("eval/greedy_accuracy", float("nan"))
    after = result["after"].get("eval/greedy_accuracy", float("nan"))
    minutes = (time.perf_counter() - t0) / 60
    print(
        f"held-out greedy accuracy: {before:.3f} after SFT on flawed demos -> {after:.3f} after {result['steps']} "
        f"async GRPO steps ({minutes:.1f} min); run directory: {run_dir}"
    )
    print(
        f"RESULT baseline_accuracy={before:.4f} final_accuracy={after:.4f} steps={result['steps']} minutes={minutes:.2f}"
    )
    return 0
