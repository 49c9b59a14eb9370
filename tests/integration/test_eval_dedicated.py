"""`rollout.eval_mode=dedicated`: held-out eval on an engine of its own, synced at each eval step, while
training goes on; the training engines serve rollouts only.

One short run of recipes/debug.yaml (tiny model, 3 steps, eval every step) on a topology the test starts, so
the engines' own counters (`/metrics`) can be read after the run and before they stop: every eval request
(sent at eval priority, counted by the engine as `low_priority_requests_total`) reached the eval engine and
none a training engine, and each background eval is tagged with the one version its engine held.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from furlong.cluster.engine_stats import parse_prometheus

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _counters(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url.rstrip("/") + "/metrics", timeout=30).text)


@pytest.mark.timeout(600)
def test_dedicated_eval_runs_on_its_own_engine(tmp_path):
    from furlong.config import load_config
    from furlong.driver import build
    from furlong.driver.run import Run
    from furlong.driver.rundir import admin_token

    cfg = load_config(
        str(ROOT / "recipes" / "debug.yaml"),
        [
            "rollout.eval_mode=dedicated",
            "rollout.eval_every=1",
            f"train.total_steps={STEPS}",
            "cluster.threads_per_process=1",
            "observe.tensorboard=false",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    plugs = build.plugins(cfg)
    build.start_ray(cfg)
    (tmp_path / "top").mkdir()
    top = build.topology(cfg, tmp_path / "top", build.model_dir(cfg.model), admin_token(tmp_path / "top"), plugs)
    try:
        assert len(top.eval_engine_urls) == 1 and top.eval_engine_urls[0] not in top.engine_urls
        result = asyncio.run(Run(cfg, progress=False, topology=top).run())
        training = [_counters(u) for u in top.engine_urls]
        evaluating = _counters(top.eval_engine_urls[0])
    finally:
        top.shutdown()
    stats = result["rollout_stats"]
    per_eval = cfg.data.n_eval * (cfg.rollout.eval_n_samples + 1)  # sampled + one greedy per prompt
    assert stats["evals"] >= 3, stats  # before, after and at least one background eval
    assert evaluating["low_priority_requests_total"] == evaluating["requests_total"] == stats["evals"] * per_eval
    for c in training:  # rollouts only: what the rollout client sent, and no eval request
        assert c["low_priority_requests_total"] == 0, c
        assert c["requests_total"] == stats["requests"], (c, stats)
    assert evaluating["weight_version"] == STEPS  # synced again for the after-RL eval
    rows = [json.loads(line) for line in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    tagged = [r for r in rows if "eval/step" in r]
    assert tagged, "no background eval was logged"
    for r in tagged:  # the eval of step k ran on the weights synced after step k, and only on those
        assert r["eval/weight_version"] == r["eval/weight_version_end"] == r["eval/step"] + 1, r
    assert result["supervisor"]["eval_syncs"] == len(tagged) + 2  # each background eval, before and after
    assert "eval/pass@1" in result["after"] and result["after"]["eval/weight_version"] == STEPS
