"""An outage (nothing can serve) delays prompts instead of dropping them: the manager waits on `serving`."""

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
