"""Engines die under a running async job; the run finishes and every prompt is accounted for.

One run, faults in sequence (each after the previous one healed), injected by the
reward plug point `chaos_plugins:chaos_reward` at fixed points of the run:
SIGKILL engine 0, SIGKILL engine 1, SIGKILL engine 0, SIGSTOP engine 1. The same
reward raises on 10% of the samples.
"""

from __future__ import annotations

import chaos_plugins
import pytest
from chaos_run import assert_each_group_trained_once, chaos_config, record, run

pytestmark = pytest.mark.slow  # one real run with four engine restarts: over a minute on 2 cores

PLAN = [(6, "kill", 0), (18, "kill", 1), (30, "kill", 0), (42, "stop", 1), (54, "wait", 0)]
STEPS, BATCH, N = 10, 4, 2


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chaos_engines")
    cfg = chaos_config(
        run_dir,
        "engine.num_engines=2",
        "rollout.mode=async",
        "rollout.max_staleness=1",
        f"rollout.rollout_batch_size={BATCH}",
        f"rollout.n_samples_per_prompt={N}",
        "train.num_steps_per_rollout=1",
        f"train.total_steps={STEPS}",
        "data.n_train=1000",
        "rollout.reward_fn=chaos_plugins:chaos_reward",
    )

    async def arm(r):  # the reward reaches the run through the plugin module
        chaos_plugins.reset(r, PLAN)

    result = run(cfg, arm)
    result["run_dir"] = run_dir
    record("engines", result, injected=[i[:2] for i in chaos_plugins.STATE["injected"]])
    return result


def fault_of(run_result: dict, injected: tuple) -> dict:
    """The supervisor's record of an injected fault: the first one on that engine after the injection.

    (On a loaded machine a slow /health can add a fault of its own; it must be repaired too.)
    """
    _, engine, before = injected
    return next(f for f in run_result["supervisor"]["fault_log"][before:] if f["engine"] == engine)


def test_three_sigkills_and_a_sigstop_are_repaired_while_the_run_finishes(chaos_run):
    assert chaos_run["steps"] == STEPS
    injected = chaos_plugins.STATE["injected"]
    assert [i[:2] for i in injected] == [("kill", 0), ("kill", 1), ("kill", 0), ("stop", 1)]
    sup = chaos_run["supervisor"]
    assert sup["faults"] >= 4 and sup["replacements"] == sup["faults"], sup
    assert all(f["recovered"] for f in sup["fault_log"]), sup["fault_log"]
    assert set(sup["engines"].values()) == {"ok"}
    assert [fault_of(chaos_run, i)["kind"] for i in injected[:3]] == ["exited"] * 3


def test_sigstop_is_found_by_the_health_timeout_and_replaced(chaos_run):
    stopped = fault_of(chaos_run, chaos_plugins.STATE["injected"][3])
    assert stopped["kind"] == "unresponsive" and stopped["recovered"]
    assert "timed out after 3s" in stopped["cause"]  # found by the /health timeout, not by the process exiting
    assert stopped["failed_probes"] == 2  # router.unhealthy_after


def test_every_prompt_is_trained_filtered_with_a_reason_or_buffered(chaos_run):
    stats = chaos_run["rollout_stats"]
    assert stats["balanced"], stats
    assert stats["groups_trained"] == STEPS * BATCH
    assert stats["samples_trained"] == STEPS * BATCH * N
    assert stats["prompts_taken"] == stats["groups_trained"] + sum(stats["filtered"].values()) + stats["in_buffer"]
    assert set(stats["filtered"]) <= {"reward_error", "failed", "stale"}, stats["filtered"]
    # and group by group: no group trained twice, none with a sample missing or repeated by a retry
    assert_each_group_trained_once(chaos_run["run_dir"], STEPS * BATCH, N)


def test_a_raising_reward_fails_its_samples_with_the_error_and_is_counted(chaos_run):
    raised = chaos_plugins.STATE["raised"]
    stats = chaos_run["rollout_stats"]
    assert raised and stats["reward_errors"] == len(raised)
    assert all(s.status == "failed" and "chaos: reward exploded" in s.status_reason for s in raised)
    assert stats["filtered"].get("reward_error", 0) >= 1  # their groups were dropped with the reason, not trained
