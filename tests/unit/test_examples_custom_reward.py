"""`examples/custom_reward`: the reward scores by hand-checked cases, fits its plug point, and the
recipe wires it through the rollout manager (fake engine) so every sample carries its dict reward."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rollout_fake_engine import CharTokenizer, FakeEngine

from furlong.config import load_config
from furlong.config.registry import load_plugin
from furlong.core.client import EngineClient
from furlong.core.sample import Sample, Status
from furlong.data import DataSource, Prompt
from furlong.rollout.manager import RolloutManager

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "custom_reward" / "recipe.yaml"


@pytest.fixture
def reward(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # the recipe names the module by its dotted path from the repo root
    cfg = load_config(RECIPE, ["rollout.max_new_tokens=6"])
    return cfg, load_plugin("rollout.reward_fn", cfg.rollout.reward_fn)


def scored(fn, response: str, label: str = "cba") -> dict:
    return fn(Sample(prompt="Reverse the string abc. Answer:", label=label, metadata={"response_text": response}))


@pytest.mark.parametrize(
    "response, score, exact",
    [
        (" cba", 1.0, 1.0),
        (" cab", 1 / 3, 0.0),  # only the first letter is in place
        (" abc", 1 / 3, 0.0),  # copying keeps the middle letter
        (" cbaa", 3 / 4, 0.0),  # one letter too many costs its share
        ("", 0.0, 0.0),
        ("junk\nAnswer: c b a.", 1.0, 1.0),  # the task's answer parsing: last "Answer:", spaces and final dot dropped
    ],
)
def test_partial_credit_by_hand(reward, response, score, exact):
    _, fn = reward
    assert scored(fn, response) == pytest.approx({"score": score, "exact": exact})


def test_recipe_runs_the_reward_through_the_rollout_manager(reward):
    cfg, fn = reward
    assert cfg.rollout.reward_fn == "examples.custom_reward.reward:reverse_partial_credit"
    engine = FakeEngine()
    client = EngineClient("http://fake", transport=engine.transport(), admin_token="T", retry_backoff_s=0.001)
    prompts = [Prompt(index=i, prompt=f"Reverse the string ab{i}.", label=f"{i}ba", metadata={}) for i in range(8)]
    mgr = RolloutManager(cfg.rollout, DataSource(prompts, seed=0), client, CharTokenizer(), seed=0, reward_fn=fn)

    async def one_step():
        try:
            return await mgr.next_batch(0)
        finally:
            await mgr.close()

    batch = asyncio.run(one_step())
    assert len(batch) == cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    for s in batch:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        assert set(s.reward) == {"score", "exact"}
        assert s.reward == pytest.approx(fn(s)) and 0.0 <= s.scalar_reward <= 1.0
