"""RolloutManager against the in-process fake engine: every mode, staleness, filters, partial rollout, state."""

from __future__ import annotations

import asyncio
import json

import pytest
from rollout_fake_engine import CharTokenizer, FakeEngine

from furlong.config.schema import RolloutConfig
from furlong.core.client import EngineClient
from furlong.core.sample import Status
from furlong.data import DataSource, Prompt
from furlong.rollout.generate import generate
from furlong.rollout.manager import RolloutExhausted, RolloutManager


def Cfg(**kw):
    """The real `rollout` config section, with this file's small defaults."""
    return RolloutConfig(**{"rollout_batch_size": 3, "max_new_tokens": 12, "eval_n_samples": 4, **kw})


def make_prompts(n: int = 40, labels: tuple[str, ...] = ("mixed",)) -> list[Prompt]:
    return [
        Prompt(index=i, prompt=f"question {i}?", label=labels[i % len(labels)], metadata={"kind": "test"})
        for i in range(n)
    ]


def label_reward(sample) -> float:
    """all1 / all0 groups have zero variance; mixed groups alternate by sample index."""
    if sample.label == "all1":
        return 1.0
    if sample.label == "all0":
        return 0.0
    if sample.label == "boom":
        raise RuntimeError("reward exploded")
    return float(sample.metadata["sample_index"] % 2)


def make_manager(cfg: Cfg, engine: FakeEngine, prompts=None, **kw) -> RolloutManager:
    client = EngineClient(
        "http://fake",
        transport=engine.transport(),
        admin_token="T",
        max_inflight=kw.pop("max_inflight", 16),
        retry_backoff_s=0.001,
    )
    source = DataSource(prompts or make_prompts(), seed=0, shuffle=kw.pop("shuffle", True))
    kw.setdefault("reward_fn", label_reward)
    return RolloutManager(cfg, source, client, CharTokenizer(), seed=7, **kw)


async def drive(mgr: RolloutManager, engine: FakeEngine, steps: int, *, train=None, start_step: int = 0) -> list[list]:
    """The driver's loop: batch, 'train', weight sync with a version bump."""
    batches = []
    for step in range(start_step, start_step + steps):
        batches.append(await mgr.next_batch(step))
        if train is not None:
            await train()
        await mgr.before_weight_sync()
        engine.version += 1
        await mgr.on_weights_updated(engine.version)
    return batches


def key(batch) -> list[tuple]:
    return [
        (
            s.index,
            s.group_index,
            s.metadata["prompt_index"],
            tuple(s.tokens),
            tuple(s.rollout_logprobs),
            tuple(s.token_versions),
            s.reward,
            s.status.value,
        )
        for s in batch
    ]


def check_batch(batch, cfg: Cfg, version: int, bound: int) -> None:
    assert len(batch) == cfg.rollout_batch_size * cfg.n_samples_per_prompt
    for s in batch:
        s.validate()
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        assert s.response_length >= 1
        assert s.tokens[: s.prompt_length] == CharTokenizer().encode(s.prompt)
        assert set(s.token_sources) == {"policy"} and set(s.loss_mask) == {1}
        assert version - s.oldest_version() <= bound
        assert (s.status == Status.TRUNCATED) == (s.response_length == cfg.max_new_tokens and s.tokens[-1] != 0)
    groups = [batch[i : i + cfg.n_samples_per_prompt] for i in range(0, len(batch), cfg.n_samples_per_prompt)]
    for g in groups:
        assert len({s.group_index for s in g}) == 1 and len({s.metadata["prompt_index"] for s in g}) == 1


def test_sync_mode_batches_and_nothing_runs_between_steps():
    async def main():
        engine, cfg = FakeEngine(token_delay_s=0.0005), Cfg(over_sampling=2.0)
        mgr = make_manager(cfg, engine)

        async def train():
            in_flight = len(engine.active)
            await asyncio.sleep(0.02)
            assert in_flight == 0 and not engine.active, "sync mode generated during training"

        batches = await drive(mgr, engine, 3, train=train)
        for step, b in enumerate(batches):
            check_batch(b, cfg, version=step, bound=0)
            assert {v for s in b for v in s.token_versions} == {step}
        st = mgr.stats()
        assert st["balanced"] and st["groups_trained"] == 9 and st["samples_trained"] == 36
        # over-sampling 2x: the surplus of each step is regenerated on the new weights
        assert st["regenerated"].get("stale", 0) >= 1
        assert [s.index for b in batches for s in b] == list(range(36))
        await mgr.close()

    asyncio.run(main())


def test_overlap_generates_next_batch_during_training():
    async def main():
        engine, cfg = FakeEngine(token_delay_s=0.0005), Cfg(mode="overlap")
        mgr = make_manager(cfg, engine)

        async def train():
            # the next batch generates (and finishes) while this one "trains"
            while any(not g.finished for g in list(mgr.buffer)[: cfg.rollout_batch_size]):
                await asyncio.sleep(0.001)

        batches = await drive(mgr, engine, 3, train=train)
        check_batch(batches[0], cfg, version=0, bound=0)
        for step, b in enumerate(batches[1:], start=1):
            check_batch(b, cfg, version=step, bound=1)
            # generated entirely while batch step-1 trained, on the previous weights
            assert {v for s in b for v in s.token_versions} == {step - 1}
        assert mgr.stats()["balanced"]
        await mgr.close()

    asyncio.run(main())


def test_async_backpressure_and_staleness_bound():
    async def main():
        engine = FakeEngine(token_delay_s=0.0002)
        cfg = Cfg(mode="async", max_staleness=1, max_buffer_groups=5)
        mgr = make_manager(cfg, engine)

        async def train():
            # let the producer run until back-pressure stops it: buffer full, nothing in flight
            while len(mgr.buffer) < 5 or any(not g.finished for g in mgr.buffer):
                assert not mgr.engines_idle()  # room for a group, or one still generating: the engines have work
                await asyncio.sleep(0.001)
            while not all(g.task.done() for g in mgr.buffer):  # each group's task ends just after its samples
                await asyncio.sleep(0.001)
            assert mgr.engines_idle() and not mgr.client.inflight  # what lends the trainer their cores
            st = mgr.stats()
            assert st["in_buffer"] == 5 and st["prompts_taken"] == st["groups_trained"] + 5 + sum(
                st["filtered"].values()
            )

        batches = await drive(mgr, engine, 4, train=train)
        for step, b in enumerate(batches):
            check_batch(b, cfg, version=step, bound=1)
        # batch 1 was generated during step 0's training on version 0: staleness 1, accepted
        assert {s.metadata["staleness"] for s in batches[1]} == {1}
        st = mgr.stats()
        assert st["balanced"] and st["regenerated"].get("stale", 0) >= 1  # groups 2 versions old retried
        await mgr.close()
        assert not engine.active

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_engines_are_not_idle_while_an_episode_waits_on_a_tool_between_turns():
    """Between two turns of an agent episode its sample looks finished (its last request returned) and
    nothing is in flight, but the episode goes on after the tool call: not idle until the group's task ends."""

    async def main():
        engine, tool = FakeEngine(), asyncio.Event()
        cfg = Cfg(mode="async", max_staleness=1, rollout_batch_size=1, n_samples_per_prompt=2)

        async def two_turns(ctx, sample, params):
            await generate(ctx, sample, {**params, "ignore_eos": True, "max_new_tokens": 2})
            await tool.wait()  # the tool call
            return await generate(ctx, sample, {**params, "ignore_eos": True, "max_new_tokens": 4})

        mgr = make_manager(cfg, engine, generate_fn=two_turns)
        batch = asyncio.create_task(mgr.next_batch(0))
        while len(mgr.buffer) < 2 or not all(g.finished for g in mgr.buffer) or mgr.client.inflight:
            await asyncio.sleep(0.001)
        assert not mgr.engines_idle()  # every first turn done, every episode in its tool call
        tool.set()
        assert all(s.response_length == 4 for s in await batch)
        while not all(g.task.done() for g in mgr.buffer) or len(mgr.buffer) < 1:
            await asyncio.sleep(0.001)
        assert mgr.engines_idle()  # the next window's episodes ended too: the buffer holds it, full
        await mgr.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_async_next_window_starts_during_a_batch_tail():
    """The batch's slowest group, at the head of the queue, does not hold the next window back: while the
    trainer waits for it, the next window's groups generate (as fresh as a moment later: the weights change
    only after this batch trains), and at the default bound nothing is generated twice."""

    async def main():
        engine, cfg = FakeEngine(token_delay_s=0.0002), Cfg(mode="async", max_staleness=1)
        gate = asyncio.Event()

        async def slow_head(ctx, sample, params):
            if sample.metadata["seq"] == 0:  # the head group's episodes wait on a slow tool
                await gate.wait()
            return await generate(ctx, sample, params)

        mgr = make_manager(cfg, engine, generate_fn=slow_head)
        window = cfg.rollout_batch_size
        assert mgr.buffer.capacity == window
        first = asyncio.create_task(mgr.next_batch(0))

        async def next_window_done():
            while len(mgr.buffer) < 2 * window or sum(g.finished for g in mgr.buffer) < 2 * window - 1:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(next_window_done(), 30)  # before the fix: held at one window, all waiting
        await asyncio.sleep(0.02)
        assert len(mgr.buffer) == 2 * window  # bounded: capacity plus the groups the batch waits for
        assert [g.seq for g in mgr.buffer] == list(range(2 * window)) and not mgr.buffer[0].finished
        gate.set()
        batches = [await first]
        assert len(mgr.buffer) == window and mgr.buffer.claimed == 0  # back to the bound while it trains
        await mgr.before_weight_sync()
        engine.version += 1
        await mgr.on_weights_updated(engine.version)
        batches += await drive(mgr, engine, 3, start_step=1)
        for step, b in enumerate(batches):
            check_batch(b, cfg, version=step, bound=1)
        assert {s.metadata["staleness"] for s in batches[1]} == {1}  # made during step 0's wait, on version 0
        st = mgr.stats()
        assert st["balanced"] and st["regenerated"] == {} and st["filtered"] == {}
        await mgr.close()

    asyncio.run(main())


def test_async_drop_policy_counts_stale_groups():
    async def main():
        engine = FakeEngine()
        cfg = Cfg(mode="async", max_staleness=0, stale_policy="drop", max_buffer_groups=6)
        mgr = make_manager(cfg, engine)

        async def train():
            while len(mgr.buffer) < 6 or any(not g.finished for g in mgr.buffer):
                await asyncio.sleep(0.001)

        batches = await drive(mgr, engine, 3, train=train)
        for step, b in enumerate(batches):
            check_batch(b, cfg, version=step, bound=0)
        st = mgr.stats()
        # after each step the 6 buffered groups were made on the old weights: all stale, all dropped
        assert st["filtered"]["stale"] == 12 and st["regenerated"] == {} and st["balanced"]
        await mgr.close()

    asyncio.run(main())


@pytest.mark.parametrize("partial", [False, True])
def test_async_with_zero_staleness_equals_sync(partial):
    """Same seeds, same prompts: fully async with max_staleness=0 trains exactly what sync trains."""

    async def run(mode: str):
        engine = FakeEngine(token_delay_s=0.0003)
        cfg = Cfg(mode=mode, over_sampling=1.5, dynamic_filter=True, partial_rollout=partial)
        mgr = make_manager(cfg, engine, prompts=make_prompts(60, ("mixed", "all1", "mixed", "all0")))

        async def train():
            # async runs ahead until back-pressure stops it; all of that goes stale at the sync
            while mode == "async" and (mgr.buffer.free or any(not g.finished for g in mgr.buffer)):
                await asyncio.sleep(0.001)

        batches = await drive(mgr, engine, 4, train=train)
        st = mgr.stats()
        await mgr.close()
        return batches, st

    sync_batches, sync_st = asyncio.run(run("sync"))
    async_batches, async_st = asyncio.run(run("async"))
    assert [key(b) for b in async_batches] == [key(b) for b in sync_batches]
    assert sync_st["balanced"] and async_st["balanced"]
    assert sync_st["filtered"] == async_st["filtered"] and sync_st["filtered"]["zero_variance"] > 0
    assert async_st["regenerated"]["stale"] > sync_st["regenerated"]["stale"]


def test_dynamic_filter_counts_and_sample_filter():
    async def main():
        engine = FakeEngine()
        cfg = Cfg(rollout_batch_size=4, over_sampling=2.0, dynamic_filter=True)
        # prompts cycle mixed, all1, all0: exactly one in three survives the filter
        prompts = make_prompts(30, ("mixed", "all1", "all0"))
        masked = lambda s: "odd" if s.metadata["sample_index"] == 3 else None
        mgr = make_manager(cfg, engine, prompts=prompts, shuffle=False, sample_filter_fn=masked)
        batches = await drive(mgr, engine, 2)
        for b in batches:
            assert all(s.label == "mixed" for s in b)
            assert [sum(s.loss_mask) > 0 for s in b] == [True, True, True, False] * 4
            assert all(s.metadata.get("filtered") == "odd" for s in b if s.metadata["sample_index"] == 3)
        st = mgr.stats()
        # 8 trained mixed groups occupy prompts 0..21 in order: 14 all1/all0 groups were filtered
        assert st["filtered"] == {"zero_variance": 14}
        assert st["samples_masked"] == {"odd": 8}
        assert st["balanced"] and st["prompts_taken"] == 8 + 14 + st["in_buffer"]
        await mgr.close()

    asyncio.run(main())


def test_reward_exception_marks_failed_and_run_continues():
    async def main():
        engine = FakeEngine()
        cfg = Cfg(rollout_batch_size=2)
        mgr = make_manager(cfg, engine, prompts=make_prompts(20, ("mixed", "boom")), shuffle=False)
        batches = await drive(mgr, engine, 2)
        assert all(s.label == "mixed" for b in batches for s in b)
        st = mgr.stats()
        assert st["filtered"] == {"reward_error": 3} and st["reward_errors"] == 12  # prompts 1, 3, 5: 4 samples each
        assert st["balanced"]
        await mgr.close()

    asyncio.run(main())


def test_group_reward_fn_and_its_errors():
    async def main():
        engine = FakeEngine()

        def rank_reward(samples):
            if samples[0].metadata["prompt_index"] == 1:
                return [1.0]  # wrong length: the group fails, the run goes on
            lengths = [s.response_length for s in samples]
            return [{"score": float(n == max(lengths)), "length": float(n)} for n in lengths]

        cfg = Cfg(rollout_batch_size=2)
        mgr = make_manager(cfg, engine, reward_fn=None, group_reward_fn=rank_reward, shuffle=False)
        [batch] = await drive(mgr, engine, 1)
        assert [s.metadata["prompt_index"] for s in batch[::4]] == [0, 2]
        assert all(isinstance(s.reward, dict) and "length" in s.reward for s in batch)
        assert mgr.stats()["filtered"] == {"reward_error": 1}
        await mgr.close()

    asyncio.run(main())


def test_engine_errors_fail_samples_and_drop_group():
    async def main():
        engine = FakeEngine()
        prompts = make_prompts(20)
        prompts[1] = Prompt(index=1, prompt="!bad prompt", label="mixed")
        engine.fail_prefix = {CharTokenizer().encode("!")[0]}  # the engine answers 503 to this prompt
        mgr = make_manager(Cfg(rollout_batch_size=2), engine, prompts=prompts, shuffle=False, max_sample_attempts=2)
        [batch] = await drive(mgr, engine, 1)
        assert [s.metadata["prompt_index"] for s in batch[::4]] == [0, 2]
        st = mgr.stats()
        assert st["filtered"] == {"failed": 1}
        assert st["generate_errors"] == 4 * 2  # 4 samples x 2 attempts, each after the client's retries
        assert st["balanced"]
        await mgr.close()

    asyncio.run(main())


def test_a_failed_sample_is_regenerated_alone():
    async def main():
        from furlong.rollout.generate import generate

        engine, calls = FakeEngine(), []

        async def flaky_generate(ctx, sample, params):
            calls.append((sample.metadata["seq"], sample.metadata["sample_index"]))
            if calls.count((0, 2)) == 1 and calls[-1] == (0, 2):
                raise ConnectionError("engine went away")
            return await generate(ctx, sample, params)

        mgr = make_manager(Cfg(rollout_batch_size=1), engine, generate_fn=flaky_generate)
        [batch] = await drive(mgr, engine, 1)
        assert len(batch) == 4 and all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in batch)
        assert sorted(calls) == [(0, 0), (0, 1), (0, 2), (0, 2), (0, 3)]  # backfill: only sample 2 again
        st = mgr.stats()
        assert st["generate_errors"] == 1 and st["filtered"] == {} and st["balanced"]
        await mgr.close()

    asyncio.run(main())


async def _wait_for_tokens_in_flight(engine: FakeEngine, mgr: RolloutManager, n: int = 2) -> bool:
    """Until `n` requests are mid-way (True), or the buffer is full of finished groups (False): then nothing
    starts before the next batch is taken. The async buffer's claim lets the next window run while a batch's
    tail finishes, so on a loaded machine a whole window may be done by the time `next_batch` returns."""
    while sum(1 for toks in engine.active.values() if len(toks) >= 2) < n:
        if mgr.buffer.free == 0 and all(g.finished for g in mgr.buffer):
            return False
        await asyncio.sleep(0.0005)
    return True


def test_partial_rollout_resumes_keeping_logprobs_and_versions():
    async def main():
        engine = FakeEngine(token_delay_s=0.001)
        cfg = Cfg(mode="async", max_staleness=2, partial_rollout=True, max_new_tokens=40, max_buffer_groups=4)
        mgr = make_manager(cfg, engine)

        async def train():
            await _wait_for_tokens_in_flight(engine, mgr)

        # at least four steps, and on until a trained sample spans a weight sync (a step whose sync finds
        # nothing in flight has no partial sample)
        batches: list[list] = []
        while len(batches) < 4 or not any(len(set(s.token_versions)) > 1 for b in batches for s in b):
            assert len(batches) < 12, "no trained sample spans a weight sync in 12 steps"
            batches += await drive(mgr, engine, 1, train=train, start_step=len(batches))
        st = mgr.stats()
        assert st["partial_aborts"] > 0 and st["partial_resumes"] > 0 and st["balanced"]
        mixed = [s for b in batches for s in b if len(set(s.token_versions)) > 1]
        for s in mixed:
            assert s.token_versions == sorted(s.token_versions)
            # the sample is stitched, end to end, from engine responses with their log-probs and versions
            # kept; the piece before the sync came back aborted
            pos, finishes = 0, []
            while pos < s.response_length:
                context = s.tokens[: s.prompt_length + pos]
                piece = next(
                    r
                    for r in engine.log
                    if r["input_ids"] == context
                    and r["output_ids"]
                    and r["output_ids"] == s.response_tokens[pos : pos + len(r["output_ids"])]
                    and r["logprobs"] == s.rollout_logprobs[pos : pos + len(r["output_ids"])]
                    and r["versions"] == s.token_versions[pos : pos + len(r["output_ids"])]
                )
                finishes.append(piece["finish"])
                pos += len(piece["output_ids"])
            assert "abort" in finishes[:-1] and finishes[-1] in ("stop", "length")
        for step, b in enumerate(batches):
            check_batch(b, cfg, version=step, bound=2)
        await mgr.close()

    asyncio.run(main())


def test_state_round_trip_resumes_partial_samples():
    async def main():
        engine = FakeEngine(token_delay_s=0.001)
        cfg = Cfg(mode="async", max_staleness=1, partial_rollout=True, max_new_tokens=40, max_buffer_groups=4)
        mgr = make_manager(cfg, engine)
        step = 0
        await mgr.next_batch(step)
        while not await _wait_for_tokens_in_flight(engine, mgr):  # nothing in flight: train on, try again
            assert step < 10, "no request in flight after a batch in 10 steps"
            await mgr.before_weight_sync()
            engine.version += 1
            await mgr.on_weights_updated(engine.version)
            step += 1
            await mgr.next_batch(step)
        kept = engine.version  # the checkpoint's version: partial samples kept on resume start at it
        await mgr.before_weight_sync()  # partial samples come back aborted, tokens kept
        state = json.loads(json.dumps(mgr.state_dict()))
        await mgr.close()
        partial = {
            (g["prompt_index"], s["metadata"]["sample_index"]): s
            for g in state["buffer"]
            for s in g["samples"]
            if s["status"] == "aborted" and s["response_length"] > 0
        }
        assert partial, "no partial sample in the checkpoint"

        engine.version = kept + 1
        mgr2 = make_manager(cfg, engine)
        mgr2.load_state_dict(state)
        assert mgr2.stats()["prompts_taken"] == mgr.stats()["prompts_taken"]
        await mgr2.on_weights_updated(engine.version)
        batches = await drive(mgr2, engine, 2, start_step=step + 1)
        resumed = [s for b in batches for s in b if (s.metadata["prompt_index"], s.metadata["sample_index"]) in partial]
        assert resumed
        for s in resumed:
            old = partial[(s.metadata["prompt_index"], s.metadata["sample_index"])]
            if s.oldest_version() == kept:  # kept: continues the checkpointed tokens
                assert s.tokens[: len(old["tokens"])] == old["tokens"]
                assert s.token_versions[: old["response_length"]] == old["token_versions"]
        assert any(s.oldest_version() == kept and len(set(s.token_versions)) > 1 for s in resumed)
        st = mgr2.stats()
        assert st["balanced"] and st["partial_resumes"] > 0
        await mgr2.close()

    asyncio.run(main())


def test_sync_resume_equals_uninterrupted():
    async def main():
        cfg = Cfg(over_sampling=1.5, dynamic_filter=True)
        prompts = make_prompts(30, ("mixed", "all0"))
        engine = FakeEngine()
        full = await drive(make_manager(cfg, engine, prompts=prompts), engine, 4)

        engine = FakeEngine()
        mgr = make_manager(cfg, engine, prompts=prompts)
        first = await drive(mgr, engine, 2)
        state = json.loads(json.dumps(mgr.state_dict()))
        mgr2 = make_manager(cfg, engine, prompts=prompts)
        mgr2.load_state_dict(state)
        rest = await drive(mgr2, engine, 2, start_step=2)
        assert [key(b) for b in first + rest] == [key(b) for b in full]
        assert mgr2.stats()["balanced"]

    asyncio.run(main())


def test_concurrency_limit_and_transport_retries():
    async def main():
        from rollout_fake_engine import FlakyTransport

        engine = FakeEngine(token_delay_s=0.0005)
        flaky = FlakyTransport(engine.transport(), fail_first=5)
        client = EngineClient("http://fake", transport=flaky, admin_token="T", max_inflight=3, retry_backoff_s=0.001)
        mgr = RolloutManager(
            Cfg(rollout_batch_size=4), DataSource(make_prompts()), client, CharTokenizer(), reward_fn=label_reward
        )
        batch = await mgr.next_batch(0)
        assert len(batch) == 16 and engine.max_active == 3
        assert flaky.failures == 5 and client.transport_errors == 5 and mgr.stats()["generate_errors"] == 0
        await mgr.close()

    asyncio.run(main())


def test_eval_every_k_steps_with_pass_at_k():
    async def main():
        engine = FakeEngine()
        first_even = lambda s: float(s.response_tokens[0] % 2 == 0)
        cfg = Cfg(eval_every=2, eval_n_samples=4)
        held_out = make_prompts(6)
        mgr = make_manager(cfg, engine, reward_fn=first_even, eval_prompts=held_out)
        assert await mgr.maybe_evaluate(1) is None
        m = await mgr.maybe_evaluate(2)
        assert set(m) >= {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/greedy_accuracy", "eval/mean_reward"}
        # recompute from the engine's deterministic tokens
        tok = CharTokenizer()
        from furlong.rollout.eval import pass_at_k
        from furlong.rollout.generate import derive_seed

        counts, greedy = [], []
        for p in held_out:
            ids = tok.encode(p.prompt)
            c = sum(
                engine.next_token({"seed": derive_seed("eval", 7, p.index, j)}, 0, ids)[0] % 2 == 0 for j in range(4)
            )
            counts.append(c)
            greedy.append(engine.next_token({"temperature": 0.0}, 0, ids)[0] % 2 == 0)
        assert m["eval/pass@1"] == pytest.approx(sum(c / 4 for c in counts) / 6)
        assert m["eval/pass@4"] == pytest.approx(sum(c > 0 for c in counts) / 6)
        assert m["eval/pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in counts) / 6)
        assert m["eval/greedy_accuracy"] == pytest.approx(sum(greedy) / 6)
        assert mgr.stats()["evals"] == 1
        await mgr.close()

    asyncio.run(main())


def test_exhausted_data_source_and_bad_config():
    async def main():
        engine = FakeEngine()
        client = EngineClient("http://fake", transport=engine.transport())
        source = DataSource(make_prompts(5), num_epochs=1)
        mgr = RolloutManager(Cfg(rollout_batch_size=3), source, client, CharTokenizer(), reward_fn=label_reward)
        await mgr.next_batch(0)
        with pytest.raises(RolloutExhausted, match="2 of 3 groups"):
            await mgr.next_batch(1)
        await mgr.close()
        with pytest.raises(ValueError, match="rollout.mode"):
            RolloutManager(Cfg().model_copy(update={"mode": "fast"}), source, client)
        with pytest.raises(ValueError, match="rollout.reward_fn"):
            RolloutManager(Cfg().model_copy(update={"reward_fn": "no_such_module:fn"}), source, client)

    asyncio.run(main())


def test_reward_post_fn_reshapes_the_formed_batch_sync_or_async():
    """`rollout.reward_post_fn` sees the whole batch once it is formed (indices set) and sets each reward."""

    async def shift(samples):
        return [0.5 + (s.index % 2) / 4 for s in samples]

    async def main():
        engine = FakeEngine()
        for fn in (shift, lambda samples: [float(s.group_index) for s in samples]):
            mgr = make_manager(Cfg(), engine, reward_post_fn=fn)
            batch = await mgr.next_batch(0)
            want = await fn(batch) if fn is shift else fn(batch)
            assert [s.reward for s in batch] == want
            await mgr.close()

    asyncio.run(main())


def test_a_shared_weight_version_is_asked_not_copied():
    """In a run the driver owns the version: the manager measures staleness against the owner's current one."""
    from furlong.core.version import WeightVersion

    async def main():
        engine, owner = FakeEngine(), WeightVersion(0)
        mgr = make_manager(Cfg(), engine, weights=owner)
        await mgr.next_batch(0)
        await mgr.before_weight_sync()
        owner.advance(1)  # the weight sync moved it
        assert mgr.version == 1 and mgr.stats()["version"] == 1
        await mgr.on_weights_updated(1)  # equal: a no-op
        with pytest.raises(ValueError, match="older"):
            await mgr.on_weights_updated(0)
        state = mgr.state_dict()
        await mgr.close()
        other = WeightVersion(5)
        mgr2 = make_manager(Cfg(), engine, weights=other)
        mgr2.load_state_dict(state)  # the driver restores its owner itself, from its own checkpoint state
        assert other.current == 5 and mgr2.version == 5
        await mgr2.close()

    asyncio.run(main())
