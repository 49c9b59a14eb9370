"""Rollouts that cannot go on: an outage (nothing can serve) delays prompts instead of dropping them (the manager
waits on `serving`); a batch that can never fill (every group dropped, e.g. a saturated reward under dynamic
sampling) stops the run with the reasons instead of drawing prompts forever."""

from __future__ import annotations

import asyncio

from test_rollout_manager import Cfg, drive, make_manager

from furlong.core.sample import Status


def _outage(n_failures: int):
    """A generate function whose first `n_failures` calls fail as if every engine were gone, and a `serving`
    that reports the outage (True: it waited) until those failures are spent."""
    from furlong.rollout.generate import generate

    state = {"left": n_failures, "waits": 0}

    async def generate_fn(ctx, sample, params):
        if state["left"] > 0:
            state["left"] -= 1
            raise ConnectionError("every engine is being replaced")
        return await generate(ctx, sample, params)

    async def serving() -> bool:
        state["waits"] += 1
        return state["left"] > 0 or state["waits"] <= n_failures

    return generate_fn, serving, state


def test_failures_during_an_outage_are_not_the_samples_attempts():
    async def main():
        from rollout_fake_engine import FakeEngine

        engine = FakeEngine()
        generate_fn, serving, state = _outage(10)  # 10 failures, more than 4 samples x 2 attempts
        mgr = make_manager(
            Cfg(rollout_batch_size=1), engine, generate_fn=generate_fn, serving=serving, max_sample_attempts=2
        )
        [batch] = await drive(mgr, engine, 1)
        st = mgr.stats()
        assert len(batch) == 4 and all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in batch)
        assert st["filtered"] == {} and st["balanced"], st  # the prompt was delayed, not dropped
        assert st["generate_errors"] == 10 and st["outage_retries"] == 10, st
        await mgr.close()

    asyncio.run(main())


def test_without_an_outage_a_failing_sample_still_spends_its_attempts():
    async def main():
        from rollout_fake_engine import FakeEngine

        engine = FakeEngine()

        async def always_failing(ctx, sample, params):
            raise ConnectionError("this engine answers nothing")

        async def serving() -> bool:
            return False  # engines are serving: the failure is the sample's own

        mgr = make_manager(
            Cfg(rollout_batch_size=1),
            engine,
            generate_fn=always_failing,
            serving=serving,
            max_sample_attempts=2,
            prompts=None,
        )
        task = asyncio.create_task(mgr.next_batch(0))
        while mgr.stats()["filtered"].get("failed", 0) < 1:  # its group is dropped after 2 attempts per sample
            await asyncio.sleep(0.01)
        st = mgr.stats()
        assert st["outage_retries"] == 0 and st["generate_errors"] >= 2, st
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await mgr.close()

    asyncio.run(main())


def test_a_batch_that_never_fills_stops_with_the_reason_instead_of_drawing_forever():
    async def main():
        import pytest
        from rollout_fake_engine import FakeEngine

        from furlong.rollout.filters import RolloutStalled

        engine = FakeEngine()
        cfg = Cfg(rollout_batch_size=2, dynamic_filter=True, max_dropped_batches=3)
        mgr = make_manager(cfg, engine, reward_fn=lambda s: 1.0)  # every group agrees: zero variance
        with pytest.raises(RolloutStalled, match=r"last 6 groups drawn were all dropped \(6 zero_variance"):
            await mgr.next_batch(0)
        st = mgr.stats()
        assert st["filtered"] == {"zero_variance": 6} and st["prompts_taken"] >= 6, st
        await mgr.close()

    asyncio.run(main())
