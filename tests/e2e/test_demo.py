"""`furlong demo`, shortened: the real command in a subprocess, and RL must raise held-out accuracy.

The full demo (recipes/demo.yaml: 150 SFT steps, 30 fully async GRPO steps, target
+0.20 accuracy in under 10 minutes on 2 cores) is measured by hand, not here. This
run keeps every stage (SFT warm-up on flawed demonstrations, async GRPO through the
router, engine and trainer, greedy eval on held-out strings before and after) with
fewer steps (measured: 1-2 minutes; at load 10, four runs at once, 0.20 -> 0.89-0.91) and a smaller
eval set, and asserts what the demo exists to show: the training reward rises and RL
improves held-out accuracy over the SFT baseline.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import token_holders

ROOT = Path(__file__).resolve().parents[2]
RESULT = re.compile(r"RESULT baseline_accuracy=(\d+\.\d+) final_accuracy=(\d+\.\d+) steps=(\d+) minutes=(\d+\.\d+)")
STEPS = 16  # 12 left too little room: one loaded run that peaked at step 10 and dipped after it ended below baseline


@pytest.mark.slow
@pytest.mark.timeout(700)  # the demo subprocess is given 600 s
def test_short_demo_learns(tmp_path):
    run_dir = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "furlong.cli",
            "demo",
            f"train.total_steps={STEPS}",
            "train.sft_steps=80",
            "data.n_eval=100",
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = RESULT.fullmatch(last)
    assert m, f"last line is not a RESULT line: {last!r}"
    baseline, final, steps = float(m[1]), float(m[2]), int(m[3])
    assert steps == STEPS
    assert final > baseline, f"RL did not improve held-out accuracy: {baseline} -> {final}"
    rewards = [
        json.loads(x)["rollout/reward_mean"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]
    assert len(rewards) == STEPS and sum(rewards[-3:]) > sum(rewards[:3]), f"training reward did not rise: {rewards}"
    token = (run_dir / "admin_token").read_text().strip()
    left = token_holders(token)  # the engines and router get the token in their environment
    assert not left, f"engine/router processes left after the demo: {left}"
