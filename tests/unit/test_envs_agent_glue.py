"""`rollout.agent_fn` glue, session defaults and budget, and conversation demonstrations, on a scripted engine.

The warm-up only helps RL if a demonstrated conversation has the very token ids a
rollout of the same conversation produces: checked here against both rollout paths
(`multiturn.generate` and the built-in agent on a TITO session).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from envs_scripted_engine import Script, Turn

from furlong.core.sample import Sample, Status
from furlong.data import CALCULATOR_TOOL, TASKS
from furlong.data.chat import conversation_sample, encode_prompt
from furlong.data.tasks import score_integer
from furlong.envs import agent as glue
from furlong.envs.calculator import write_demonstrations
from furlong.envs.multiturn import generate as multiturn_generate
from furlong.envs.session_server import ServerThread, SessionServer
from furlong.envs.session_store import template_tools
from furlong.models import load_tokenizer

EXPR = "12 * 34 + 56"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34 + 56"}}</tool_call>'
USER = {"role": "user", "content": f"Use the calculator to compute {EXPR}."}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def demo(tools):
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": {"expression": EXPR}}}
    return [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "464"},
        {"role": "assistant", "content": "Answer: 464"},
    ]


def test_demonstration_matches_a_multiturn_rollout(tok):
    tools = [CALCULATOR_TOOL]
    want = conversation_sample(tok, demo(tools), tools).validate()
    script = Script(tok, [Turn(CALL), Turn("Answer: 464")])
    ctx = script.ctx(max_turns=2)
    ctx.envs = SimpleNamespace(name="calculator")
    s = Sample(prompt=[USER], tokens=encode_prompt(tok, [USER], tools), label=464, metadata={"tools": tools})
    s = asyncio.run(multiturn_generate(ctx, s, {"max_new_tokens": 96}))
    assert s.tokens == want.tokens and s.loss_mask == want.loss_mask and s.token_sources == want.token_sources
    assert s.reward == {
        "score": 1.0,
        "correct": 1.0,
        "used_tool": 1.0,
        "right_expression": 0.0,
        "copied_result": 1.0,
        "tool_calls": 1.0,
    }
    # Only the two assistant turns (and their end-of-turn tokens) are trained.
    trained = [t for t, m in zip(want.response_tokens, want.loss_mask) if m]
    assert tok.decode(trained) == CALL + "<|im_end|>" + "Answer: 464<|im_end|>"


def test_conversation_sample_rejects_a_conversation_without_a_reply(tok):
    with pytest.raises(ValueError, match="at least one assistant turn"):
        conversation_sample(tok, [USER])


@pytest.fixture
def scripted_sessions(tok):
    """A session server for the glue whose engine is a script (registered as this process's server)."""
    servers = []

    def start(turns):
        script = Script(tok, turns)
        server = ServerThread(SessionServer("http://engine", tok, transport=script.transport())).__enter__()
        glue._servers["http://engine"] = server
        servers.append(server)
        return script, server

    yield start
    glue._servers.pop("http://engine", None)
    for s in servers:
        s.__exit__()


def test_tool_agent_episode_through_the_glue(tok, scripted_sessions):
    script, server = scripted_sessions([Turn(CALL), Turn("Answer: 464")])
    ctx = script.ctx(max_turns=2, agent_fn="furlong.envs.agent:tool_agent")
    ctx.envs = SimpleNamespace(name="calculator")
    tools = [CALCULATOR_TOOL]
    s = Sample(
        index=5,
        group_index=2,
        prompt=[USER],
        tokens=encode_prompt(tok, [USER], tools),
        label=464,
        metadata={"tools": tools, "prompt_index": 7},
    )
    out = asyncio.run(glue.generate(ctx, s, {"max_new_tokens": 96, "temperature": 0.5, "seed": 11}))
    out.validate()
    # The session's tokens are the demonstration's (tools rendered as a session renders them).
    want = conversation_sample(tok, demo(None), template_tools(tools))
    assert out.tokens == want.tokens and out.loss_mask == want.loss_mask
    assert (out.index, out.group_index, out.label, out.metadata["prompt_index"]) == (5, 2, 464, 7)
    assert out.reward == {
        "score": 1.0,
        "correct": 1.0,
        "used_tool": 1.0,
        "right_expression": 0.0,
        "copied_result": 1.0,
        "tool_calls": 1.0,
    }
    assert Status(out.status) == Status.COMPLETED and out.metadata["response_text"] == "Answer: 464"
    # The rollout's sampling settings reach the engine; each turn has its own seed; the budget caps each turn.
    params = [r["sampling_params"] for r in script.requests]
    assert [p["temperature"] for p in params] == [0.5, 0.5] and params[0]["seed"] != params[1]["seed"]
    assert params[0]["max_new_tokens"] == 96 and params[1]["max_new_tokens"] == 96 - (
        len(want.response_tokens) - len(tok.encode("Answer: 464")) - 1
    )
    assert server.server.stats()["sessions_open"] == 0


def test_budget_refusal_ends_the_episode_truncated(tok, scripted_sessions):
    script, server = scripted_sessions([Turn(CALL)])
    ctx = script.ctx(max_turns=3, agent_fn="furlong.envs.agent:tool_agent")
    tools = [CALCULATOR_TOOL]
    s = Sample(
        prompt=[USER],
        tokens=encode_prompt(tok, [USER], tools),
        label=464,
        metadata={"tools": tools, "task": "calculator"},
    )
    n_call = len(tok.encode(CALL)) + 1
    out = asyncio.run(glue.generate(ctx, s, {"max_new_tokens": n_call + 3}))  # no room for the tool result
    assert Status(out.status) == Status.TRUNCATED and out.status_reason == "token budget used up"
    assert out.response_length == n_call and out.metadata["budget_exhausted"] is True
    assert out.reward is None, "no environment configured: the manager's task reward scores it"
    assert server.server.stats()["budget_refusals"] == 1 and len(script.requests) == 1


def test_session_sampling_defaults_are_checked(tok):
    server = SessionServer("http://engine", tok)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app()), base_url="http://s")

    async def go():
        bad = await http.post("/sessions", json={"sampling": {"temprature": 1.0}})
        budget = await http.post("/sessions", json={"max_new_tokens": 0})
        return bad, budget

    bad, budget = asyncio.run(go())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling" and "temprature" in bad.text
    assert budget.status_code == 400 and budget.json()["error"]["param"] == "max_new_tokens"


def test_calculator_demonstrations(tmp_path):
    path = write_demonstrations(tmp_path / "d.jsonl", 200, seed=1, flawed=0.5)
    demos = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(demos) == 200
    with_tool = [d for d in demos if any(m.get("tool_calls") for m in d["messages"])]
    assert 70 < len(with_tool) < 130
    labels = {p.prompt[0]["content"]: p.label for p in TASKS["calculator"].make("train", 200, seed=8, chat=True)}
    for d in demos:
        label, final = labels[d["messages"][0]["content"]], d["messages"][-1]["content"]
        assert score_integer(final, label) == (1.0 if d in with_tool else 0.0)
        assert d["tools"] == template_tools([CALCULATOR_TOOL])
    with pytest.raises(ValueError, match="flawed"):
        write_demonstrations(tmp_path / "x.jsonl", 1, flawed=2.0)


def test_driver_warmup_reads_conversation_demonstrations(tmp_path, tok):
    """`data.sft_path` with whole conversations: the driver's warm-up samples are `conversation_sample`s."""
    from furlong.config import load_config
    from furlong.data.sft import sft_samples, sft_source

    path = write_demonstrations(tmp_path / "d.jsonl", 8, seed=2, flawed=0.5)
    cfg = load_config(None, [f"data.sft_path={path}", "data.task=calculator"])
    prompts = sft_source(cfg.data, None, seed=cfg.seed).next_batch(8)
    got = sft_samples(prompts, tok, chat=True)
    demos = {json.dumps(d["messages"][0]): d for d in map(json.loads, path.read_text().splitlines())}
    for p, s in zip(prompts, got):
        d = demos[json.dumps(p.prompt[0])]
        want = conversation_sample(tok, d["messages"], d["tools"])
        assert s.tokens == want.tokens and s.loss_mask == want.loss_mask and s.validate()
