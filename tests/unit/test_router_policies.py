"""Router placement policies and engine-URL validation (pure, no servers)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from furlong.router.health import normalize_url
from furlong.router.policies import Policy, derive_session_key, rendezvous_pick


@dataclass
class E:
    url: str
    inflight: int = 0


def fleet(n: int) -> list[E]:
    return [E(f"http://127.0.0.1:{30000 + i}") for i in range(n)]


def test_rendezvous_moves_only_the_keys_of_a_removed_engine():
    engines = fleet(5)
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: rendezvous_pick(k, engines).url for k in keys}
    assert all(400 * 0.8 < list(before.values()).count(e.url) < 400 * 1.2 for e in engines)  # balanced
    gone = engines[2]
    after = {k: rendezvous_pick(k, [e for e in engines if e is not gone]).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone.url for k in moved)
    assert len(moved) == list(before.values()).count(gone.url)


def test_rendezvous_gives_a_new_engine_about_one_share():
    engines = fleet(4)
    keys = [f"k{i}" for i in range(2000)]
    before = {k: rendezvous_pick(k, engines).url for k in keys}
    new = E("http://127.0.0.1:39999")
    after = {k: rendezvous_pick(k, engines + [new]).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == new.url for k in moved)  # keys only move *to* the new engine
    assert 2000 / 5 * 0.8 < len(moved) < 2000 / 5 * 1.2


def test_keyed_requests_ignore_the_policy_and_load():
    engines = fleet(3)
    for name in ("least_inflight", "round_robin", "session_affinity"):
        policy = Policy(name)
        first = policy.choose(engines, "abc")
        first.inflight = 100
        assert all(policy.choose(engines, "abc") is first for _ in range(5))
        first.inflight = 0


def test_least_inflight_prefers_idle_and_rotates_ties():
    engines = fleet(3)
    policy = Policy("least_inflight")
    engines[0].inflight, engines[1].inflight, engines[2].inflight = 2, 0, 1
    assert policy.choose(engines, None) is engines[1]
    for e in engines:
        e.inflight = 0
    assert {policy.choose(engines, None).url for _ in range(3)} == {e.url for e in engines}


def test_round_robin_cycles_in_a_stable_order():
    engines = fleet(3)
    policy = Policy("round_robin")
    picks = [policy.choose(list(reversed(engines)), None).url for _ in range(6)]
    assert picks[:3] == picks[3:] and sorted(picks[:3]) == [e.url for e in engines]


def test_session_key_is_the_shared_prompt_prefix():
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}
    turn2 = {"messages": turn1["messages"] + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]}
    assert derive_session_key("/v1/chat/completions", turn1) == derive_session_key("/v1/chat/completions", turn2)

    def key(**body):
        return derive_session_key("/generate", body)

    assert key(input_ids=[1, 2, 3]) != key(input_ids=[1, 2])
    assert key(text="x" * 10_000) == key(text="x" * 9_000)  # only the prefix counts
    assert derive_session_key("/v1/chat/completions", {"messages": "nope"}) is None
    assert derive_session_key("/generate", {"sampling_params": {}}) is None


def test_unknown_policy_is_rejected_by_name():
    with pytest.raises(ValueError, match="policy: unknown policy 'fastest'"):
        Policy("fastest")


@pytest.mark.parametrize(
    "given, expected",
    [
        ("http://127.0.0.1:30001/", "http://127.0.0.1:30001"),
        ("127.0.0.1:30001", "http://127.0.0.1:30001"),
        (" https://node-3:443 ", "https://node-3:443"),
    ],
)
def test_normalize_url(given, expected):
    assert normalize_url(given) == expected


@pytest.mark.parametrize(
    "bad, why",
    [
        ("", "expected an engine URL"),
        ("http://host", "no port"),
        ("ftp://h:1", "http"),
        ("http://h:1/generate", "bare base URL"),
        ("http://h:99999", "not a valid URL"),
        (7, "expected an engine URL"),
    ],
)
def test_normalize_url_rejects_with_the_field_name(bad, why):
    with pytest.raises(ValueError, match=f"^url: .*{why}"):
        normalize_url(bad)
