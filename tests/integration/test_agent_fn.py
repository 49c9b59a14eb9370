"""`rollout.agent_fn`: the rollout manager runs a black-box agent per sample through a TITO session.

Against a real `furlong serve` process with a tiny model, the manager (given only
`rollout.agent_fn`) must: run the example agent — written with the official `openai`
client alone — on every sample; bring back the session's Sample with the engine's
exact ids (HF's log-probs on them equal the rollout log-probs within 1e-4), the
rollout's sampling settings (same seed -> same tokens; another seed -> others) and
token budget; take the agent's returned reward; and leave no session open.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from furlong.config.schema import RolloutConfig
from furlong.core.client import EngineClient
from furlong.core.sample import Sample, Source, Status
from furlong.data import CALCULATOR_TOOL, TASKS, DataSource
from furlong.data.chat import encode_prompt
from furlong.envs import agent as agent_glue
from furlong.models import load_tokenizer
from furlong.rollout.generate import RolloutContext
from furlong.rollout.manager import RolloutManager
from tests.helpers import engine_process

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_openai_client" / "agent.py"


@pytest.fixture(scope="module")
def engine():
    with engine_process("agent-test") as (url, path):
        yield url, path


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("agent_openai_client", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["agent_openai_client"] = module  # so the plug point's dotted path imports it
    yield module
    sys.modules.pop("agent_openai_client", None)


def rollout(url: str, tok, *, seed: int, max_new_tokens: int = 12, **cfg):
    config = RolloutConfig(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        max_new_tokens=max_new_tokens,
        agent_fn="agent_openai_client:agent",
        **cfg,
    )
    prompts = TASKS["calculator"].make("train", 2, seed=3, chat=True)

    async def go():
        async with EngineClient(url) as client:
            manager = RolloutManager(
                config,
                DataSource(list(prompts), shuffle=False),
                client,
                tok,
                seed=seed,
                generate_fn=agent_glue.generate,
            )
            batch = await manager.next_batch(0)
            await manager.close()
            return batch, manager.stats()

    return asyncio.run(go())


def test_manager_runs_the_openai_agent_on_sessions(engine, example):
    url, path = engine
    tok = load_tokenizer(path)
    batch, stats = rollout(url, tok, seed=1)
    assert stats["generate_errors"] == 0 and len(batch) == 4
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for s in batch:
        assert Status(s.status) in (Status.COMPLETED, Status.TRUNCATED), s.status_reason
        # The agent sends only the question, with its own copy of the calculator schema.
        question = [{"role": "user", "content": s.prompt[-1]["content"]}]
        assert s.tokens[: s.prompt_length] == encode_prompt(tok, question, [CALCULATOR_TOOL["function"]])
        assert 0 < s.response_length <= 12, "the session capped the agent's max_tokens=64 at the rollout budget"
        assert s.reward in (0.0, 1.0) and s.metadata["session_id"] and s.metadata["agent_trajectories"] == 1
        assert (
            s.metadata["prompt_index"] in (0, 1)
            and s.label == TASKS["calculator"].make("train", 2, seed=3)[s.metadata["prompt_index"]].label
        )
        assert s.token_versions == [0] * s.response_length
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([s.tokens])).logits[0].float(), -1)
        p = s.prompt_length
        diffs = [
            abs(lp[p + j - 1, s.tokens[p + j]].item() - s.rollout_logprobs[j])
            for j in range(s.response_length)
            if s.token_sources[j] == Source.POLICY.value
        ]
        assert diffs and max(diffs) < 1e-4
    server = agent_glue._servers[url].server
    assert server.stats()["sessions_open"] == 0 and server.stats()["sessions_created"] == 4

    # The rollout's seed reaches the engine through the session: same seed, same tokens; another, others.
    again, _ = rollout(url, tok, seed=1)
    other, _ = rollout(url, tok, seed=2)
    assert [s.tokens for s in again] == [s.tokens for s in batch]
    assert [s.tokens for s in other] != [s.tokens for s in batch]


def test_budget_and_agent_errors(engine, example):
    url, path = engine
    tok = load_tokenizer(path)
    batch, stats = rollout(url, tok, seed=1, max_new_tokens=3)
    assert all(s.response_length <= 3 for s in batch) and stats["generate_errors"] == 0

    async def broken(sample, base_url):
        async with httpx.AsyncClient() as http:  # one turn on the session, then the harness dies
            await http.post(base_url + "/chat/completions", json={"messages": sample.prompt, "max_tokens": 2})
        raise ConnectionError("the harness crashed")

    prompt = TASKS["calculator"].make("train", 1, seed=3, chat=True)[0]
    sample = Sample(prompt=prompt.prompt, tokens=encode_prompt(tok, prompt.prompt), label=prompt.label)
    ctx = RolloutContext(client=EngineClient(url), tokenizer=tok, config=SimpleNamespace(agent_fn=broken, max_turns=1))
    with pytest.raises(RuntimeError, match="ConnectionError: the harness crashed"):
        asyncio.run(agent_glue.generate(ctx, sample, {"max_new_tokens": 8, "temperature": 1.0}))
    assert agent_glue._servers[url].server.stats()["sessions_open"] == 0
