"""The TITO session server over HTTP (ASGI, no socket) in front of a scripted `/generate`.

Checks what the module docstring promises: appended messages are the only tokens
added, earlier model output is never re-tokenised, every engine call carries the
session's routing key, a rewind makes a branch that reuses the shared tokens, a
changed reply is reported as a template mismatch, a failed turn leaves no trace.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from envs_scripted_engine import Script, Turn

from furlong.core.sample import Sample
from furlong.data import CALCULATOR_TOOL
from furlong.data.chat import encode_prompt
from furlong.envs.session_server import SessionServer
from furlong.models import load_tokenizer

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}</tool_call>'
USER = {"role": "user", "content": "Use the calculator to compute 2 * 3."}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


class Harness:
    def __init__(self, tok, turns: list[Turn]):
        self.tok = tok
        self.script = Script(tok, turns)
        self.server = SessionServer("http://engine", tok, transport=self.script.transport())
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.server.app()), base_url="http://sessions")

    async def new(self, **body) -> str:
        r = await self.http.post("/sessions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["id"]

    async def chat(self, sid: str, messages: list[dict], **body) -> httpx.Response:
        return await self.http.post(
            f"/sessions/{sid}/v1/chat/completions", json={"messages": messages, "tools": [CALCULATOR_TOOL], **body}
        )

    async def samples(self, sid: str) -> list[Sample]:
        r = await self.http.get(f"/sessions/{sid}/samples")
        assert r.status_code == 200, r.text
        return [Sample.from_dict(d).validate() for d in r.json()]


def tool_msg(content: str = "6") -> dict:
    return {"role": "tool", "tool_call_id": "call_x", "content": content}


def test_turns_extend_one_sample_with_exact_ids(tok):
    async def go():
        h = Harness(tok, [Turn(CALL, version=1), Turn("Answer: 6", version=2)])
        out1 = h.script.outputs(h.script.turns[0])
        sid = await h.new(metadata={"task": "calculator"}, label=6)
        r1 = (await h.chat(sid, [USER], seed=1)).json()
        msg = r1["choices"][0]["message"]
        assert r1["choices"][0]["finish_reason"] == "tool_calls"
        assert msg["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "2 * 3"}'}
        # The agent echoes the reply with re-serialised arguments and content "" instead of None.
        echo = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "other",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{ "expression" : "2 * 3" }'},
                }
            ],
        }
        r2 = (await h.chat(sid, [USER, echo, tool_msg()], logprobs=True, return_token_ids=True)).json()
        assert r2["choices"][0]["message"]["content"] == "Answer: 6"
        assert [e["logprob"] for e in r2["choices"][0]["logprobs"]["content"]] == [-0.5] * len(
            r2["choices"][0]["token_ids"]
        )
        [s] = await h.samples(sid)
        prompt = encode_prompt(tok, [USER], [CALCULATOR_TOOL["function"]])
        glue = tok.encode(
            "\n<|im_start|>tool\n<tool_response>6</tool_response><|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        assert s.tokens == prompt + out1 + glue + r2["choices"][0]["token_ids"]
        assert h.script.requests[1]["input_ids"] == prompt + out1 + glue
        assert all(req["headers"]["x-routing-key"] == sid for req in h.script.requests)
        assert s.token_versions == [1] * len(out1) + [-1] * len(glue) + [2] * len(r2["choices"][0]["token_ids"])
        assert s.loss_mask.count(1) == len(out1) + len(r2["choices"][0]["token_ids"])
        assert s.label == 6 and s.metadata["task"] == "calculator" and s.metadata["turns"] == 2
        assert s.metadata["template_mismatch"] is False and h.server.stats().get("branches", 0) == 0

    asyncio.run(go())


def test_rewind_branches_and_reuses_the_shared_tokens(tok):
    async def go():
        h = Harness(tok, [Turn(CALL), Turn("Answer: 6"), Turn("Answer: 7")])
        sid = await h.new()
        msg = (await h.chat(sid, [USER])).json()["choices"][0]["message"]
        await h.chat(sid, [USER, msg, tool_msg("6")])
        await h.chat(sid, [USER, msg, tool_msg("7")])  # the agent rewinds: a different tool result
        first, branch = await h.samples(sid)
        assert branch.metadata["branch_of"] == 0 and branch.metadata["template_mismatch"] is False

        def glue(result: str) -> list[int]:
            text = f"\n<|im_start|>tool\n<tool_response>{result}</tool_response><|im_end|>\n<|im_start|>assistant\n"
            return tok.encode(text, add_special_tokens=False)

        t = len(h.script.requests[1]["input_ids"]) - len(glue("6"))  # prompt + the model's first reply
        assert branch.tokens[:t] == first.tokens[:t] and first.tokens[t : t + len(glue("6"))] == glue("6")
        assert branch.tokens[t : t + len(glue("7"))] == glue("7")
        assert h.script.requests[2]["input_ids"] == branch.tokens[: t + len(glue("7"))]
        r = t - branch.prompt_length
        assert (
            branch.rollout_logprobs[:r] == first.rollout_logprobs[:r]
            and branch.token_versions[:r] == first.token_versions[:r]
        )
        assert branch.prompt_length == first.prompt_length
        assert h.server.stats()["branches"] == 1 and h.server.stats().get("template_mismatches", 0) == 0

    asyncio.run(go())


def test_changed_reply_is_a_template_mismatch(tok):
    async def go():
        h = Harness(tok, [Turn(CALL), Turn("Answer: 6")])
        sid = await h.new()
        await h.chat(sid, [USER])
        edited = {"role": "assistant", "content": "I will call the calculator."}
        await h.chat(sid, [USER, edited, tool_msg()])
        first, second = await h.samples(sid)
        assert first.metadata["template_mismatch"] is False and second.metadata["template_mismatch"] is True
        assert second.metadata["branch_of"] is None  # nothing the model produced is shared
        assert "I will call the calculator." in tok.decode(second.tokens[: second.prompt_length])
        metrics = (await h.http.get("/metrics")).text
        assert "furlong_sessions_template_mismatches 1" in metrics

    asyncio.run(go())


def test_failed_turn_leaves_no_trace_and_errors_name_the_field(tok):
    async def go():
        h = Harness(tok, [Turn(CALL)])
        sid = await h.new()
        msg = (await h.chat(sid, [USER])).json()["choices"][0]["message"]
        before = [s.to_dict() for s in await h.samples(sid)]
        h.server._http = None  # the engine now refuses: its error is passed through, naming the field
        h.server.transport = httpx.MockTransport(
            lambda request: httpx.Response(400, json={"error": {"message": "too long", "param": "input_ids"}})
        )
        r = await h.chat(sid, [USER, msg, tool_msg()])
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"
        assert [s.to_dict() for s in await h.samples(sid)] == before
        assert (await h.chat(sid, [USER], n=2)).json()["error"]["param"] == "n"
        assert (await h.chat(sid, [])).json()["error"]["param"] == "messages"
        r = await h.http.post(f"/sessions/{sid}/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        gone = await h.http.delete(f"/sessions/{sid}")
        assert gone.json()["deleted"] is True and len(gone.json()["samples"]) == 1
        r = await h.chat(sid, [USER])
        assert r.status_code == 404 and r.json()["error"]["param"] == "session"

    asyncio.run(go())


def test_stream_sends_the_turn_as_chunks(tok):
    async def go():
        h = Harness(tok, [Turn(CALL)])
        sid = await h.new()
        r = await h.chat(sid, [USER], stream=True, stream_options={"include_usage": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.text.rstrip().endswith("data: [DONE]")
        calls = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "calculator"
        assert (
            events[-2]["choices"][0]["finish_reason"] == "tool_calls" and events[-1]["usage"]["completion_tokens"] > 0
        )

    asyncio.run(go())
