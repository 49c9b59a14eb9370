"""Harbor connector: real Harbor trials, run by Harbor in its own venv, with every model call on a furlong session.

The tasks are `examples/connectors/harbor_tasks/` (hello-file: write /app/hello.txt;
count-lines: write the line count of a file shipped in environment/, verified into
reward.json with a second reward `data_intact`). Each trial runs Harbor's Terminus 2
agent in the connector's Docker-free `furlong-local` environment, then Harbor's verifier.

- On furlong's engine (a tiny model, served with an 8192-position config because
  Terminus' prompt alone is ~2k tokens of the tiny byte-level vocabulary), the rollout
  manager given only `rollout.agent_fn` and the connector's data source must bring back
  each task's sample with the engine's exact tokens (HF's log-probs on the recorded ids
  equal the rollout log-probs within 1e-4), Terminus' own prompt (the instruction inside
  it), and the reward Harbor's verifier wrote, read here independently from the trial's
  reward file: 0 for hello-file (the tiny model writes nothing), and for count-lines
  score 0 with `data_intact` 1 (the shipped file reached the trial's /app untouched).
- Behind a scripted engine, Terminus' keystrokes must really run in the environment: the
  model's scripted reply writes /app/hello.txt, the verifier gives 1, and nothing is
  written outside the trial's root.

Bad connector settings fail with errors naming the `envs.connector` key.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from furlong.config.schema import EnvsConfig, RolloutConfig
from furlong.core.client import EngineClient
from furlong.core.sample import Sample, Source, Status
from furlong.envs import agent as agent_glue
from furlong.envs.connectors import harbor as hc
from furlong.envs.connectors.venvs import ensure
from furlong.envs.session_server import ServerThread, SessionServer
from furlong.models import create_model, load_tokenizer
from furlong.rollout.manager import RolloutManager
from tests.helpers import engine_process

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from envs_scripted_engine import Script, Turn  # noqa: E402

pytestmark = pytest.mark.envs  # its connector's environment: built in the background by `make test`, so run last

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "connectors" / "harbor_tasks"


def long_context_model(out: Path) -> Path:
    """The tiny model with room for Terminus' ~2k-token prompt: 8192 positions."""
    return create_model("qwen3", "tiny", out=out, max_positions=8192)


@pytest.fixture(scope="module")
def venv():
    """The harbor environment (built on first use, then cached under ~/.cache/furlong/envs)."""
    return ensure(hc.SPEC)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return long_context_model(tmp_path_factory.mktemp("harbor-model") / "tiny-8k")


@pytest.fixture(scope="module")
def engine(model):
    with engine_process("harbor-test", model_dir=model, kv_cache_mb=64) as (url, path):
        yield url, path


def test_trials_on_the_engine_record_exact_tokens_and_the_verifiers_reward(venv, engine, tmp_path):
    url, path = engine
    tok = load_tokenizer(path)
    config = RolloutConfig(
        rollout_batch_size=2,
        n_samples_per_prompt=1,
        max_new_tokens=24,
        max_turns=2,
        temperature=1.0,
        agent_fn="furlong.envs.connectors.harbor:agent",
    )
    envs = EnvsConfig(
        connector={"tasks": str(TASKS), "keep_trials": True, "trials_dir": str(tmp_path), "timeout_s": 300}
    )
    source = hc.data_source(envs, seed=0)

    async def go():
        async with EngineClient(url) as client:
            manager = RolloutManager(config, source, client, tok, seed=1, envs=envs, generate_fn=agent_glue.generate)
            batch = await manager.next_batch(0)
            await manager.close()
            return batch, manager.stats()

    batch, stats = asyncio.run(go())
    assert stats["generate_errors"] == 0 and len(batch) == 2
    by_task = {s.metadata["harbor"]["task"]: s for s in batch}
    assert set(by_task) == {"hello-file", "count-lines"}

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, s in by_task.items():
        assert Status(s.status) in (Status.COMPLETED, Status.TRUNCATED), s.status_reason
        s.validate()
        meta = s.metadata["harbor"]
        assert meta["agent"]["name"] == "terminus-2" and s.metadata["agent_trajectories"] == 1
        # The recorded prompt is Terminus' own (its template around the task's instruction).
        instruction = (TASKS / name / "instruction.md").read_text().strip()
        prompt_text = tok.decode(s.tokens[: s.prompt_length])
        assert instruction in prompt_text and "terminal" in prompt_text.lower()
        assert 0 < s.response_length <= 24 and s.token_versions == [0] * s.response_length
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([s.tokens])).logits[0].float(), -1)
        p = s.prompt_length
        diffs = [
            abs(lp[p + j - 1, s.tokens[p + j]].item() - s.rollout_logprobs[j])
            for j in range(s.response_length)
            if s.token_sources[j] == Source.POLICY.value
        ]
        assert diffs and max(diffs) < 1e-4
        # The reward is what Harbor's verifier wrote into the trial directory.
        verifier = Path(meta["trial_dir"]) / "verifier"
        assert (verifier / "test-stdout.txt").is_file()
        if name == "hello-file":
            assert float((verifier / "reward.txt").read_text()) == 0.0 and s.reward == 0.0
        else:
            assert json.loads((verifier / "reward.json").read_text()) == {"reward": 0, "data_intact": 1}
            assert s.reward == {"score": 0.0, "data_intact": 1.0}
        print(
            f"\n{name}: prompt {s.prompt_length} tokens, response {s.response_length}, status {s.status}, "
            f"reward {s.reward}, ended by {meta['ended_by']}, trial {meta['seconds']} s"
        )
    server = agent_glue._servers[url].server
    assert server.stats()["sessions_open"] == 0


def test_terminus_keystrokes_run_in_the_local_environment(venv, model, tmp_path):
    tok = load_tokenizer(model)
    write = {
        "analysis": "The file is missing.",
        "plan": "Write it with echo.",
        "commands": [{"keystrokes": "echo 'Hello, world!' > /app/hello.txt\n", "duration": 0.5}],
        "task_complete": True,
    }
    confirm = {"analysis": "The file is written.", "plan": "Nothing left.", "commands": [], "task_complete": True}
    script = Script(tok, [Turn(json.dumps(write)), Turn(json.dumps(confirm))])
    envs = {"tasks": str(TASKS / "hello-file"), "keep_trials": True, "trials_dir": str(tmp_path)}
    with ServerThread(SessionServer("http://engine", tok, transport=script.transport())) as sessions:
        sid = httpx.post(sessions.url + "/sessions", json={"max_new_tokens": 1000}).json()["id"]
        sample = Sample(prompt="-", metadata={"max_turns": 3})
        reward = asyncio.run(hc.agent(sample, sessions.session_url(sid), envs))
        records = httpx.get(f"{sessions.url}/sessions/{sid}/samples").json()
        [recorded] = [Sample.from_dict(d).validate() for d in records]
    print(
        f"\nscripted solve: reward {reward}, {recorded.response_length} response tokens, "
        f"trial {sample.metadata['harbor']['seconds']} s"
    )
    assert reward == 1.0 and sample.metadata["harbor"]["ended_by"] is None
    trial = Path(sample.metadata["harbor"]["trial_dir"])
    assert float((trial / "verifier" / "reward.txt").read_text()) == 1.0
    # Both model turns are the engine's ids, in one trajectory Terminus extended turn by turn.
    replies = [script.outputs(Turn(json.dumps(m))) for m in (write, confirm)]
    policy = [t for t, src in zip(recorded.response_tokens, recorded.token_sources) if src == Source.POLICY.value]
    assert policy == replies[0] + replies[1]
    assert recorded.metadata["turns"] == 2 and recorded.metadata["template_mismatch"] is False
    assert not Path("/app/hello.txt").exists(), "the trial wrote outside its own root"


def test_budget_refusal_ends_the_trial_and_the_verifier_still_scores(venv, model, tmp_path):
    tok = load_tokenizer(model)
    chatter = {
        "analysis": "Thinking.",
        "plan": "Look around.",
        "commands": [{"keystrokes": "ls\n", "duration": 0.1}],
        "task_complete": False,
    }
    script = Script(tok, [Turn(json.dumps(chatter))] * 4)
    envs = {"tasks": str(TASKS / "hello-file"), "trials_dir": str(tmp_path)}
    with ServerThread(SessionServer("http://engine", tok, transport=script.transport())) as sessions:
        budget = len(script.outputs(Turn(json.dumps(chatter)))) + 5  # one turn fits, the terminal output does not
        sid = httpx.post(sessions.url + "/sessions", json={"max_new_tokens": budget}).json()["id"]
        sample = Sample(prompt="-", metadata={"max_turns": 4})
        reward = asyncio.run(hc.agent(sample, sessions.session_url(sid), envs))
        [recorded] = [Sample.from_dict(d) for d in httpx.get(f"{sessions.url}/sessions/{sid}/samples").json()]
    assert reward == 0.0 and recorded.metadata["budget_exhausted"] is True
    assert sample.metadata["harbor"]["ended_by"] == "ContextLengthExceededError"
    assert len(script.requests) == 1, "a budget refusal is not retried"
    assert not any(tmp_path.iterdir()), "keep_trials=false removes the trial directory"


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"envs\.connector\.tasks: required"):
        hc.options({})
    with pytest.raises(ValueError, match=r"envs\.connector\.tasks: .*nowhere: no such directory"):
        hc.options({"tasks": str(tmp_path / "nowhere")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"envs\.connector\.tasks: .*empty: not a Harbor task directory"):
        hc.options({"tasks": str(tmp_path / "empty")})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['task'\]"):
        hc.options({"task": str(TASKS)})
    with pytest.raises(ValueError, match=r"envs\.connector\.timeout_s"):
        hc.options({"tasks": str(TASKS), "timeout_s": 0})
    with pytest.raises(ValueError, match=r"envs\.connector\.agent_kwargs"):
        hc.options({"tasks": str(TASKS), "agent_kwargs": [1]})
    opts = hc.options({"tasks": [str(TASKS / "hello-file"), str(TASKS / "count-lines")]})
    assert [t.name for t in opts.tasks] == ["hello-file", "count-lines"]
    with pytest.raises(ValueError, match=r"harbor_task='nope'.*known: \['count-lines', 'hello-file'\]"):
        hc.task_of(Sample(prompt="-", metadata={"harbor_task": "nope"}), opts)
    with pytest.raises(ValueError, match=r"no 'harbor_task' and envs\.connector\.tasks holds 2 tasks"):
        hc.task_of(Sample(prompt="-"), opts)
    assert hc.task_of(Sample(prompt="-", metadata={"harbor_task": "count-lines"}), opts) == TASKS / "count-lines"
    prompts = hc.prompts(hc.options({"tasks": str(TASKS)}))
    assert [p.label for p in prompts] == ["count-lines", "hello-file"]
    assert prompts[1].prompt[0]["content"] == (TASKS / "hello-file" / "instruction.md").read_text().strip()
    assert hc.as_reward({"reward": 1}) == 1.0 and hc.as_reward({"a": 0.5, "b": 1}) == {"score": 0.5, "a": 0.5, "b": 1.0}


@pytest.mark.extended  # a whole `furlong train` run (about a minute): `make test-extended`
@pytest.mark.timeout(300)
def test_train_recipe_runs(venv, model, tmp_path):
    """`furlong train examples/connectors/harbor.yaml`, one step: every sample is a Harbor trial its verifier scored."""
    run_dir = tmp_path / "harbor"
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "furlong.cli",
            "train",
            "examples/connectors/harbor.yaml",
            f"run_dir={run_dir}",
            "train.total_steps=1",
            f"model.path={model}",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=280,
    )
    print(f"\nfurlong train (1 step): {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (run_dir / "samples" / "step_0.jsonl").read_text().splitlines()
    samples = [Sample.from_json(line).validate() for line in lines]
    assert sorted(s.metadata["harbor"]["task"] for s in samples) == ["count-lines"] * 2 + ["hello-file"] * 2
    for s in samples:
        assert s.metadata["harbor"]["agent"]["name"] == "terminus-2" and s.response_length > 0
        expected = 0.0 if s.metadata["harbor"]["task"] == "hello-file" else {"score": 0.0, "data_intact": 1.0}
        assert s.reward == expected, (s.reward, s.metadata["harbor"])
