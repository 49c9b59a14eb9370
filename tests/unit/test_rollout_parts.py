"""The rollout manager's parts alone: client, generate, rewards, filters, buffer, pass@k."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import pytest
from rollout_fake_engine import FakeEngine, FlakyTransport

from furlong.core.client import EngineClient, EngineError
from furlong.core.sample import Sample, Status
from furlong.data.chat import encode_prompt
from furlong.rollout.buffer import Group, GroupBuffer
from furlong.rollout.eval import k_values, pass_at_k
from furlong.rollout.filters import apply_sample_filter, group_drop_reason, zero_variance
from furlong.rollout.generate import RolloutContext, apply_response, derive_seed, generate, reset_response
from furlong.rollout.rewards import check_reward, score_group, score_sample, task_reward


# ---------------------------------------------------------------- pass@k
@pytest.mark.parametrize("n,c", [(4, 0), (4, 1), (5, 2), (6, 6), (8, 3)])
def test_pass_at_k_equals_the_subset_average(n, c):
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_pass_at_k_rejects_bad_arguments_and_k_values():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6]


# ---------------------------------------------------------------- rewards
def done_sample(text: str = "Answer: 8", label=8, **meta) -> Sample:
    s = Sample(tokens=[5, 6], label=label, metadata={"response_text": text, **meta})
    s.append([7, 0], logprobs=[-0.5, -0.1], version=3)
    s.status = Status.COMPLETED
    return s


def test_rewards_sync_async_dict_and_failures():
    async def main():
        s = done_sample(task="arithmetic")
        assert await score_sample(s, task_reward) and s.reward == 1.0

        async def async_reward(sample):
            return {"score": 0.5, "len": sample.response_length}

        assert await score_sample(s, async_reward) and s.reward == {"score": 0.5, "len": 2.0}
        for bad, why in [
            (lambda x: 1 / 0, "ZeroDivisionError"),
            (lambda x: {"acc": 1}, "no 'score'"),
            (lambda x: math.nan, "not finite"),
            (lambda x: "1", "number"),
        ]:
            s = done_sample()
            assert not await score_sample(s, bad)
            assert (
                s.status == Status.FAILED
                and why in s.status_reason
                and s.reward is None
                and s.status_reason.startswith("reward_fn")
            )
        s = done_sample()  # no task in the metadata: the default reward says what to set
        assert not await score_sample(s, task_reward) and "rollout.reward_fn" in s.status_reason

        group = [done_sample(), done_sample()]
        assert not await score_group(group, lambda ss: [1.0])
        assert all(x.status == Status.FAILED and "2" in x.status_reason for x in group)
        group = [done_sample(), done_sample()]
        assert await score_group(group, lambda ss: [0.0, 1]) and [x.reward for x in group] == [0.0, 1.0]

    asyncio.run(main())


def test_check_reward():
    assert check_reward(True) == 1.0 and check_reward({"score": 2}) == {"score": 2.0}


# ---------------------------------------------------------------- filters
def test_filters_reasons_and_masks():
    async def main():
        same = [done_sample(), done_sample()]
        for s in same:
            s.reward = 1.0
        assert zero_variance(same) == "zero_variance" and zero_variance(same[:1]) is None
        same[1].reward = {"score": 0.0}
        assert zero_variance(same) is None
        assert await group_drop_reason(same, lambda g: False) == "dynamic_filter"
        assert await group_drop_reason(same, lambda g: "too_long") == "too_long"
        assert await group_drop_reason(same, None) is None
        with pytest.raises(TypeError, match="reason string"):
            await group_drop_reason(same, lambda g: 3)
        same[0].status = Status.FAILED
        assert await group_drop_reason(same, None) == "failed"
        same[0].metadata["reward_error"] = True
        assert await group_drop_reason(same, None) == "reward_error"

        group = [done_sample(), done_sample(), done_sample()]

        async def mask_second(s):
            return "short" if s is group[1] else None

        counts = await apply_sample_filter(group, mask_second)
        assert counts == {"short": 1} and group[1].loss_mask == [0, 0] and group[0].loss_mask == [1, 1]
        assert group[1].metadata["filtered"] == "short"

    asyncio.run(main())


# ---------------------------------------------------------------- generate
def response(ids, versions, finish="stop", logprobs=None):
    lps = logprobs or [-0.1 * (i + 1) for i in range(len(ids))]
    return {
        "text": "x",
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": finish},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
            "weight_version": versions[-1] if versions else 0,
            "output_token_versions": versions,
        },
    }


def test_apply_response_keeps_per_token_versions_and_status():
    s = Sample(tokens=[9, 9, 9])
    apply_response(s, response([1, 2], [4, 4], "abort"))
    assert s.status == Status.ABORTED and s.response_length == 2
    apply_response(s, response([3, 4, 5], [4, 5, 5], "length"))
    assert s.status == Status.TRUNCATED and s.token_versions == [4, 4, 4, 5, 5] and s.oldest_version() == 4
    assert s.rollout_logprobs == pytest.approx([-0.1, -0.2, -0.1, -0.2, -0.3]) and s.tokens == [9, 9, 9, 1, 2, 3, 4, 5]
    assert s.metadata["response_text"] == "xx"
    s.validate()
    with pytest.raises(EngineError, match="2 output_ids but 1 output_token_logprobs"):
        apply_response(Sample(), {**response([1], [0]), "output_ids": [1, 2]})
    with pytest.raises(EngineError, match="finish_reason"):
        apply_response(Sample(), response([1], [0], finish="weird"))
    with pytest.raises(EngineError, match="output_token_versions"):
        apply_response(Sample(), response([1, 2], [0]))
    reset_response(s)
    assert (
        s.tokens == [9, 9, 9]
        and s.response_length == 0
        and s.status == Status.PENDING
        and "response_text" not in s.metadata
    )
    s.validate()


def test_generate_resumes_with_the_remaining_budget():
    async def main():
        engine = FakeEngine()
        async with EngineClient("http://fake", transport=engine.transport()) as client:
            ctx = RolloutContext(client=client)
            s = Sample(tokens=[50, 51])
            s.append([7, 8, 9], logprobs=[-1.0, -1.0, -1.0], version=0)
            engine.version = 2
            s = await generate(ctx, s, {"temperature": 1.0, "max_new_tokens": 5, "seed": 3})
            assert engine.log[-1]["input_ids"] == [50, 51, 7, 8, 9]
            sent = len(engine.log[-1]["output_ids"])
            assert sent <= 2 and s.response_length == 3 + sent
            assert s.token_versions == [0, 0, 0] + [2] * sent and s.rollout_logprobs[:3] == [-1.0] * 3
            s.status = Status.ABORTED
            s.append([1] * (5 - s.response_length), version=2)
            n = len(engine.log)
            s = await generate(ctx, s, {"max_new_tokens": 5})
            assert s.status == Status.TRUNCATED and len(engine.log) == n  # nothing left to ask for

    asyncio.run(main())


def test_encode_prompt_text_and_chat(tiny_model_dir):
    from furlong.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    assert encode_prompt(tok, "What is 3 + 5? Answer:") == tok.encode(
        "What is 3 + 5? Answer:", add_special_tokens=False
    )
    msgs = [{"role": "user", "content": "What is 3 + 5?"}]
    ids = encode_prompt(tok, msgs)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and "What is 3 + 5?" in tok.decode(ids)
    with pytest.raises(ValueError, match="tokenizer"):
        encode_prompt(None, "x")


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(7, 3, 0, 1, 0) == derive_seed(7, 3, 0, 1, 0)
    seeds = {derive_seed(7, p, 0, j, 0) for p in range(50) for j in range(8)}
    assert len(seeds) == 400 and all(0 <= x < 2**31 for x in seeds)


# ---------------------------------------------------------------- client
def test_client_retries_transport_errors_then_fails_with_reason():
    async def main():
        engine = FakeEngine()
        flaky = FlakyTransport(engine.transport(), fail_first=2)
        async with EngineClient("http://fake", transport=flaky, max_retries=2, retry_backoff_s=0.001) as client:
            out = await client.generate([50], {"max_new_tokens": 3, "seed": 1})
            assert out["meta_info"]["completion_tokens"] >= 1 and flaky.failures == 2 and client.requests == 3
        flaky = FlakyTransport(engine.transport(), fail_first=10)
        async with EngineClient("http://fake", transport=flaky, max_retries=2, retry_backoff_s=0.001) as client:
            with pytest.raises(EngineError, match="failed 3 times; last error: ConnectError"):
                await client.generate([50], {"max_new_tokens": 3})
        engine.fail_prefix = {50}
        async with EngineClient(
            "http://fake", transport=engine.transport(), max_retries=1, retry_backoff_s=0.001
        ) as client:
            with pytest.raises(EngineError, match="HTTP 503"):
                await client.generate([50], {"max_new_tokens": 3})
            assert client.requests == 2
            with pytest.raises(EngineError, match="HTTP 400: .*max_new_tokens"):  # a bad request is not retried
                await client.generate([51], {"max_new_tokens": -1})
            assert client.requests == 3

    asyncio.run(main())


def test_client_hold_abort_and_admin_token():
    async def main():
        engine = FakeEngine(token_delay_s=0.002)
        async with EngineClient("http://fake", transport=engine.transport(), admin_token="T") as client:
            client.hold()
            task = asyncio.create_task(client.generate([50], {"max_new_tokens": 10_000, "seed": 1, "temperature": 1.0}))
            await asyncio.sleep(0.01)
            assert not engine.active and client.inflight == 0  # held at the gate
            client.release()
            while not engine.active or not next(iter(engine.active.values())):
                await asyncio.sleep(0.001)
            assert await client.abort_inflight() == 1
            out = await task
            assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 10_000
            await client.pause("retract")
            await client.resume()
        async with EngineClient("http://fake", transport=engine.transport(), admin_token="wrong") as client:
            with pytest.raises(EngineError, match="abort_request: HTTP 401"):
                await client.abort()

    asyncio.run(main())


# ---------------------------------------------------------------- buffer
def test_buffer_back_pressure_order_and_state():
    async def main():
        buf = GroupBuffer(2)
        buf.push(Group(seq=0, prompt_index=5, samples=[done_sample()]))
        buf.push(Group(seq=1, prompt_index=6, samples=[Sample(tokens=[1])]))
        with pytest.raises(RuntimeError, match="full"):
            buf.push(Group(seq=2, prompt_index=7, samples=[]))
        waiter = asyncio.create_task(buf.wait_for_space())
        await asyncio.sleep(0)
        assert not waiter.done()
        first = buf.popleft()
        await asyncio.wait_for(waiter, 1)
        assert first.seq == 0 and len(buf) == 1 and buf.free == 1
        with pytest.raises(RuntimeError, match="seq 0 after 1"):
            buf.push(first)
        state = json.loads(json.dumps(buf.state_dict()))
        other = GroupBuffer(3)
        other.load_state_dict(state)
        assert [g.to_dict() for g in other] == state
        other[0].samples[0].tokens.append(99)  # a loaded buffer never aliases the state it came from
        assert state[0]["samples"][0]["tokens"] == [1]
        with pytest.raises(ValueError, match="exceed capacity"):
            GroupBuffer(1).load_state_dict(state * 2)

    asyncio.run(main())
