"""`rollout.eval_mode=async`: the eval runs beside training and is logged, tagged, when it has finished."""

import asyncio

import pytest

from furlong.config import ConfigError, load_config
from furlong.core.version import WeightVersion
from furlong.driver.eval_loop import EVAL_PRIORITY, BackgroundEval, PriorityClient


class SlowManager:
    """Evaluates in `steps` event-loop turns, with the client it is given."""

    def __init__(self):
        self.calls, self.release = [], asyncio.Event()

    async def evaluate(self, step, client=None):
        self.calls.append((step, client))
        await self.release.wait()
        return {"eval/pass@1": 0.5}


class Client:
    closed = False

    async def aclose(self):
        self.closed = True


def test_async_eval_runs_beside_training_and_is_tagged():
    async def go():
        version, manager, client = WeightVersion(3), SlowManager(), Client()
        bg = BackgroundEval(manager, client, version)
        bg.start(10)
        await asyncio.sleep(0)
        assert bg.collect() == {}  # still running: the step goes on without it
        bg.start(20)  # one at a time: skipped and counted
        version.advance(4)  # a weight sync while it runs
        manager.release.set()
        got = await bg.drain()
        await bg.close()
        return got, manager.calls, client.closed

    got, calls, closed = asyncio.run(go())
    assert calls == [(10, calls[0][1])] and isinstance(calls[0][1], Client)  # its own client, not the rollout's
    assert got == {
        "eval/pass@1": 0.5,
        "eval/step": 10.0,
        "eval/weight_version": 3.0,
        "eval/weight_version_end": 4.0,
        "eval/skipped_busy": 1.0,
    }
    assert closed


def test_eval_mode_choices():
    assert load_config(None, []).rollout.eval_mode == "blocking"
    assert load_config(None, ["rollout.eval_mode=async"]).rollout.eval_mode == "async"
    assert load_config(None, ["rollout.eval_mode=dedicated"]).engine.eval_num_engines == 1
    with pytest.raises(ConfigError, match="engine.eval_num_engines is the engines of rollout.eval_mode=dedicated"):
        load_config(None, ["engine.eval_num_engines=2"])
    with pytest.raises(ConfigError, match="rollout.eval_mode=dedicated starts engines of its own"):
        load_config(None, ["rollout.eval_mode=dedicated", "cluster.colocate=true"])


def test_eval_requests_carry_low_priority_to_each_engine_in_turn():
    class Recorder:
        def __init__(self):
            self.sent = []

        async def generate(self, ids, params, routing_key=None, **extra):
            self.sent.append((ids, extra))
            return {}

    a, b = Recorder(), Recorder()
    client = PriorityClient([a, b])

    async def go():
        for i in range(3):
            await client.generate([i], {})

    asyncio.run(go())
    assert a.sent == [([0], {"priority": EVAL_PRIORITY}), ([2], {"priority": EVAL_PRIORITY})]
    assert b.sent == [([1], {"priority": EVAL_PRIORITY})] and EVAL_PRIORITY < 0
