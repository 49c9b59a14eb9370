"""Faults where the docs say furlong survives them: inside a weight sync, two engines at once, all engines gone.

Run 1 (one real `furlong train` run, two engines, every sync verified by checksum; its reward waits
while an engine is being restarted, so a replacement cannot be outrun by a tiny model's fast steps):
  * an engine is SIGKILLed **inside** a weight sync: it is SIGSTOPped just before the
    trainer's push (so the push is provably in flight, waiting on it), then killed; the
    supervisor finds it dead, does the sync again without it and replaces it;
  * later both engines are SIGKILLed at the same moment; both are replaced and the run
    goes on;
  * afterwards every sync — the replaced engines take part — passes `weights.verify`:
    the replacements hold the trainer's current weights, CRC32 for CRC32;
  * accounting group by group: every group trained once, none repeated by a retry.
Run 2: the only engine killed while its model's weights file is gone, so no restart can
succeed: the run stops with a message naming the engines, the last checkpoint and the
`--resume` command, instead of cycling prompts forever.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import chaos_plugins
import pytest
from chaos_run import assert_each_group_trained_once, chaos_config, metrics, record, run

pytestmark = pytest.mark.slow

STEPS, BATCH, N = 6, 2, 2
SYNC_FAULT_VERSION = 2  # the sync after RL step 1
BOTH_AT_STEP = 3


async def _pid(r, engine: int) -> int:
    return await r.top.engines[engine].pid.remote()


def _arm_sync_fault(r, seen: dict) -> None:
    """Wrap the trainer group's push (the call the supervisor's sync makes) to kill engine 0 while it runs."""
    push = r.trainers.push_weights

    async def push_with_fault(urls, version, **kw):
        if version != SYNC_FAULT_VERSION or "sync" in seen:
            return await push(urls, version, **kw)
        pid = await _pid(r, 0)
        os.kill(pid, signal.SIGSTOP)  # engine 0 cannot answer: the push waits on it
        task = asyncio.create_task(push(urls, version, **kw))
        await asyncio.sleep(0.5)
        seen["sync"] = {"in_flight": not task.done(), "pid": pid, "faults_before": len(r.supervisor.faults)}
        os.kill(pid, signal.SIGKILL)
        return await task

    r.trainers.push_weights = push_with_fault


@pytest.mark.timeout(900)  # one run with three engine replacements: ~1.5 min quiet, several under load
def test_kill_inside_a_sync_and_two_engines_at_once_are_repaired_and_verified(tmp_path):
    run_dir = tmp_path / "sync"
    cfg = chaos_config(
        run_dir,
        "engine.num_engines=2",
        f"rollout.rollout_batch_size={BATCH}",
        f"rollout.n_samples_per_prompt={N}",
        f"train.total_steps={STEPS}",
        "data.n_train=1000",
        "rollout.reward_fn=chaos_plugins:patient_reward",  # waits for each replacement: the run outlasts them
    )
    seen: dict = {}

    async def faults(r):
        chaos_plugins.reset(r, [])
        while r.supervisor is None or r.trainers is None:
            await asyncio.sleep(0.05)
        _arm_sync_fault(r, seen)
        while r.step < BOTH_AT_STEP:
            await asyncio.sleep(0.05)
        await r.supervisor.wait_all_serving()  # the sync fault has been repaired
        before = len(r.supervisor.faults)
        pids = [await _pid(r, 0), await _pid(r, 1)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        seen["both"] = {"pids": pids, "faults_before": before, "at_step": r.step}
        while len(r.supervisor.faults) < before + 2:
            await asyncio.sleep(0.05)
        await r.supervisor.wait_all_serving()
        seen["both"]["new_pids"] = [await _pid(r, 0), await _pid(r, 1)]

    result = run(cfg, faults)
    record("sync", result, injected=["kill inside a weight sync", "kill both engines at once"])
    assert result["steps"] == STEPS

    sup = result["supervisor"]
    assert seen["sync"]["in_flight"], "the push had finished before the kill: the fault was not inside the sync"
    assert sup["syncs_retried"] >= 1, sup  # the sync was done again without the dead engine
    sync_fault = next(f for f in sup["fault_log"][seen["sync"]["faults_before"] :] if f["engine"] == 0)
    assert sync_fault["kind"] == "exited" and sync_fault["recovered"], sup

    both = sup["fault_log"][seen["both"]["faults_before"] :]
    assert {f["engine"] for f in both} >= {0, 1} and all(f["recovered"] for f in both), both
    assert set(seen["both"]["new_pids"]).isdisjoint(seen["both"]["pids"])  # two new processes
    assert sup["replacements"] == sup["faults"] and set(sup["engines"].values()) == {"ok"}, sup
    # With no engine up the router's /health is 503; it still answers, so it is not restarted for it.
    assert sup.get("router_faults", 0) == 0, sup

    # Every sync after the faults verified every engine's weights against the trainer's.
    rows = [m for m in metrics(run_dir) if "weight_sync/seconds" in m]
    after = [m for m in rows if m["step"] > seen["both"]["at_step"]]
    assert after and all(m.get("weight_sync/verified") == 1 for m in rows), rows

    stats = result["rollout_stats"]
    assert stats["balanced"] and stats["groups_trained"] == STEPS * BATCH, stats
    assert_each_group_trained_once(run_dir, STEPS * BATCH, N)


@pytest.mark.timeout(600)
def test_all_engines_lost_for_good_stop_the_run_naming_them_and_the_checkpoint(tmp_path):
    from furlong.driver.build import model_dir
    from furlong.driver.restarts import RunStopped

    model = tmp_path / "model"
    run_dir = tmp_path / "lost"
    shutil.copytree(model_dir(chaos_config(run_dir).model), model)
    cfg = chaos_config(run_dir, "train.total_steps=50", "train.checkpoint_every=1", f"model.path={model}")

    async def lose_everything(r):
        while r.supervisor is None or r.step < 2:
            await asyncio.sleep(0.05)
        for f in model.glob("*.safetensors"):
            f.unlink()  # a replacement cannot load the model's weights: every restart fails
        os.kill(await _pid(r, 0), signal.SIGKILL)  # the run's only engine

    with pytest.raises(RunStopped) as stopped:
        run(cfg, lose_everything)
    msg = str(stopped.value)
    record("lost", {"steps": len(metrics(run_dir))}, stopped=msg)
    assert "engine-0" in msg and "given up after 3 failed restarts, its fault: the process exited" in msg, msg
    assert "the last complete checkpoint is" in msg and f"furlong train --resume {run_dir}" in msg, msg
    assert len(metrics(run_dir)) < 50  # it stopped; it did not cycle prompts to the end
