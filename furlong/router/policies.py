"""How the router picks an engine for one request.

A request either carries a routing key (a session, an agent trajectory, a multi-turn
conversation) or it does not:

* A keyed request always goes to the engine that wins rendezvous (highest-random-weight)
  hashing of ``(key, engine url)`` among the engines that may take it. This is consistent
  hashing without a ring: when an engine leaves, only the keys it owned move (each to its
  runner-up), and when one joins it takes only ~1/n of the keys. Sessions therefore stay
  on one engine, whose prefix cache holds their earlier turns, whatever the policy.
* An unkeyed request is placed by the policy:
  ``least_inflight`` (default) sends it to the engine with the fewest requests in flight,
  which keeps continuous batches evenly filled when generation lengths vary a lot (RL);
  ``round_robin`` cycles, which is predictable and what peers default to;
  ``session_affinity`` derives a key from the start of the prompt, so requests that share
  a prefix (same system prompt and first turn, same GRPO group) meet the same prefix cache,
  and falls back to least-inflight when nothing can be derived.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any, Protocol

POLICIES = ("least_inflight", "round_robin", "session_affinity")

# How much of a prompt identifies its "session" for session_affinity: long enough to
# hold a system prompt and a first user turn, short enough to hash for free.
_PREFIX_CHARS = 512
_PREFIX_TOKENS = 128


class Candidate(Protocol):
    """What a policy needs to know about an engine."""

    url: str
    inflight: int


def rendezvous_pick(key: str, candidates: list[Candidate]) -> Candidate:
    """The candidate with the highest hash of ``key`` and its url (stable, minimal remapping)."""

    def score(c: Candidate) -> bytes:
        return hashlib.blake2b(f"{key}\x00{c.url}".encode(), digest_size=8).digest()

    return max(candidates, key=score)


def derive_session_key(path: str, body: dict[str, Any]) -> str | None:
    """A key from the start of the prompt, or None when the body has no usable prompt."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if isinstance(messages, list) and messages:
            # system prompt + first user turn: every later turn of the conversation shares them
            head = json.dumps(messages[:2], sort_keys=True, default=str)
            return head[:_PREFIX_CHARS]
        return None
    for field in ("input_ids", "text", "prompt"):
        value = body.get(field)
        if isinstance(value, str) and value:
            return value[:_PREFIX_CHARS]
        if isinstance(value, list) and value:
            return json.dumps(value[:_PREFIX_TOKENS], default=str)
    return None


class Policy:
    """Chooses among the engines that may take a request (healthy, not yet tried)."""

    def __init__(self, name: str = "least_inflight") -> None:
        if name not in POLICIES:
            raise ValueError(f"policy: unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
        self.name = name
        self._counter = itertools.count()

    def choose(self, candidates: list[Candidate], key: str | None) -> Candidate:
        if not candidates:
            raise ValueError("no candidates")
        if key is not None:
            return rendezvous_pick(key, candidates)
        turn = next(self._counter)
        if self.name == "round_robin":
            ordered = sorted(candidates, key=lambda c: c.url)
            return ordered[turn % len(ordered)]
        # least inflight; ties rotate so an idle fleet still spreads the load
        n = len(candidates)
        return min(enumerate(candidates), key=lambda ic: (ic[1].inflight, (ic[0] - turn) % n))[1]
