"""Rollout metrics a step logs: the reward mean, and each component of dict rewards."""

from __future__ import annotations

import math

from furlong.core.sample import Sample
from furlong.driver.metrics import rollout_metrics


def _sample(reward, n: int = 3) -> Sample:
    s = Sample(index=0, tokens=[1, 2], reward=reward)
    s.append([5] * n, logprobs=[-0.1] * n)
    return s


def test_dict_reward_components_are_averaged_beside_the_score() -> None:
    batch = [
        _sample({"score": 1.0, "used_tool": 1.0, "tool_calls": 2.0}),
        _sample({"score": 0.0, "used_tool": 0.0}),
        _sample(0.5),
    ]
    m = rollout_metrics(batch)
    assert m["rollout/reward_mean"] == 0.5
    assert m["rollout/reward/used_tool"] == 0.5  # over the two samples that report it
    assert m["rollout/reward/tool_calls"] == 2.0
    assert "rollout/reward/score" not in m


def test_no_rewards_is_nan_not_zero() -> None:
    m = rollout_metrics([_sample(None)])
    assert math.isnan(m["rollout/reward_mean"]) and not any(k.startswith("rollout/reward/") for k in m)
