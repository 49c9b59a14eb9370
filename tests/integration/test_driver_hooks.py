"""The driver calls the reward post-process and after-save plug points (a real short run)."""

import asyncio
import json

import pytest
import ray

from furlong.config import load_config
from furlong.driver.run import Run
from tests.integration import driver_hook_plugins as hooks


def test_reward_post_process_and_after_save_hooks(tmp_path):
    cfg = load_config(
        "recipes/debug.yaml",
        [
            f"run_dir={tmp_path / 'run'}",
            "data.n_eval=2",
            "train.checkpoint_every=1",
            "rollout.reward_post_fn=tests.integration.driver_hook_plugins:shift_rewards",
            "train.after_save=tests.integration.driver_hook_plugins:record_save",
        ],
    )
    hooks.CALLS.clear()
    try:
        result = asyncio.run(Run(cfg).run())
    finally:
        ray.shutdown()
    assert result["steps"] == 2
    trained = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step_0.jsonl").read_text().splitlines()]
    assert [s["reward"] for s in trained] == [0.5 + (s["index"] % 2) / 4 for s in trained]
    saved = [step for step, _ in hooks.CALLS]
    assert saved == [1, 2]  # every checkpoint_every step, then the final save
    assert all((tmp_path / "run" / "checkpoints" / f"step_{n}" / "driver_state.json").exists() for n in saved)


def test_a_raising_loss_fn_reaches_the_trainer_and_the_run_fails_naming_it(tmp_path):
    """The composition root hands `train.loss_fn` to the trainer ranks: its failure stops the run, naming the key."""
    cfg = load_config(
        "recipes/debug.yaml",
        [
            f"run_dir={tmp_path / 'run'}",
            "data.n_eval=1",
            "train.total_steps=1",
            "observe.tensorboard=false",
            "train.loss_fn=tests.integration.driver_hook_plugins:raising_loss",
        ],
    )
    try:
        with pytest.raises(Exception, match=r"train\.loss_fn .*raising_loss.* raised RuntimeError: loss exploded"):
            asyncio.run(Run(cfg).run())
    finally:
        ray.shutdown()
    assert not (tmp_path / "run" / "result.json").exists()
