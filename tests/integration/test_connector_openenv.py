"""The OpenEnv connector against a real OpenEnv server and a real `furlong serve` engine.

The `openenv` package runs in its own virtual environment (built once, cached under
~/.cache/furlong/envs); its echo environment (the one `openenv init` writes) is served
by OpenEnv's own server, started by the connector on a loopback port. Episodes run
through furlong's multi-turn generate with a tiny model on the engine. Checked
independently of the connector:

- every policy token is the engine's: each model turn is replayed on the engine with the
  turn's seed and must give the same ids;
- the observations are the echo of each turn, appended with loss mask 0 (source `env`),
  and the reset observation is in the prompt;
- the reward is what OpenEnv computed: each turn's text sent to the server's stateless
  `/step` gives the step rewards, and they equal the echo rule min(0.1 * len, 1.0).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from itertools import groupby
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from furlong.config.schema import EnvsConfig
from furlong.core.client import EngineClient
from furlong.core.sample import Sample, Status
from furlong.data.chat import encode_prompt
from furlong.envs.connectors import openenv
from furlong.envs.connectors.venvs import ensure, is_built
from furlong.envs.multiturn import generate
from furlong.envs.protocol import build_environment
from furlong.models import load_tokenizer
from furlong.rollout.generate import RolloutContext, derive_seed
from tests.helpers import engine_process

pytestmark = pytest.mark.envs  # its connector's environment: built in the background by `make test`, so run last

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "openenv-test-token"
TURNS, BUDGET = 3, 96
STOP_IDS = list(range(3, 512, 4))  # an untrained model seldom ends a turn: one id in four ends one here
READY = "Echo Env environment ready!"


@pytest.fixture(scope="module")
def built():
    """The openenv environment (the first build takes about a minute; then it is reused)."""
    started = time.monotonic()
    was_built = is_built(openenv.SPEC)
    ensure(openenv.SPEC)
    print(f"\nopenenv environment: {'reused' if was_built else 'built'} in {time.monotonic() - started:.1f} s")
    yield
    openenv.stop_servers()


@pytest.fixture(scope="module")
def engine():
    with engine_process(TOKEN) as (url, path):
        yield url, path


def runs(s: Sample) -> list[tuple[str, int, int]]:
    """(source, start, end) over the response, one per run of one source."""
    out, i = [], 0
    for source, group in groupby(s.token_sources):
        n = len(list(group))
        out.append((source, i, i + n))
        i += n
    return out


async def episodes(url: str, tok, envs: EnvsConfig, prompts) -> list[Sample]:
    async with EngineClient(url, admin_token=TOKEN) as client:
        ctx = RolloutContext(
            client=client,
            tokenizer=tok,
            config=SimpleNamespace(max_turns=TURNS, reward_fn=None, group_reward_fn=None),
            envs=envs,
        )

        async def one(i, p):
            s = Sample(index=i, prompt=p.prompt, tokens=encode_prompt(tok, p.prompt), metadata=dict(p.metadata))
            params = {"max_new_tokens": BUDGET, "temperature": 1.0, "seed": 11 + i, "stop_token_ids": STOP_IDS}
            return await generate(ctx, s, params)

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


@pytest.mark.timeout(300)
def test_echo_episodes_on_the_engine(built, engine):
    url, path = engine
    tok = load_tokenizer(path)
    envs = EnvsConfig(name="openenv", connector={"env": "echo"}, timeout_s=30.0)
    prompts = openenv.make_prompts(4, seed=0)
    samples = [s.validate() for s in asyncio.run(episodes(url, tok, envs, prompts))]
    server = openenv.server_url(openenv.Options.parse(envs.connector))  # the server the episodes used

    for i, (p, s) in enumerate(zip(prompts, samples)):
        assert s.status == Status.TRUNCATED and s.status_reason == f"turn limit ({TURNS}) reached", (
            s.status,
            s.status_reason,
        )
        assert s.tokens[: s.prompt_length] == encode_prompt(tok, p.prompt + [{"role": "user", "content": READY}])
        assert s.loss_mask == [int(src == "policy") for src in s.token_sources]
        parts = runs(s)
        policy = [(a, b) for src, a, b in parts if src == "policy"]
        env = [(a, b) for src, a, b in parts if src == "env"]
        assert len(policy) == TURNS and len(env) == TURNS - 1, parts

        # The engine's ids: replay each turn with the seed multiturn gave it.
        texts = []
        for turn, (a, b) in enumerate(policy):
            seed = 11 + i if turn == 0 else derive_seed(11 + i, turn, a)
            out = httpx.post(
                url + "/generate",
                json={
                    "input_ids": s.tokens[: s.prompt_length + a],
                    "sampling_params": {
                        "max_new_tokens": BUDGET - a,
                        "temperature": 1.0,
                        "seed": seed,
                        "stop_token_ids": STOP_IDS,
                    },
                },
            ).json()
            assert out["output_ids"] == s.response_tokens[a:b], f"sample {i} turn {turn}: not the engine's tokens"
            assert set(s.token_versions[a:b]) == {0}
            texts.append(tok.decode(s.response_tokens[a:b], skip_special_tokens=True))

        # Each observation is the echo of the turn before it, masked out of the loss.
        for turn, (a, b) in enumerate(env):
            assert tok.decode(s.response_tokens[a:b]).strip() == texts[turn].strip()
            assert set(s.loss_mask[a:b]) == {0}

        # The reward is OpenEnv's: the server's own /step on each turn's text, and the echo rule.
        steps = [httpx.post(server + "/step", json={"action": {"message": t}}).json()["reward"] for t in texts]
        assert steps == [min(len(t) * 0.1, 1.0) for t in texts]
        assert s.metadata["openenv"]["rewards"] == steps and s.metadata["openenv"]["actions"] == texts
        assert s.reward == {"score": pytest.approx(sum(steps), abs=1e-12), "steps": float(TURNS), "done": 0.0}
    scores = [s.reward["score"] for s in samples]
    print(f"actions of sample 0: {samples[0].metadata['openenv']['actions']}")
    print(
        f"rewards: {scores}; response tokens: {[s.response_length for s in samples]}; "
        f"env tokens: {[s.token_sources.count('env') for s in samples]}"
    )
    assert any(s.token_sources.count("env") for s in samples)


@pytest.mark.timeout(120)
def test_lost_connection_replays_the_episode(built):
    """A sample resumed without its connection gets a fresh one that replays its actions first."""
    env = build_environment(EnvsConfig(name="openenv", connector={"env": "echo"}), Sample(metadata={"seed": 5}))
    assert isinstance(env, openenv.OpenEnvEnvironment) and env.seed == 5

    async def go():
        s = Sample(prompt=[{"role": "user", "content": "hi"}], metadata={"messages": []})
        first = await env.reset(s)
        replies = []
        for text in ["hello", "a longer message", "x"]:
            s.metadata["messages"].append({"role": "assistant", "content": text})
            if text == "x":
                await openenv._close(s.metadata["openenv"]["episode"])  # as if resumed in another process
            replies.append(await env.step(s, text + "<|im_end|>"))
        return first, replies, s, await env.reward(s)

    first, replies, s, reward = asyncio.run(go())
    assert first == [{"role": "user", "content": READY}]
    assert replies == [([{"role": "user", "content": t}], False) for t in ["hello", "a longer message", "x"]]
    assert s.metadata["openenv"]["rewards"] == [0.5, 1.0, pytest.approx(0.1)]
    assert reward == {"score": pytest.approx(1.6), "steps": 3.0, "done": 0.0}


@pytest.mark.timeout(120)
def test_json_actions_and_rejected_actions(built):
    """`action_format: json`: the model writes the action; one OpenEnv rejects is shown to the model, not fatal."""
    connector = {"env": "echo", "action_format": "json", "observation_field": None, "reward": "last"}
    env = openenv.environment(EnvsConfig(name="openenv", connector=connector))

    async def go():
        s = Sample(prompt=[{"role": "user", "content": "hi"}], metadata={"messages": []})
        await env.reset(s)
        replies = []
        for text in ['{"message": "hello"}', "not json", '{"msg": "hello"}', '{"message": "hi"}']:
            s.metadata["messages"].append({"role": "assistant", "content": text})
            replies.append((await env.step(s, text))[0][0]["content"])
        return replies, s, await env.reward(s)

    replies, s, reward = asyncio.run(go())
    assert json.loads(replies[0]) == {"echoed_message": "hello", "message_length": 5}  # the whole observation
    assert replies[1].startswith("invalid action: not JSON")
    assert "message: Field required" in replies[2], replies[2]  # OpenEnv's own validation error, field by field
    assert json.loads(replies[3])["echoed_message"] == "hi"
    assert s.metadata["openenv"]["rewards"] == [0.5, None, None, 0.2] and s.metadata["openenv"]["errors"] == 2
    assert reward == {"score": 0.2, "steps": 4.0, "done": 0.0}  # reward: last


def test_bad_connector_options_name_the_field(built):
    with pytest.raises(ValueError, match=r"envs\.connector\.env='nope'"):
        openenv.environment(EnvsConfig(name="openenv", connector={"env": "nope"}))
    with pytest.raises(ValueError, match=r"envs\.connector: unknown key\(s\) \['evn'\]"):
        openenv.environment(EnvsConfig(name="openenv", connector={"evn": "echo"}))
    with pytest.raises(ValueError, match=r"envs\.connector\.reward='max'"):
        openenv.Options.parse({"reward": "max"})


@pytest.mark.timeout(120)
def test_server_that_fails_to_start_names_the_field(built):
    """A MODULE:APP the openenv environment cannot import: the server exits, the error says which field and why."""
    with pytest.raises(openenv.OpenEnvError) as e:
        build_environment(EnvsConfig(name="openenv", connector={"env": "no_such_openenv_module:app"}), Sample())
    assert "envs.connector.env='no_such_openenv_module:app'" in str(e.value)
    assert "ModuleNotFoundError: No module named 'no_such_openenv_module'" in str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_recipe_runs(built, tmp_path):
    """`furlong train examples/connectors/openenv.yaml`, one step: the echo environment scores every sample."""
    run_dir = tmp_path / "openenv"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "furlong.cli",
            "train",
            "examples/connectors/openenv.yaml",
            f"run_dir={run_dir}",
            "train.total_steps=1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    print(f"\nfurlong train (1 step): {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = [
        Sample.from_json(line).validate() for line in (run_dir / "samples" / "step_0.jsonl").read_text().splitlines()
    ]
    assert samples
    for s in samples:
        turns = [m["content"] for m in s.metadata["messages"] if m["role"] == "assistant"]
        if s.status_reason == "length cut":  # a turn cut by the token budget is never sent to the environment
            turns = turns[:-1]
        assert s.metadata["openenv"]["actions"] == turns and turns
        assert s.reward["score"] == pytest.approx(sum(min(len(t) * 0.1, 1.0) for t in turns), abs=1e-9)
        assert s.loss_mask == [int(src == "policy") for src in s.token_sources]
    print(
        f"rewards: {[s.reward['score'] for s in samples]}; turns: {[len(s.metadata['openenv']['actions']) for s in samples]}"
    )
    result = json.loads((run_dir / "result.json").read_text())
    assert result
