"""The rewards library (furlong/rewards/): each reward as the plug point `rollout.reward_fn` loads it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from furlong.config import registry


def _sample(text: str, label, **meta):
    return SimpleNamespace(metadata={"response_text": text, **meta}, label=label, prompt="q", tokens=[], index=0)


@pytest.mark.timeout(120)
def test_math_verify_reward_equivalences():
    fn = registry.load_plugin("rollout.reward_fn", "furlong.rewards.math:math_verify_reward")
    cases = [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("We get $x = 0.5$.", "\\frac{1}{2}", 1.0),
        ("\\boxed{42}", "42", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("The total is $2\\sqrt{2}$", "\\sqrt{8}", 1.0),
        ("no answer here", "7", 0.0),
    ]

    async def go():
        return [await fn(_sample(text, gold)) for text, gold, _ in cases]

    got = asyncio.run(go())
    assert [r["score"] for r in got] == [want for *_, want in cases]
    assert all(r["timeout"] == 0.0 for r in got)


@pytest.mark.timeout(120)
def test_math_verify_timeout_is_furlongs_and_the_worker_is_replaced():
    from furlong.rewards import math as m

    async def go():
        assert (await m.check("2", "\\boxed{2}"))[0]  # the worker is up
        t0 = time.monotonic()
        # SymPy evaluating a power tower never finishes: furlong's timeout fires, kills the worker, scores 0
        got = await m.check("1", "\\boxed{9^{9^{9^{9}}}}", timeout_s=2.0)
        took = time.monotonic() - t0
        assert got == (False, True) and m._POOL is None, got
        return took, await m.check("3", "\\boxed{3}")  # a fresh worker serves the next call

    took, after = asyncio.run(go())
    assert after == (True, False)
    assert took < 30


def test_gsm8k_final_number():
    fn = registry.load_plugin("rollout.reward_fn", "furlong.rewards.math:gsm8k_reward")
    assert fn(_sample("She pays 3 * 4 = 12 dollars.\n#### 12", "#### 12")) == 1.0
    assert fn(_sample("3 + 4 = 7, then 7 * 2 = 14", "14")) == 1.0  # no ####: the last number
    assert fn(_sample("It costs 1,234 dollars", "1234")) == 1.0
    assert fn(_sample("#### 13", "12")) == 0.0
    assert fn(_sample("no number", "12")) == 0.0


def test_format_rewards():
    fmt = registry.load_plugin("rollout.reward_fn", "furlong.rewards.format:think_answer_format")
    tag = registry.load_plugin("rollout.reward_fn", "furlong.rewards.format:answer_tag_reward")
    good = "<think>3 + 4 is 7</think>\n<answer>7</answer>"
    assert fmt(_sample(good, "7")) == 1.0
    assert fmt(_sample("<answer>7</answer>", "7")) == 0.0
    assert fmt(_sample(good + " extra", "7")) == 0.0
    assert tag(_sample(good, "7")) == {"score": 1.0, "format": 1.0}
    assert tag(_sample("<answer> 8 </answer>", "7")) == {"score": 0.0, "format": 0.0}


@pytest.mark.timeout(120)
def test_code_tests_reward_counts_cases_in_the_sandbox():
    fn = registry.load_plugin("rollout.reward_fn", "furlong.rewards.code:code_tests_reward")
    cases = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]
    text = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"

    async def go():
        good = await fn(_sample(text, None, test_cases=cases))
        broken = await fn(_sample("```python\ndef add(a, b) return\n```", None, test_cases=cases))
        return good, broken

    good, broken = asyncio.run(go())
    assert (good["passed"], good["total"], good["sandbox_ok"]) == (2.0, 3.0, 1.0)
    assert good["score"] == pytest.approx(2 / 3)
    assert broken["score"] == 0.0 and broken["sandbox_ok"] == 0.0
    with pytest.raises(ValueError, match="test_cases"):
        asyncio.run(fn(_sample(text, None)))


@pytest.mark.timeout(120)
def test_llm_judge_calls_the_served_engine(monkeypatch):
    """A real HTTP server on 127.0.0.1 speaking the OpenAI chat route; it says yes when the reference is in
    the response it is shown, so the test checks what the reward sends and how it reads the reply."""
    from fastapi import FastAPI

    from furlong.core.app_thread import AppThread

    seen = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        seen.append(body)
        text = body["messages"][-1]["content"]
        response = text.split("Response to grade:\n", 1)[1]
        reference = text.split("Reference answer:\n", 1)[1].split("\n", 1)[0]
        return {"choices": [{"message": {"role": "assistant", "content": "Yes" if reference in response else "No"}}]}

    server = AppThread(app).start()
    try:
        monkeypatch.setenv("FURLONG_JUDGE_URL", server.url)
        fn = registry.load_plugin("rollout.reward_fn", "furlong.rewards.judge:llm_judge_reward")
        right = asyncio.run(fn(_sample("it is 42", "42", question="6 * 7?")))
        wrong = asyncio.run(fn(_sample("it is 41", "42", question="6 * 7?")))
    finally:
        server.stop()
    assert (right, wrong) == ({"score": 1.0}, {"score": 0.0})
    assert seen[0]["temperature"] == 0.0 and "6 * 7?" in seen[0]["messages"][0]["content"]
