"""The NeMo Gym connector against NeMo Gym's real servers, the model calls on a real furlong engine.

What runs: the nemo-gym environment (`furlong envs setup nemo-gym`); NeMo Gym's
`math_with_judge` resources server (math-verify, no judge model), its `simple_agent`
and its `vllm_model` model server, each in its own process, the model server pointed
at furlong's session server in front of a `furlong serve` engine with the tiny model.

Checked: the session-less session routes a fixed-base-URL harness needs; that each
episode's recorded Sample holds the engine's exact prompt ids and response ids, with
log-probs equal to HF's on them, and that NeMo Gym's own token record (prompt ids,
`token_id:N` generation ids, log-probs) is the same; that the reward is the one NeMo
Gym's resources server computes (asked again directly, and shown able to give 1 as
well as 0); the rollout manager running the connector as `rollout.agent_fn`; errors
that name the `envs.connector` field; and, marked slow, `furlong train` on the
example recipe.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from furlong.config.schema import EnvsConfig, RolloutConfig
from furlong.core.client import EngineClient
from furlong.core.sample import Sample, Status
from furlong.data import DataSource
from furlong.data.chat import encode_prompt
from furlong.envs import agent as agent_glue
from furlong.envs.connectors import nemo_gym
from furlong.envs.connectors.venvs import ensure
from furlong.models import load_tokenizer
from furlong.rollout.manager import RolloutManager
from tests.helpers import engine_process

pytestmark = pytest.mark.envs  # its connector's environment: built in the background by `make test`, so run last

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine():
    with engine_process("nemo-gym-test") as (url, path):
        yield url, path
    nemo_gym.stop_all()


@pytest.fixture(scope="module")
def tok(engine):
    return load_tokenizer(engine[1])


@pytest.fixture(scope="module")
def sessions(engine, tok):
    """The session server `rollout.agent_fn` uses in this process (so the NeMo Gym servers start once)."""
    return agent_glue.session_server(engine[0], tok)


@pytest.fixture(scope="module")
def rows():
    ensure(nemo_gym.SPEC)  # built by `make envs`, or beside the suite by `make test`; a no-op when cached
    return nemo_gym.rows()


@pytest.fixture(scope="module")
def hf(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine[1], dtype=torch.float32).eval()


def hf_logprobs(hf, tokens: list[int], start: int) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[i - 1, tokens[i]].item() for i in range(start, len(tokens))]


def open_session(url: str, budget: int, **body) -> str:
    r = httpx.post(f"{url}/sessions", json={"max_new_tokens": budget, **body})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_session_less_routes_name_the_session_and_tokenize_exactly(sessions, tok):
    url = sessions.url
    sid = open_session(url, 64, sampling={"seed": 3})
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    body = {
        "messages": messages,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "metadata": {"furlong_session": sid},
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["logprobs"]["content"]
    (sample,) = [Sample.from_dict(d) for d in httpx.get(f"{url}/sessions/{sid}/samples").json()]
    p = sample.prompt_length
    assert [int(e["token"].removeprefix("token_id:")) for e in entries] == sample.tokens[p:]
    assert [e["logprob"] for e in entries] == sample.rollout_logprobs
    # /tokenize on a served turn's prompt: the ids that turn sent, with or without naming the session.
    for path, headers in (
        ("/tokenize", {}),
        (f"/sessions/{sid}/tokenize", {}),
        ("/tokenize", {"X-Furlong-Session": sid}),
    ):
        t = httpx.post(f"{url}{path}", json={"model": "m", "messages": messages}, headers=headers).json()
        assert t["tokens"] == sample.tokens[:p] == encode_prompt(tok, messages), path
    # The reply sent back plus a new user turn: never served, so the chat template's ids.
    reply = r.json()["choices"][0]["message"]
    longer = messages + [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "And 4 + 4?"}]
    t = httpx.post(f"{url}/sessions/{sid}/tokenize", json={"messages": longer}).json()
    assert t["tokens"] == encode_prompt(tok, longer)
    # The header names the session too; a second turn extends the same Sample.
    r2 = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": longer, "max_tokens": 2},
        headers={"X-Furlong-Session": sid},
        timeout=60,
    )
    assert r2.status_code == 200, r2.text
    assert len(httpx.get(f"{url}/sessions/{sid}/samples").json()) == 1
    # Naming no session, or one that does not exist, is an error that says what to send.
    bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata.furlong_session"
    gone = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "metadata": {"furlong_session": "x"}})
    assert gone.status_code == 404
    assert httpx.post(f"{url}/tokenize", json={"messages": "hi"}).json()["error"]["param"] == "messages"
    httpx.delete(f"{url}/sessions/{sid}")


def verify(resources_url: str, row: dict, text: str) -> float:
    """Ask NeMo Gym's resources server to verify `text` as the answer to `row` (no furlong code involved)."""
    response = {
        "id": "resp_check",
        "created_at": 0,
        "model": "m",
        "object": "response",
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "output": [
            {
                "id": "msg_check",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
    }
    for attempt in range(3):  # this independent check talks to NeMo Gym's server directly: a connection
        try:  # it resets under load (seen once in CI) is retried, never an answer
            r = httpx.post(f"{resources_url}/verify", json={**row, "response": response}, timeout=120)
            break
        except httpx.TransportError:
            if attempt == 2:
                raise
    assert r.status_code == 200, r.text
    return r.json()["reward"]


@pytest.mark.timeout(420)
def test_episodes_keep_engine_tokens_and_nemo_gym_reward(sessions, tok, rows, hf):
    url = sessions.url
    for row in rows[:2]:
        sid = open_session(url, 24, sampling={"seed": 7, "temperature": 1.0})
        out = asyncio.run(nemo_gym.run_episode(row, f"{url}/sessions/{sid}/v1"))
        samples = [Sample.from_dict(d).validate() for d in httpx.delete(f"{url}/sessions/{sid}").json()["samples"]]
        assert len(samples) == 1, "simple_agent on math_with_judge: one model turn, one trajectory"
        s = samples[0]
        messages = row["responses_create_params"]["input"]
        assert s.tokens[: s.prompt_length] == encode_prompt(tok, messages)
        assert 0 < s.response_length <= 24, "the session's budget capped NeMo Gym's request"
        lps = hf_logprobs(hf, s.tokens, s.prompt_length)
        assert max(abs(a - b) for a, b in zip(lps, s.rollout_logprobs)) < 1e-4
        # NeMo Gym's own record of the turn, from the vllm_model server: the same ids and log-probs.
        item = out["response"]["output"][-1]
        assert item["prompt_token_ids"] == s.tokens[: s.prompt_length]
        assert [int(t) for t in item["generation_token_ids"]] == s.tokens[s.prompt_length :]
        assert item["generation_log_probs"] == s.rollout_logprobs
        text = "".join(c["text"] for c in item["content"] if c["type"] == "output_text")
        assert text == s.metadata["messages"][-1]["content"]
        # The reward is the resources server's: asked again directly, it says the same; it can say 1 too.
        resources = next(
            x["url"] for x in nemo_gym.servers(nemo_gym.options(None), url).servers if x["type"] == "resources_servers"
        )
        assert out["reward"] == verify(resources, row, text)
        assert verify(resources, row, f"The answer is \\boxed{{{nemo_gym._text(row['expected_answer'])}}}.") == 1.0
        assert verify(resources, row, "The answer is \\boxed{12345}.") == 0.0


def test_manager_runs_the_connector_as_agent_fn(engine, tok, sessions, rows):
    url, _ = engine
    config = RolloutConfig(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        max_new_tokens=12,
        agent_fn="furlong.envs.connectors.nemo_gym:agent",
    )
    source = DataSource([p for p in nemo_gym.data_source(None).dataset][:2], shuffle=False)

    async def go():
        async with EngineClient(url) as client:
            manager = RolloutManager(
                config, source, client, tok, seed=1, envs=EnvsConfig(), generate_fn=agent_glue.generate
            )
            batch = await manager.next_batch(0)
            await manager.close()
            return batch, manager.stats()

    batch, stats = asyncio.run(go())
    assert stats["generate_errors"] == 0 and len(batch) == 4
    for s in batch:
        assert Status(s.status) in (Status.COMPLETED, Status.TRUNCATED), s.status_reason
        assert s.tokens[: s.prompt_length] == encode_prompt(
            tok, s.metadata["nemo_gym"]["responses_create_params"]["input"]
        )
        assert 0 < s.response_length <= 12
        assert s.reward == s.metadata["nemo_gym_verify"]["reward"] and s.reward in (0.0, 1.0)
        assert s.metadata["nemo_gym_verify"]["expected_answer"] == s.label
    assert len(agent_glue._servers[url].server.sessions) == 0, "every session closed"


def test_bad_connector_options_name_the_field(rows):
    bad = [
        ({"bogus": 1}, "envs.connector.bogus"),
        ({"timeout_s": 0}, "envs.connector.timeout_s"),
        ({"config_paths": []}, "envs.connector.config_paths"),
        ({"overrides": [1]}, "envs.connector.overrides"),
        ({"model": 3}, "envs.connector.model"),
    ]
    for connector, field in bad:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            nemo_gym.options(EnvsConfig(connector=connector))
    for connector, field in (
        ({"agent": "nope"}, "envs.connector.agent"),
        ({"dataset": "nope"}, "envs.connector.dataset"),
        ({"config_paths": ["nope.yaml"]}, "envs.connector.config_paths"),
    ):
        with pytest.raises(Exception, match=field.replace(".", r"\.")):
            nemo_gym.rows(EnvsConfig(connector=connector))
    with pytest.raises(ValueError, match="not a furlong session URL"):
        asyncio.run(nemo_gym.run_episode(rows[0], "http://127.0.0.1:1/v1"))


@pytest.mark.timeout(660)
@pytest.mark.extended  # a whole `furlong train` run (about a minute): `make test-extended`
def test_train_on_the_example_recipe(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "furlong.cli",
            "train",
            str(ROOT / "examples/connectors/nemo_gym.yaml"),
            f"run_dir={run}",
            "train.total_steps=1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert json.loads((run / "result.json").read_text())["steps"] == 1
    trained = [
        json.loads(line) for f in sorted((run / "samples").glob("step_*.jsonl")) for line in f.read_text().splitlines()
    ]
    assert len(trained) == 4, "rollout_batch_size 2 x n_samples_per_prompt 2"
    for s in trained:  # every sample an episode NeMo Gym ran and scored
        assert s["reward"] == s["metadata"]["nemo_gym_verify"]["reward"]
        assert s["metadata"]["nemo_gym_verify"]["expected_answer"] == str(s["label"])
        assert s["metadata"]["agent_trajectories"] == 1 and s["response_length"] > 0
