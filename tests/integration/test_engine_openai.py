"""The engine over real HTTP on 127.0.0.1: the official `openai` client, raw `/generate`, tokenize."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from furlong.core.net import free_port
from furlong.engine.engine import Engine
from furlong.engine.server import ServerThread
from furlong.models import create_model, load_tokenizer

MSGS = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def server():
    path = create_model("qwen3", "tiny")
    eng = Engine(path, kv_cache_mb=2).start()
    with ServerThread(eng) as srv:
        yield srv, AutoModelForCausalLM.from_pretrained(path).eval()
    eng.stop()


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_chat_completion_logprobs_equal_hf(server):
    srv, hf = server
    out = client(srv.url).chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        temperature=1.0,
        seed=5,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    d = out.model_dump()
    prompt, ids = d["prompt_token_ids"], d["choices"][0]["token_ids"]
    tok = httpx.post(srv.url + "/tokenize", json={"messages": MSGS}).json()["tokens"]
    assert prompt == tok and len(ids) == 12 == out.usage.completion_tokens
    entries = out.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in ids]
    lp = hf_logprobs(hf, prompt + ids)
    for i, (e, t) in enumerate(zip(entries, ids)):
        assert abs(e.logprob - lp[len(prompt) - 1 + i, t].item()) < 1e-4
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
    assert out.choices[0].message.content == load_tokenizer(create_model("qwen3", "tiny")).decode(
        ids, skip_special_tokens=True
    )


def test_streaming_chat_equals_non_streaming(server):
    srv, _ = server
    c = client(srv.url)
    kw = dict(model="tiny", messages=MSGS, max_tokens=16, temperature=0, logprobs=True)
    full = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    lps = [e.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert text == full.choices[0].message.content
    assert lps == pytest.approx([e.logprob for e in full.choices[0].logprobs.content], abs=1e-6)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_and_n(server):
    srv, _ = server
    out = client(srv.url).completions.create(
        model="tiny", prompt="What is", max_tokens=6, logprobs=2, n=3, seed=1, extra_body={"ignore_eos": True}
    )
    assert len(out.choices) == 3 and all(len(ch.logprobs.token_logprobs) == 6 for ch in out.choices)
    assert all(len(top) <= 2 for ch in out.choices for top in ch.logprobs.top_logprobs)
    assert len({ch.text for ch in out.choices}) > 1  # three different samples


def test_raw_generate_shape_and_logprobs(server):
    srv, hf = server
    ids = [5, 6, 7, 8]
    r = httpx.post(
        srv.url + "/generate",
        json={
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 0,
            "rid": "abc",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "seed": 3, "ignore_eos": True},
        },
    )
    assert r.status_code == 200, r.text
    d = r.json()
    m = d["meta_info"]
    assert m["id"] == "abc" and m["finish_reason"] == {"type": "length", "length": 8}
    assert m["prompt_tokens"] == 4 and m["completion_tokens"] == 8 == len(d["output_ids"])
    assert [t for _, t, _ in m["output_token_logprobs"]] == d["output_ids"]
    assert all(x is None for _, _, x in m["output_token_logprobs"])
    assert m["output_token_versions"] == [m["weight_version"]] * 8
    lp = hf_logprobs(hf, ids + d["output_ids"])
    assert max(abs(v - lp[3 + i, t].item()) for i, (v, t, _) in enumerate(m["output_token_logprobs"])) < 1e-4
    assert m["input_token_logprobs"][0][0] is None
    assert max(abs(v - lp[i - 1, t].item()) for i, (v, t, _) in enumerate(m["input_token_logprobs"]) if i) < 1e-4
    again = httpx.post(
        srv.url + "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "seed": 3, "ignore_eos": True},
        },
    )
    assert again.json()["output_ids"] == d["output_ids"]
    batch = httpx.post(
        srv.url + "/generate", json={"text": ["hello", "What is"], "sampling_params": {"max_new_tokens": 3}}
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    with httpx.stream(
        "POST",
        srv.url + "/generate",
        json={
            "input_ids": ids,
            "stream": True,
            "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
        },
    ) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length" and len(events[-1]["output_ids"]) == 30


def test_tokenize_detokenize_info_metrics(server):
    srv, _ = server
    toks = httpx.post(srv.url + "/tokenize", json={"prompt": "What is 12 + 30?"}).json()
    assert toks["count"] == len(toks["tokens"])
    assert httpx.post(srv.url + "/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == "What is 12 + 30?"
    info = httpx.get(srv.url + "/get_model_info").json()
    assert info["architecture"] == "qwen3" and info["backend"] == "NativeModel"
    assert httpx.get(srv.url + "/health_generate").status_code == 200
    text = httpx.get(srv.url + "/metrics").text
    assert "# TYPE furlong_engine_generation_tokens_total counter" in text
    assert any(
        line.startswith("furlong_engine_requests_total ") and float(line.split()[1]) >= 1 for line in text.splitlines()
    )
    assert client(srv.url).models.list().data[0].id


# ---------------------------------------------------------------- tool calls on a scripted model
TOOL_JSON = '{"name": "sum", "arguments": {"a": 2, "b": 3}}'


class ScriptedModel:
    """A stand-in forward whose next token continues a fixed script, so the output is known.

    Everything around it — scheduler, detokenisation, tool-call parsing, HTTP —
    is the real engine; only the logits are dictated.
    """

    is_moe = False
    needs_tokens = True

    def __init__(self, script: list[int], vocab: int):
        self.script, self.vocab = script, vocab

    def forward(self, b):
        rows = []
        for row in b.logit_rows.tolist():
            seq = b.seq_tokens[b.token_seq[row]][: int(b.positions[row]) + 1]
            k = next(
                j for j in range(len(self.script), -1, -1) if j <= len(seq) and seq[len(seq) - j :] == self.script[:j]
            )
            logits = torch.zeros(self.vocab)
            logits[self.script[min(k, len(self.script) - 1)]] = 10.0
            rows.append(logits)
        return torch.stack(rows), None


@pytest.fixture(scope="module")
def tool_server():
    eng = Engine(create_model("qwen3", "tiny"), kv_cache_mb=1)
    script = eng.tokenizer.encode(f"<tool_call>{TOOL_JSON}</tool_call><|im_end|>")
    eng.model = ScriptedModel(script, eng.vocab_size)
    eng.start()
    with ServerThread(eng) as srv:
        yield srv
    eng.stop()


def test_tool_call_parsed_from_output(tool_server):
    c = client(tool_server.url)
    tools = [{"type": "function", "function": {"name": "sum", "parameters": {"type": "object"}}}]
    out = c.chat.completions.create(model="m", messages=MSGS, tools=tools, max_tokens=64, temperature=0)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls"
    (call,) = ch.message.tool_calls
    assert call.function.name == "sum" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert not ch.message.content
    stream = list(
        c.chat.completions.create(model="m", messages=MSGS, tools=tools, max_tokens=64, temperature=0, stream=True)
    )
    calls = [tc for s in stream if s.choices for tc in (s.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["sum"]
    assert "".join(s.choices[0].delta.content or "" for s in stream if s.choices) == ""
    # Without tools in the request the text is returned as written.
    plain = c.chat.completions.create(model="m", messages=MSGS, max_tokens=64, temperature=0)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == f"<tool_call>{TOOL_JSON}</tool_call>"
    # A block that is not valid JSON stays in the content.
    from furlong.engine.openai_api import openai_tool_calls as parse_tool_calls

    assert parse_tool_calls("hi <tool_call>{oops</tool_call>") == ("hi <tool_call>{oops</tool_call>", [])
    content, calls = parse_tool_calls('a<tool_call>{"name": "f", "arguments": "{}"}</tool_call>b')
    assert content == "ab" and calls[0]["function"] == {"name": "f", "arguments": "{}"}


# ---------------------------------------------------------------- the CLI, as a real process
def test_furlong_serve_cli_with_admin_token(tmp_path):
    path = create_model("llama", "tiny")

    port = free_port()
    env = {**os.environ, "FURLONG_ADMIN_TOKEN": "s3cret", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "furlong.cli", "serve", "--model", str(path), "--port", str(port), "--kv-cache-mb", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.time() < deadline
            time.sleep(0.1)
        assert httpx.post(url + "/flush_cache").status_code == 401
        assert (
            httpx.post(
                url + "/pause_generation", json={"mode": "in_place"}, headers={"Authorization": "Bearer nope"}
            ).status_code
            == 401
        )
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url + "/flush_cache", headers=auth).status_code == 200
        r = httpx.post(
            url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
