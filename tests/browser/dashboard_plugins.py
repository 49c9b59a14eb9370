"""Plug points of the browser tests' real run (imported by dotted path, like a user's module)."""

from typing import Any


def parity_reward(sample: Any) -> float:
    """1 if the last token id is odd. The debug recipe's random tiny model never answers right, so its
    own reward is 0 everywhere: no advantages, no gradient, nothing to colour. This one varies within a
    group, so advantages are non-zero, the weights move, and a stale sample's train log-probs differ."""
    return float(sample.tokens[-1] % 2)
