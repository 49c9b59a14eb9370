"""The router dies under a running job: the supervisor restarts it on its port and the run finishes.

Before the supervisor watched the router, every request after its death failed at
the transport, each group was dropped as failed and new prompts drawn, forever.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from chaos_run import chaos_config, metrics, record, run

STEPS = 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sigkilled_router_is_restarted_on_its_port_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "router"
    cfg = chaos_config(run_dir, f"train.total_steps={STEPS}", "rollout.reward_fn=chaos_plugins:varied_reward")
    seen: dict = {}

    async def kill_router(r):
        while r.supervisor is None or r.step < 1:  # one step through the first router
            await asyncio.sleep(0.05)
        seen["url"] = r.top.router_url
        seen["pid"] = await r.top.router.pid.remote()
        os.kill(seen["pid"], signal.SIGKILL)
        seen["at_step"] = r.step
        while r.supervisor.counts["router_restarts"] < 1:
            await asyncio.sleep(0.05)
        seen["new_pid"] = await r.top.router.pid.remote()
        seen["new_url"] = r.top.router_url

    result = run(cfg, kill_router)
    record("router", result, injected=[f"SIGKILL router at step {seen['at_step']}"])
    assert result["steps"] == STEPS and seen["at_step"] < STEPS
    assert seen["new_pid"] != seen["pid"] and seen["new_url"] == seen["url"]  # a new process, the same address
    sup = result["supervisor"]
    assert sup["router"] == "ok" and sup["router_restarts"] == 1, sup
    (fault,) = sup["router_fault_log"]
    assert fault["kind"] == "exited" and fault["recovered"], fault
    assert sup.get("faults", 0) == 0 and set(sup["engines"].values()) == {"ok"}  # the engines were never at fault
    assert result["rollout_stats"]["balanced"], result["rollout_stats"]
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, STEPS + 1))
