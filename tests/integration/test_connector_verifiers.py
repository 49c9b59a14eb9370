"""Verifiers connector: a real verifiers taskset, run by verifiers in its own venv, model calls on furlong's engine.

The taskset is `examples/connectors/furlong_reverse_words.py` (taskset id
`furlong-reverse-words`): verifiers' SingleAgentEnv subclass with a scripted second
user turn, its `null` harness (a chat program verifiers launches) in its `subprocess`
runtime, and a `@vf.reward` rubric (difflib similarity per turn). The rollout manager,
given only `rollout.agent_fn` = the connector's agent and the connector's data source,
must bring back for each sample:

- the engine's exact tokens: HF's log-probs on the recorded ids equal the rollout
  log-probs within 1e-4; both model turns and the scripted follow-up in one trajectory
  (verifiers sent the history back and the session extended it, no re-tokenised branch);
- the reward verifiers' rubric computed, checked here independently from the recorded
  replies with difflib;
- on a token budget too small for the second turn: a `truncated` sample, scored by the
  rubric on the turn it holds.

Bad connector settings fail with errors naming the `envs.connector` key.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from furlong.config.schema import EnvsConfig, RolloutConfig
from furlong.core.client import EngineClient
from furlong.core.sample import Sample, Source, Status
from furlong.data.chat import encode_prompt
from furlong.envs import agent as agent_glue
from furlong.envs.connectors import verifiers as vc
from furlong.envs.connectors.venvs import VenvError, ensure
from furlong.models import load_tokenizer
from furlong.rollout.manager import RolloutManager
from tests.helpers import engine_process

pytestmark = pytest.mark.envs  # its connector's environment: built in the background by `make test`, so run last

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "connectors"
TASKSET = "furlong-reverse-words"
FOLLOW_UP = "Now write your answer backwards, to get the original word again."  # the example's scripted user


@pytest.fixture(scope="module")
def venv():
    """The verifiers environment (built on first use, then cached under ~/.cache/furlong/envs)."""
    return ensure(vc.SPEC)


@pytest.fixture(scope="module")
def engine():
    with engine_process("verifiers-test") as (url, path):
        yield url, path


def connector(**extra):
    return {
        "taskset": TASKSET,
        "paths": [str(EXAMPLES)],
        "taskset_args": {"num_tasks": 4},
        "sampling": {"max_tokens": 8},
        "timeout_s": 300,
        **extra,
    }


def rollout(url, tok, conn, *, max_new_tokens):
    config = RolloutConfig(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        max_new_tokens=max_new_tokens,
        agent_fn="furlong.envs.connectors.verifiers:agent",
    )
    envs = EnvsConfig(connector=conn)
    source = vc.data_source(envs, seed=0)

    async def go():
        async with EngineClient(url) as client:
            manager = RolloutManager(config, source, client, tok, seed=1, envs=envs, generate_fn=agent_glue.generate)
            batch = await manager.next_batch(0)
            await manager.close()
            return batch, manager.stats()

    return asyncio.run(go())


def expected_reward(s: Sample, turns: int = 2) -> float:
    """The example's rubric, recomputed from what the session recorded (not from verifiers' reply)."""
    messages = s.metadata["messages"]
    word = messages[0]["content"].rsplit(" ", 1)[1]
    replies = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
    answers = [word[::-1], word][:turns]
    return sum(difflib.SequenceMatcher(None, r.strip(), a).ratio() for r, a in zip(replies, answers)) / turns


def assert_engine_tokens(s: Sample, hf) -> None:
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([s.tokens])).logits[0].float(), -1)
    p = s.prompt_length
    diffs = [
        abs(lp[p + j - 1, s.tokens[p + j]].item() - s.rollout_logprobs[j])
        for j in range(s.response_length)
        if s.token_sources[j] == Source.POLICY.value
    ]
    assert diffs and max(diffs) < 1e-4, f"sample {s.index}: log-probs differ by {max(diffs, default=None)}"


def test_data_source_lists_the_taskset(venv):
    prompts = vc.prompts(vc.options(connector()))
    assert [p.prompt for p in prompts] == [
        [{"role": "user", "content": f"Reverse the letters of the word: {w}"}]
        for w in ("apple", "river", "stone", "cloud")
    ]
    refs = [p.metadata["verifiers"] for p in prompts]
    assert [r["idx"] for r in refs] == [0, 1, 2, 3] and {r["taskset"] for r in refs} == {TASKSET}
    assert len({r["key"] for r in refs}) == 4 and [p.label for p in prompts] == [f"reverse-{i}" for i in range(4)]


def test_episodes_record_engine_tokens_and_the_rubric_reward(venv, engine):
    url, path = engine
    tok = load_tokenizer(path)
    t0 = time.monotonic()
    batch, stats = rollout(url, tok, connector(), max_new_tokens=128)
    print(f"\n4 two-turn verifiers episodes: {time.monotonic() - t0:.1f} s")
    assert stats["generate_errors"] == 0 and len(batch) == 4
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for s in batch:
        s.validate()
        # truncated: the last reply used its whole max_tokens (8), as random tiny-model text does
        assert Status(s.status) in (Status.COMPLETED, Status.TRUNCATED), s.status_reason
        assert s.metadata["verifiers_episode"]["ok"] and not s.metadata["verifiers_episode"]["truncated"]
        messages = s.metadata["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"], messages
        assert messages[2]["content"] == FOLLOW_UP
        assert s.metadata["agent_trajectories"] == 1 and not s.metadata["template_mismatch"]
        assert s.tokens[: s.prompt_length] == encode_prompt(tok, messages[:1])
        policy = [j for j, src in enumerate(s.token_sources) if src == Source.POLICY.value]
        assert 2 <= len(policy) <= 16 and s.response_length > len(policy), "two capped model turns and the follow-up"
        assert s.loss_mask == [int(j in policy) for j in range(s.response_length)]
        assert_engine_tokens(s, hf)
        want = expected_reward(s)
        assert s.reward["score"] == pytest.approx(want, abs=1e-12) and s.reward["similarity"] == pytest.approx(want)
        assert s.metadata["verifiers_episode"]["turns"] == 2
        assert s.metadata["verifiers"]["taskset"] == TASKSET
    assert agent_glue._servers[url].server.stats()["sessions_open"] == 0


def test_budget_cut_episode_is_truncated_and_scored(venv, engine):
    url, path = engine
    tok = load_tokenizer(path)
    # 12 tokens: the first reply (at most 8) fits; the follow-up message cannot, so the session refuses turn 2.
    batch, stats = rollout(url, tok, connector(), max_new_tokens=12)
    assert stats["generate_errors"] == 0 and len(batch) == 4
    for s in batch:
        s.validate()
        assert Status(s.status) == Status.TRUNCATED, (s.status, s.status_reason)
        assert [m["role"] for m in s.metadata["messages"]] == ["user", "assistant"]
        # The refusal carries OpenAI's `context_length_exceeded`: verifiers ends the episode and scores it itself.
        assert s.metadata["verifiers_episode"]["ok"]
        assert s.reward["score"] == pytest.approx(expected_reward(s), abs=1e-12)


def test_bad_settings_name_the_field(venv):
    with pytest.raises(VenvError, match=r"envs\.connector\.taskset = 'no-such-taskset'.*not found"):
        vc.data_source(EnvsConfig(connector={"taskset": "no-such-taskset"}), seed=0)
    with pytest.raises(VenvError, match=r"envs\.connector\.taskset_args: .*turns must be 1 or 2"):
        vc.list_tasks(vc.options(connector(taskset_args={"turns": 3})))
    with pytest.raises(ValueError, match=r"envs\.connector: unknown key\(s\) \['tasket'\]"):
        vc.options({"tasket": TASKSET})
    with pytest.raises(ValueError, match=r"envs\.connector\.taskset: required"):
        vc.options({})
    with pytest.raises(ValueError, match=r"envs\.connector\.paths: not a directory"):
        vc.options(connector(paths=["no/such/dir"]))
    # The episode path (the long-lived driver) reports a bad taskset the same way, before any model call.
    bad = Sample(prompt="x", tokens=[1], metadata={"verifiers": {"taskset": "no-such-taskset", "idx": 0}})
    with pytest.raises(vc.VerifiersError, match=r"envs\.connector\.taskset = 'no-such-taskset'"):
        asyncio.run(vc.agent(bad, "http://127.0.0.1:9/v1", {"connector": {"taskset": "no-such-taskset"}}))
    with pytest.raises(ValueError, match="rollout.data_source: furlong.envs.connectors.verifiers:data_source"):
        asyncio.run(vc.agent(Sample(prompt="x", tokens=[1]), "http://127.0.0.1:9/v1", {"connector": connector()}))


def _drivers() -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if b"verifiers_driver.py" in cmd:
                out.add(int(d))
    return out


@pytest.mark.timeout(660)
@pytest.mark.extended  # a whole `furlong train` run (about a minute): `make test-extended`
def test_furlong_train_on_a_verifiers_taskset(venv, tmp_path):
    """`furlong train examples/connectors/verifiers.yaml`, 2 steps: the samples it trains on are verifiers episodes."""
    run_dir = tmp_path / "run"
    before = _drivers()
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "furlong.cli",
            "train",
            "examples/connectors/verifiers.yaml",
            f"run_dir={run_dir}",
            "train.total_steps=2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(f"\nfurlong train, 2 steps on {TASKSET}: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    samples = [
        Sample.from_json(line).validate()
        for step in (0, 1)
        for line in (run_dir / "samples" / f"step_{step}.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 8
    for s in samples:  # the recipe's budget (128) holds both turns (16 tokens each) and the follow-up
        assert s.metadata["verifiers"]["taskset"] == TASKSET and s.metadata["verifiers_episode"]["turns"] == 2
        assert s.reward["score"] == pytest.approx(expected_reward(s), abs=1e-12)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 2 and result["before"]["eval/failed"] == 0 and result["before"]["eval/n_prompts"] == 2
    deadline = time.monotonic() + 15
    while _drivers() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _drivers() - before, "the verifiers driver outlived `furlong train`"
