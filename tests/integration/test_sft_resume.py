"""`--resume` of an `algo.name=sft` run: the newest checkpoint's trainer state, data cursor
(`driver_state["sft"]`), step and metric-log state, then on to `train.total_steps`.

The reference trains 4 steps straight; the other trains 2 (its end checkpoint: step 2), then
resumes with `train.total_steps=4`. With a constant LR schedule the two must agree bit for bit:
the final weights, and `metrics.jsonl` row for row (clocks aside). Had the cursor not been
restored, steps 3-4 would retrain the batches of steps 1-2 and the weights would differ; had
the log not been restored, the token counter rows would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_rl_runs import VOLATILE, assert_same_weights, jsonl_rows, weights

pytestmark = pytest.mark.slow  # three short engine-free runs (Ray, one trainer rank each)

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "model.size=tiny",
    "observe.tensorboard=false",
    "data.n_eval=4",
    "train.global_batch_size=4",
    "rollout.rollout_batch_size=4",
    "rollout.eval_every=2",
    "train.checkpoint_every=2",
    "train.checkpoint_every_min=0",
    "train.lr_schedule=constant",
    "train.warmup_steps=0",
    "cluster.threads_per_process=1",
]


def _run(run_dir: Path, steps: int, resume: bool = False) -> dict[str, Any]:
    from furlong.config import load_config
    from furlong.driver.run import Run

    cfg = load_config(
        str(ROOT / "recipes" / "sft_reverse_teacher.yaml"), [*SHORT, f"run_dir={run_dir}", f"train.total_steps={steps}"]
    )
    return asyncio.run(Run(cfg, resume=resume, progress=False).run())


@pytest.mark.timeout(600)
def test_sft_resume_continues_to_the_uninterrupted_weights_and_rows(tmp_path, capfd):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(straight, 4)
    first = _run(resumed, 2)
    assert first["steps"] == 2 and first["before"], first
    capfd.readouterr()
    result = _run(resumed, 4, resume=True)
    said = capfd.readouterr().err
    assert "resumed from" in said and "step_2" in said, said[-2000:]
    assert result["steps"] == 4 and result["before"] == {}, result  # evaluated before step 1 only, by the first

    assert_same_weights(weights(straight, 4), weights(resumed, 4))
    want, got = jsonl_rows(straight), jsonl_rows(resumed)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]

    def steady(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}

    for a, b in zip(want, got):
        assert steady(b) == pytest.approx(steady(a), rel=1e-6, nan_ok=True), f"step {a['step']}:\n{a}\n{b}"
    assert all(any(k.startswith("train/") for k in r) for r in want)
    assert "eval/sft_nll" in want[3] and "eval/sft_nll" in got[3]  # the resumed run's eval at step 4
