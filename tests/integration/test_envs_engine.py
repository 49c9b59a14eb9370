"""Agentic rollout against a real `furlong serve` process with a tiny model.

The acceptance test of the TITO session server: a black-box agent written only with
the official `openai` client runs several turns, with tool results, against a session.
The session's Sample must hold exactly the engine's output ids (checked by replaying
each turn's request on the engine with its seed) plus the template/tool suffixes, and
HF's log-probs on the Sample's tokens (fp32, temperature 1) must equal the rollout
log-probs within 1e-4. The multi-turn generate function gets the same check, and the
`furlong envs sessions` command is started as a real process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from furlong.core.client import EngineClient
from furlong.core.net import free_port
from furlong.core.sample import Sample, Source, Status
from furlong.data import CALCULATOR_TOOL
from furlong.data.chat import encode_prompt
from furlong.envs.multiturn import generate
from furlong.envs.session_server import ServerThread, SessionServer
from furlong.models import load_tokenizer
from furlong.rollout.generate import RolloutContext
from tests.helpers import engine_process

TOKEN = "envs-test-token"
QUESTION = {"role": "user", "content": "Use the calculator to compute 12 * 34."}


def wait_healthy(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline, f"{what} did not become healthy"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def engine():
    with engine_process(TOKEN) as (url, path):
        yield url, path


@pytest.fixture(scope="module")
def hf(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine[1], dtype=torch.float32).eval()


def policy_logprobs_match(model, s: Sample) -> float:
    """Largest |HF log-prob - rollout log-prob| over the Sample's policy tokens (temperature 1, fp32)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([s.tokens])).logits[0].float(), -1)
    p = s.prompt_length
    diffs = [
        abs(lp[p + j - 1, s.tokens[p + j]].item() - s.rollout_logprobs[j])
        for j in range(s.response_length)
        if s.token_sources[j] == Source.POLICY.value
    ]
    assert diffs, "no policy tokens"
    return max(diffs)


def load_example():
    """The black-box agent of `examples/agent_openai_client/` (it imports only `openai`)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "agent_openai_client" / "agent.py"
    spec = importlib.util.spec_from_file_location("agent_openai_client", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_openai_agent_session_keeps_engine_ids_and_logprobs(engine, hf):
    url, path = engine
    tok = load_tokenizer(path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    with ServerThread(SessionServer(url)) as sessions:  # tokenizer found through the engine's /get_model_info
        sid = httpx.post(sessions.url + "/sessions", json={"metadata": {"task": "calculator"}, "label": 408}).json()[
            "id"
        ]
        # Seeds per turn make each request replayable. An untrained model calls no tool, so the agent
        # sends the calculator's result for the question after every turn (force_tool).
        messages = load_example().run(
            sessions.session_url(sid),
            QUESTION["content"],
            max_turns=3,
            force_tool="12 * 34",
            seed=100,
            max_tokens=8,
            temperature=1.0,
            logprobs=True,
        )
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        samples = [Sample.from_dict(d).validate() for d in httpx.get(f"{sessions.url}/sessions/{sid}/samples").json()]
        metrics = httpx.get(sessions.url + "/metrics").text
    assert len(samples) == 1, "one trajectory, one Sample"
    s = samples[0]
    assert s.metadata["turns"] == 3 and s.metadata["template_mismatch"] is False and s.label == 408
    assert "furlong_sessions_turns 3" in metrics

    # Rebuild the trajectory independently: replay each turn on the engine, then add the tool suffix.
    expected = encode_prompt(tok, [QUESTION], [CALCULATOR_TOOL["function"]])
    assert s.tokens[: s.prompt_length] == expected
    for turn in range(3):
        out = httpx.post(
            url + "/generate",
            json={
                "input_ids": expected,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "seed": 100 + turn},
            },
        ).json()
        assert out["output_ids"], "the engine produced a turn"
        expected = expected + out["output_ids"]
        if turn < 2:
            close = "\n" if out["output_ids"][-1] == im_end else "<|im_end|>\n"
            glue = close + "<|im_start|>tool\n<tool_response>408</tool_response><|im_end|>\n<|im_start|>assistant\n"
            expected = expected + tok.encode(glue, add_special_tokens=False)
    assert s.tokens == expected
    assert s.loss_mask == [int(src == "policy") for src in s.token_sources]
    assert s.token_sources.count("tool") == 2 * len(tok.encode("408", add_special_tokens=False))
    assert policy_logprobs_match(hf, s) < 1e-4


class ContinueEnv:
    """Feedback without tools: two `user` observations, then done; a constant reward."""

    def __init__(self, config=None, seed=0):
        pass

    async def reset(self, sample):
        return []

    async def step(self, sample, action):
        n = sample.metadata.setdefault("steps", 0)
        sample.metadata["steps"] = n + 1
        return ([{"role": "user", "content": f"Check step {n}."}], False) if n < 2 else ([], True)

    async def reward(self, sample):
        return 0.5


@pytest.mark.timeout(240)
def test_multiturn_generate_on_the_engine(engine, hf):
    url, path = engine
    tok = load_tokenizer(path)
    from types import SimpleNamespace

    async def go():
        async with EngineClient(url, admin_token=TOKEN) as client:
            ctx = RolloutContext(
                client=client, tokenizer=tok, config=SimpleNamespace(max_turns=5, reward_fn=None, group_reward_fn=None)
            )
            ctx.envs = SimpleNamespace(environment=ContinueEnv, tool_fn=None, timeout_s=5.0)
            prompt = [QUESTION]
            sample = Sample(prompt=prompt, tokens=encode_prompt(tok, prompt))
            # An untrained model seldom ends a turn by itself: every odd id ends one here, so turns stay short.
            params = {"max_new_tokens": 200, "temperature": 1.0, "seed": 7, "stop_token_ids": list(range(3, 512, 2))}
            return await generate(ctx, sample, params)

    s = asyncio.run(go()).validate()
    assert s.status == Status.COMPLETED and s.reward == 0.5 and s.metadata["multiturn"]["turns"] == 3
    assert s.token_sources.count("env") > 0 and s.token_sources.count("template") > 0
    text = tok.decode(s.tokens)
    assert "<|im_start|>user\nCheck step 0.<|im_end|>\n<|im_start|>assistant\n" in text
    assert policy_logprobs_match(hf, s) < 1e-4


@pytest.mark.timeout(120)
def test_sessions_command(engine):
    url, path = engine
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "furlong.cli",
        "envs",
        "sessions",
        "--engine",
        url,
        "--port",
        str(port),
        "--model",
        str(path),
    ]
    proc = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, "furlong envs sessions")
        sid = httpx.post(base + "/sessions").json()["id"]
        reply = OpenAI(base_url=f"{base}/sessions/{sid}/v1", api_key="unused").chat.completions.create(
            model="furlong", messages=[QUESTION], max_tokens=4, seed=1
        )
        assert reply.usage.completion_tokens == len(httpx.get(f"{base}/sessions/{sid}/samples").json()[0]["loss_mask"])
        history = [
            QUESTION,
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "More."},
        ]
        chunks = list(
            OpenAI(base_url=f"{base}/sessions/{sid}/v1", api_key="unused").chat.completions.create(
                model="furlong", messages=history, max_tokens=4, seed=2, stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        [sample] = httpx.get(f"{base}/sessions/{sid}/samples").json()  # the streamed turn extended the same Sample
        assert sample["metadata"]["turns"] == 2
        assert httpx.delete(f"{base}/sessions/{sid}").json()["deleted"] is True
    finally:
        proc.terminate()
        proc.wait(timeout=30)
