"""Tool-call parsing and execution, suffix tokenisation, and how an environment is chosen."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from furlong.core.sample import Sample
from furlong.core.tool_calls import ToolCall, parse_tool_calls
from furlong.data.chat import closing, missing_closing, suffix_ids
from furlong.envs.calculator import CalculatorEnvironment, calculator
from furlong.envs.protocol import ToolEnvironment, build_environment
from furlong.envs.tools import MAX_RESULT_CHARS, execute, execute_all
from furlong.models import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_parse_tool_calls():
    text = 'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    content, calls, errors = parse_tool_calls(text)
    assert content == "Let me compute." and errors == []
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2*3"})]
    # arguments as a JSON string (the OpenAI wire form), two calls, and one broken block kept in the content
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "b"}</tool_call><tool_call>{oops}</tool_call>'
    )
    content, calls, errors = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert content == "<tool_call>{oops}</tool_call>" and len(errors) == 1 and "oops" in errors[0]
    for bad in ('{"name": 3}', '{"name": "a", "arguments": [1]}', "[1, 2]"):
        content, calls, errors = parse_tool_calls(f"<tool_call>{bad}</tool_call>")
        assert calls == [] and len(errors) == 1 and content == f"<tool_call>{bad}</tool_call>"
    assert parse_tool_calls("no calls here") == ("no calls here", [], [])
    assert ToolCall("a", {"x": 1}).openai()["function"] == {"name": "a", "arguments": '{"x": 1}'}


def test_execute_turns_failures_into_text():
    async def slow(**kw):
        await asyncio.sleep(10)

    def blocking(x: int) -> int:
        time.sleep(0.05)
        return x * 2

    tools = {"calculator": calculator, "slow": slow, "blocking": blocking, "big": lambda: "z" * (MAX_RESULT_CHARS + 10)}

    async def go():
        assert await execute(ToolCall("calculator", {"expression": "12 * 34"}), tools, timeout_s=1) == "408"
        assert "unsupported expression" in await execute(
            ToolCall("calculator", {"expression": "__import__('os')"}), tools, timeout_s=1
        )
        assert await execute(ToolCall("slow", {}), tools, timeout_s=0.05) == "error: tool 'slow' timed out after 0.05 s"
        assert (
            await execute(ToolCall("nope", {}), tools, timeout_s=1)
            == "error: unknown tool 'nope'; available: ['big', 'blocking', 'calculator', 'slow']"
        )
        assert "TypeError" in await execute(ToolCall("calculator", {"wrong": 1}), tools, timeout_s=1)
        assert (await execute(ToolCall("big", {}), tools, timeout_s=1)).endswith("...[truncated]")
        # plain tools run in threads, concurrently: two 50 ms calls finish together, in call order
        msgs = await execute_all([ToolCall("blocking", {"x": 1}), ToolCall("blocking", {"x": 2})], tools, timeout_s=1)
        assert [m["content"] for m in msgs] == ["2", "4"] and all(m["role"] == "tool" for m in msgs)

    asyncio.run(go())


def test_suffix_ids_label_every_token(tok):
    assert closing(tok) == "<|im_end|>\n"
    assert missing_closing(tok, "hi<|im_end|>") == "\n" and missing_closing(tok, "hi") == "<|im_end|>\n"
    msgs = [{"role": "tool", "content": "408"}, {"role": "user", "content": "tool and user"}]
    ids, sources = suffix_ids(tok, msgs, after_output="x<|im_end|>")
    text = "\n<|im_start|>tool\n<tool_response>408</tool_response><|im_end|>\n<|im_start|>user\ntool and user<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(text, add_special_tokens=False)
    by_source: dict[str, str] = {}
    for t, s in zip(ids, sources):
        by_source[s] = by_source.get(s, "") + tok.decode([t])
    assert by_source["tool"] == "408" and by_source["env"] == "tool and user"
    assert "".join(by_source.values()).count("<|im_start|>") == 3  # the glue is all `template`
    ids, sources = suffix_ids(tok, [{"role": "tool", "content": "1"}])  # nothing to close
    assert tok.decode(ids).startswith("<|im_start|>tool")


def test_build_environment_picks_by_config_then_sample():
    calc = Sample(metadata={"task": "calculator"})
    assert isinstance(build_environment(None, calc), CalculatorEnvironment)
    assert type(build_environment(None, Sample(metadata={"task": "arithmetic"}))) is ToolEnvironment
    envs = SimpleNamespace(name=None, environment=None, tools=["calculator"], tool_fn=None, timeout_s=3.0)
    env = build_environment(envs, Sample())
    assert set(env.tools) == {"calculator"} and env.timeout_s == 3.0
    with pytest.raises(ValueError, match="envs.tools: unknown tool"):
        build_environment(SimpleNamespace(**{**envs.__dict__, "tools": ["shell"]}), Sample())
    with pytest.raises(ValueError, match="envs.name='chess'"):
        build_environment(SimpleNamespace(**{**envs.__dict__, "name": "chess"}), Sample())
    made = []
    factory = lambda config=None, seed=0: made.append(seed) or ToolEnvironment()
    build_environment(SimpleNamespace(**{**envs.__dict__, "environment": factory}), Sample(metadata={"seed": 5}))
    assert made == [5]


def test_calculator_reward_reads_only_the_final_turn():
    env = CalculatorEnvironment()

    async def go():
        s = Sample(label=408, metadata={"task": "calculator", "response_text": "Answer: 408"})
        _, done = await env.step(
            s, '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
        )
        assert not done
        assert await env.reward(s) == {
            "score": 1.0,
            "correct": 1.0,
            "used_tool": 1.0,
            "right_expression": 0.0,
            "copied_result": 1.0,
            "tool_calls": 1.0,
        }
        s.metadata["response_text"] = "I do not know"
        assert (await env.reward(s))["score"] == 0.2  # a well-formed call earns the lowest tier

    asyncio.run(go())


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@pytest.mark.parametrize(
    "turns,answer,tiers,score",
    [
        ([CALL % "12  *  34"], "408", True, 1.0),  # correct
        ([CALL % "12 * 34"], "7", True, 0.5),  # called right, answered carelessly
        ([CALL % "12 * 35"], "420", True, 0.5),  # called wrong, copied the result
        ([CALL % "12 * 35"], "7", True, 0.2),  # called wrong, answered carelessly
        (['<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>'], "7", True, 0.2),  # error result
        ([], "407", True, 0.0),
        ([], "408", True, 1.0),
        ([CALL % "12 * 34"], "7", False, 0.0),
    ],
)
def test_calculator_reward_tiers(turns, answer, tiers, score):
    """Correct 1.0; else 0.2 for a call, +0.3 for the question's expression, +0.3 for copying the result; `tiers: false`: 1 / 0."""
    env = CalculatorEnvironment(SimpleNamespace(timeout_s=5.0, connector={"tiers": tiers}))

    async def go():
        s = Sample(label=408, metadata={"task": "calculator", "expression": "12 * 34"})
        for t in turns:
            await env.step(s, t)
        s.metadata["response_text"] = answer
        return await env.reward(s)

    r = asyncio.run(go())
    assert r["score"] == pytest.approx(score) and r["correct"] == float(answer == "408")


def test_calculator_reward_reads_an_agents_calls_from_the_session_messages():
    """On a TITO session the agent runs the tools itself: the calls come from the recorded messages."""
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12 * 35"}'}}
    s = Sample(
        label=408,
        metadata={
            "expression": "12 * 34",
            "tool_calls": 1,
            "response_text": "420",
            "messages": [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "420"},
            ],
        },
    )
    r = asyncio.run(CalculatorEnvironment().reward(s))
    assert (r["right_expression"], r["copied_result"], r["score"]) == (0.0, 1.0, pytest.approx(0.5))
    with pytest.raises(ValueError, match="envs.connector"):
        CalculatorEnvironment(SimpleNamespace(timeout_s=1.0, connector={"tier": True}))
