"""The multi-turn generate function against a scripted `/generate` (real tokenizer, real EngineClient).

The scripted engine answers each request with the next scripted model turn, so the
tests can check token by token that the Sample holds exactly the engine's ids plus
the template glue and tool results, with the right masks, sources and versions.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from envs_scripted_engine import Script, Turn

from furlong.core.sample import Sample, Source, Status
from furlong.data import TASKS
from furlong.data.chat import encode_prompt
from furlong.envs.multiturn import generate
from furlong.models import load_tokenizer

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def calculator_sample(tok) -> Sample:
    p = TASKS["calculator"].make("train", 1, chat=True)[0]
    return Sample(
        prompt=p.prompt,
        tokens=encode_prompt(tok, p.prompt, p.metadata["tools"]),
        label=p.label,
        metadata=dict(p.metadata),
    )


def run(script: Script, sample: Sample, max_new_tokens: int = 200, **rollout) -> Sample:
    return asyncio.run(generate(script.ctx(**rollout), sample, {"max_new_tokens": max_new_tokens, "temperature": 1.0}))


def segments(s: Sample) -> list[tuple[str, list[int]]]:
    """Response tokens grouped into runs of one source."""
    out: list[tuple[str, list[int]]] = []
    for t, src in zip(s.response_tokens, s.token_sources):
        if out and out[-1][0] == src:
            out[-1][1].append(t)
        else:
            out.append((src, [t]))
    return out


def test_calculator_episode_keeps_engine_ids_and_appends_tool_suffix(tok):
    sample = calculator_sample(tok)
    expr, label = sample.metadata["expression"], sample.label
    script = Script(tok, [Turn(CALL % expr, version=3), Turn(f"Answer: {label}", version=4)])
    first, second = script.outputs(script.turns[0]), script.outputs(script.turns[1])
    prompt = list(sample.tokens)
    s = run(script, sample).validate()

    glue = f"\n<|im_start|>tool\n<tool_response>{label}</tool_response><|im_end|>\n<|im_start|>assistant\n"
    glue_ids = tok.encode(glue, add_special_tokens=False)
    assert s.tokens == prompt + first + glue_ids + second
    assert script.requests[1]["input_ids"] == prompt + first + glue_ids  # the engine saw exactly this
    assert s.status == Status.COMPLETED and s.reward == {
        "score": 1.0,
        "correct": 1.0,
        "used_tool": 1.0,
        "right_expression": 1.0,
        "copied_result": 1.0,
        "tool_calls": 1.0,
    }
    assert s.metadata["response_text"] == f"Answer: {label}"
    n1, ng = len(first), len(glue_ids)
    assert s.loss_mask == [1] * n1 + [0] * ng + [1] * len(second)
    assert s.token_versions == [3] * n1 + [-1] * ng + [4] * len(second)
    assert s.rollout_logprobs == [-0.5] * n1 + [0.0] * ng + [-0.5] * len(second)
    runs = segments(s)
    assert [src for src, _ in runs] == ["policy", "template", "tool", "template", "policy"]
    assert tok.decode(runs[2][1]) == str(label)  # only the tool's text is sourced `tool`


def test_turn_limit_truncates(tok):
    sample = calculator_sample(tok)
    script = Script(tok, [Turn(CALL % "1+1")] * 3)
    s = run(script, sample, max_turns=2).validate()
    assert s.status == Status.TRUNCATED and "turn limit" in s.status_reason
    assert len(script.requests) == 2 and s.metadata["multiturn"]["turns"] == 2
    assert s.reward["correct"] == 0.0 and s.reward["score"] == 0.2 and s.reward["tool_calls"] == 2.0  # called, wrongly


def test_budget_covers_the_whole_response(tok):
    sample = calculator_sample(tok)
    script = Script(tok, [Turn(CALL % "1+1"), Turn("Answer: 2")])
    n = len(script.outputs(script.turns[0]))
    s = run(script, sample, max_new_tokens=n + 5).validate()  # the observation does not fit
    assert s.status == Status.TRUNCATED and "budget" in s.status_reason
    assert s.response_length == n and len(script.requests) == 1


def test_length_cut_ends_the_episode_and_is_scored(tok):
    sample = calculator_sample(tok)
    script = Script(tok, [Turn("Answer: " + "1" * 50, end=False)])
    s = run(script, sample, max_new_tokens=8).validate()
    assert s.status == Status.TRUNCATED and s.response_length == 8 and s.reward["score"] == 0.0


def test_unfinished_turn_without_im_end_gets_the_whole_closing(tok):
    sample = calculator_sample(tok)
    script = Script(tok, [Turn(CALL % "2*3", end=False), Turn("Answer: 6")])
    first = script.outputs(script.turns[0])
    s = run(script, sample).validate()
    glue = tok.encode("<|im_end|>\n<|im_start|>tool\n", add_special_tokens=False)
    assert s.response_tokens[len(first) : len(first) + len(glue)] == glue


def test_abort_mid_turn_resumes_from_the_tokens_so_far(tok):
    sample = calculator_sample(tok)
    expr, label = sample.metadata["expression"], sample.label
    call_ids = Script(tok, []).outputs(Turn(CALL % expr))
    cut = len(call_ids) // 2
    script = Script(tok, [])
    script.turns = [Turn("", version=1, finish="abort"), Turn("", version=2), Turn(f"Answer: {label}", version=2)]
    # The aborted request returns the first half of the call; the resumed one the rest.
    half1, half2 = call_ids[:cut], call_ids[cut:]
    script.outputs = lambda turn, it=iter([half1, half2, script.outputs(Turn(f"Answer: {label}"))]): next(it)  # noqa: B008
    s = run(script, sample)
    assert s.status == Status.ABORTED and s.response_tokens == half1
    s = run(script, s).validate()
    assert s.status == Status.COMPLETED and s.reward["score"] == 1.0
    assert s.response_tokens[: len(call_ids)] == call_ids
    assert s.token_versions[:cut] == [1] * cut and s.token_versions[cut : len(call_ids)] == [2] * (len(call_ids) - cut)
    assert script.requests[1]["input_ids"] == sample.tokens[: sample.prompt_length] + half1


def test_failing_and_slow_tools_become_observations(tok):
    sample = calculator_sample(tok)
    script = Script(tok, [Turn(CALL % "slow" + CALL % "other"), Turn("Answer: 0")])
    ctx = script.ctx()
    ctx.envs = SimpleNamespace(name="calculator", environment=None, tools=[], tool_fn=_slow_tool, timeout_s=0.2)
    s = asyncio.run(generate(ctx, sample, {"max_new_tokens": 300}))
    text = tok.decode(s.response_tokens)
    assert "timed out after 0.2 s" in text and "RuntimeError: boom" in text
    assert s.status == Status.COMPLETED


async def _slow_tool(name: str, arguments: dict) -> str:
    if arguments.get("expression") == "slow":
        await asyncio.sleep(5)
    raise RuntimeError("boom")


def test_reward_plug_point_is_left_to_the_manager(tok):
    sample = calculator_sample(tok)
    script = Script(tok, [Turn("Answer: 1")])
    s = run(script, sample, reward_fn="my.rewards:fn")
    assert s.status == Status.COMPLETED and s.reward is None


def test_sample_round_trips_through_json(tok):
    sample = calculator_sample(tok)
    script = Script(tok, [Turn(CALL % "2*3"), Turn("Answer: 6")])
    s = run(script, sample).validate()
    again = Sample.from_json(s.to_json()).validate()
    assert again.tokens == s.tokens and again.token_sources == s.token_sources
    assert Source.TOOL.value in again.token_sources
