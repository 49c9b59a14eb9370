"""`rollout.eval_mode=async`: the eval runs beside training and is logged, tagged, when it has finished."""

import asyncio

import pytest

from furlong.config import ConfigError, load_config
from furlong.core.version import WeightVersion
from furlong.driver.eval_loop import BackgroundEval


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
    with pytest.raises(ConfigError, match="rollout.eval_mode.*not built yet"):
        load_config(None, ["rollout.eval_mode=dedicated"])
