"""examples/own_model/run.sh as a user runs it: a local Mistral-family directory, `tito check`, a short train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)  # a model build, a tito check and a 2-step debug run: ~1 min quiet
def test_the_own_model_example_checks_the_template_and_trains(tmp_path):
    furlong = Path(sys.executable).parent / "furlong"
    env = {**os.environ, "OUT": str(tmp_path), "FURLONG": str(furlong)}
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "own_model" / "run.sh")], env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "model" / "furlong_model.json").read_text())["arch"] == "mistral"
    assert "PASS: the template continues token-in-token-out" in proc.stdout
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows if "rollout/reward_mean" in r] == [1, 2]
    assert (tmp_path / "run" / "config.yaml").read_text().count(str(tmp_path / "model")) == 1  # model.path used
