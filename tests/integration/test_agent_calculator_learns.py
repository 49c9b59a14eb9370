"""The shortened calculator recipe: a tiny model's reward rises through agentic RL on the real system.

`recipes/agent_calculator.yaml` with fewer steps and a tiny model, run as `furlong train`
would run it: Ray, router, engine process, trainer actor, weight sync, and every sample
an episode of the built-in OpenAI-API tool agent on a TITO session. The warm-up is SFT
on calculator conversations of which half skip the tool (and are wrong); GRPO,
rewarded only for correct answers, must raise the reward: the mean of the last steps'
`rollout/reward_mean` must beat the first steps' by a margin.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from furlong.envs.calculator import write_demonstrations

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "agent_calculator.yaml"
SHORT = ["model.size=tiny", "train.lr=3e-3", "train.sft_steps=120", "train.total_steps=12",
         "rollout.rollout_batch_size=4", "data.n_eval=16", "rollout.eval_every=0"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_calculator_reward_rises(tmp_path):
    demos = write_demonstrations(tmp_path / "demos.jsonl", 2000, seed=0, flawed=0.5)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "furlong.cli", "train", str(RECIPE), f"run_dir={run_dir}", f"data.sft_path={demos}",
           *SHORT]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [s["rollout/reward_mean"] for s in steps if "rollout/reward_mean" in s]
    assert len(rewards) == 12
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.1, f"reward did not rise: {rewards}"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 12 and result["rollout_stats"]["generate_errors"] == 0
    assert result["after"]["eval/mean_reward"] >= result["before"]["eval/mean_reward"]
