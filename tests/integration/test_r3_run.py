"""`recipes/moe_r3_arithmetic.yaml` as a run: R3 end to end through the real driver, engine and trainer.

Shortened like the other recipe tests (tests/integration/test_recipes.py's SHORT: tiny model, 8 steps,
the dense odd-token reward), it asserts what only R3 produces — every trained sample carries the
engine's routes, stored compactly, and every step logs how often the trainer alone would have routed
differently — and that the run learned by the recipe tests' margin (FURLONG_TEST_RECIPES_LR=1e-9 fails it).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_moe_r3_recipe_replays_the_engines_routes_and_learns(tmp_path):
    from furlong.config import load_config
    from furlong.core.sample import decode_routes
    from furlong.driver.run import Run
    from tests.integration.test_recipes import RECIPES, SHORT, _metrics, assert_learned

    cfg = load_config(
        str(RECIPES / "moe_r3_arithmetic.yaml"),
        [*SHORT, f"run_dir={tmp_path / 'r3'}", "rollout.reward_fn=tests.integration.test_recipes:odd_tokens"],
    )
    assert (cfg.model.arch, cfg.rollout.routing_replay) == ("qwen3_moe", True)
    result = asyncio.run(Run(cfg, progress=False).run())
    rows = _metrics(cfg.run_dir)
    assert result["steps"] == len(rows) and all("r3/route_mismatch" in r and "r3/token_mismatch" in r for r in rows)
    samples = [
        json.loads(x) for f in sorted(Path(cfg.run_dir, "samples").glob("*.jsonl")) for x in f.read_text().splitlines()
    ]
    assert samples and all(isinstance(s["routed_experts"], dict) for s in samples)
    shape, _ = decode_routes(samples[0]["routed_experts"])
    assert shape[0] > len(samples[0]["tokens"]) - samples[0]["response_length"]  # prompt positions are routed too
    assert_learned(result, cfg.name)
