"""The trainer fails: SIGKILL with auto-restart, NaN/inf losses, and the stop/restart policy itself."""

from __future__ import annotations

import asyncio
from pathlib import Path

import chaos_plugins
import pytest
import torch
from chaos_run import chaos_config, metrics, run
from safetensors.torch import load_file

from furlong.cluster.trainer_group import TrainerDied
from furlong.driver.restarts import MAX_TRAINER_RESTARTS, RunStopped, check_finite, run_with_restarts

SYNC = ("train.total_steps=4", "train.checkpoint_every=1")


def final_weights(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    from furlong.train.export import export

    export(run_dir / "checkpoints" / "step_4", out)
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_trainer_sigkill_with_auto_restart_ends_with_the_uninterrupted_weights(tmp_path):
    base = run(chaos_config(tmp_path / "base", *SYNC, "rollout.reward_fn=chaos_plugins:varied_reward"))
    assert base["trainer_restarts"] == 0

    async def arm(r):
        chaos_plugins.STATE.clear()
        chaos_plugins.STATE["run"] = r

    killed = run(
        chaos_config(
            tmp_path / "killed",
            *SYNC,
            "cluster.auto_restart=true",
            "rollout.reward_fn=chaos_plugins:trainer_killing_reward",
        ),
        arm,
    )
    assert chaos_plugins.STATE["trainer_killed"] and killed["trainer_restarts"] == 1
    assert killed["steps"] == 4 and killed["rollout_stats"]["balanced"]
    want, got = (
        final_weights(tmp_path / "base", tmp_path / "base_hf"),
        final_weights(tmp_path / "killed", tmp_path / "killed_hf"),
    )
    assert want.keys() == got.keys() and want
    from furlong.models import create_model

    init = {k: v for f in Path(create_model("qwen3", "tiny")).glob("*.safetensors") for k, v in load_file(f).items()}
    assert any(not torch.equal(want[k], init[k]) for k in want if k in init)  # training moved the weights
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, different


def test_nan_loss_is_skipped_with_a_warning_and_n_in_a_row_stop_the_run(tmp_path, capsys):
    run_dir = tmp_path / "nan"
    cfg = chaos_config(
        run_dir,
        "train.total_steps=8",
        "train.max_nonfinite_steps=2",
        "train.before_train_step=chaos_plugins:nan_at_1_and_from_3",
    )
    with pytest.raises(
        RunStopped,
        match=r"NaN/inf in 2 optimiser steps in a row \(train.max_nonfinite_steps=2\), "
        r"at RL step 4",
    ):
        run(cfg)
    rows = {m["step"]: m for m in metrics(run_dir)}
    assert [rows[s]["nonfinite/skipped"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]  # logged after steps 0..3
    assert rows[3]["train/loss"] == rows[3]["train/loss"]  # the finite step in between trained normally
    err = capsys.readouterr().err
    assert "warning: RL step 1: loss or gradient was NaN/inf in 1 optimiser step(s); skipped" in err
    assert 5 not in rows  # stopped: nothing trained after the limit


# ---- the policy, without a topology ---------------------------------------------------------------


class FakeRun:
    """Dies like a trainer would, `deaths` times in all, then finishes."""

    made: list[FakeRun] = []
    deaths = 0

    def __init__(self, cfg, resume=False, progress=False):
        self.cfg, self.resume, self.progress, self.run_dir = cfg, resume, progress, cfg.run_dir
        FakeRun.made.append(self)

    async def run(self):
        if FakeRun.deaths:
            FakeRun.deaths -= 1
            raise TrainerDied("a trainer rank died during train_rollout() (SIGKILL)")
        return {"steps": 3}


def fake(tmp_path, auto_restart: bool, deaths: int, checkpoint: bool = True) -> FakeRun:
    from types import SimpleNamespace

    if checkpoint:
        (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
        (tmp_path / "checkpoints" / "step_2" / "driver_state.json").write_text("{}")
    FakeRun.made, FakeRun.deaths = [], deaths
    return FakeRun(SimpleNamespace(run_dir=tmp_path, cluster=SimpleNamespace(auto_restart=auto_restart)))


def test_without_auto_restart_a_dead_trainer_stops_the_run_at_its_last_checkpoint(tmp_path):
    with pytest.raises(RunStopped) as e:
        asyncio.run(run_with_restarts(fake(tmp_path, auto_restart=False, deaths=1)))
    msg = str(e.value)
    assert "died during train_rollout()" in msg and str(tmp_path / "checkpoints" / "step_2") in msg
    assert f"furlong train --resume {tmp_path}" in msg and len(FakeRun.made) == 1


def test_auto_restart_resumes_and_is_bounded(tmp_path):
    result = asyncio.run(run_with_restarts(fake(tmp_path, auto_restart=True, deaths=2)))
    assert result == {"steps": 3, "trainer_restarts": 2}
    assert [r.resume for r in FakeRun.made] == [False, True, True]
    with pytest.raises(RunStopped, match=f"gave up after {MAX_TRAINER_RESTARTS} automatic restarts"):
        asyncio.run(run_with_restarts(fake(tmp_path / "again", auto_restart=True, deaths=99, checkpoint=False)))


def test_check_finite_counts_streaks_across_steps():
    notes = []
    check_finite([{"nonfinite/skipped": 0.0, "nonfinite/streak": 0.0}], 2, 0, notes.append)
    assert notes == []
    check_finite([{"nonfinite/skipped": 1.0, "nonfinite/streak": 1.0}], 2, 1, notes.append)
    assert "skipped" in notes[0]
    with pytest.raises(RunStopped):
        check_finite([{"nonfinite/skipped": 1.0, "nonfinite/streak": 2.0}], 2, 2, notes.append)


def test_a_nonfinite_step_leaves_weights_and_optimiser_untouched():
    """In-process: a poisoned step is skipped (weights, Adam state, LR schedule unchanged); the next one trains."""
    from furlong.config.schema import AlgoConfig, TrainConfig
    from furlong.core.sample import Sample
    from furlong.models import create_model
    from furlong.train.hooks import TrainerHooks
    from furlong.train.trainer import Trainer

    def samples(seed: int) -> list[Sample]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for i in range(4):
            s = Sample(
                index=i,
                group_index=i // 2,
                tokens=torch.randint(1, 500, (4,), generator=g).tolist(),
                reward=float(i % 2),
            )
            resp = torch.randint(1, 500, (3,), generator=g).tolist()
            s.append(resp, logprobs=[-1.0] * len(resp))
            out.append(s)
        return out

    def weights(tr: Trainer) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in tr.state_dict_for_sync()}

    poison = TrainerHooks(before_train_step=lambda step, batch: chaos_plugins._poison(batch) if step == 0 else None)
    tr = Trainer(create_model("qwen3", "tiny"), TrainConfig(lr=1e-2), AlgoConfig(), hooks=poison)
    before, sched = weights(tr), tr.scheduler.state_dict()
    m = tr.train_step(samples(0))
    assert m["nonfinite/skipped"] == 1.0 and m["nonfinite/streak"] == 1.0 and m["loss"] != m["loss"]
    assert all(torch.equal(before[k], v) for k, v in weights(tr).items())
    assert not tr.optimizer.state and tr.scheduler.state_dict() == sched
    m = tr.train_step(samples(1))
    assert m["nonfinite/skipped"] == 0.0 and m["nonfinite/streak"] == 0.0
    assert any(not torch.equal(before[k], v) for k, v in weights(tr).items())
