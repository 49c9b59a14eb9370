"""Sessions are bounded: idle ones expire (a clear 404 naming them after), and open ones are capped (429).

Idleness is measured on the store's clock, here a counter the test moves, so nothing waits.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from furlong.envs.session_server import ServerThread, SessionServer
from furlong.envs.session_store import DEFAULT_MAX_SESSIONS, DEFAULT_TTL_S, RequestError, SessionStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_session_expires_and_its_id_then_says_so():
    clock = Clock()
    store = SessionStore(ttl_s=60, clock=clock)
    idle, used = store.create(), store.create()
    clock.now += 40
    store.get(used)  # a request: `used` is active again
    clock.now += 30  # idle 70 s vs 30 s
    with pytest.raises(RequestError, match=f"^session: session '{idle}' expired after 60 s idle") as e:
        store.get(idle)
    assert e.value.status == 404
    assert store.get(used).id == used
    with pytest.raises(RequestError, match="^session: no session 'nope'") as e:
        store.get("nope")
    assert e.value.status == 404
    assert store.stats()["sessions_expired"] == 1 and store.stats()["sessions_open"] == 1


def test_a_session_with_a_turn_in_progress_never_expires():
    clock = Clock()
    store = SessionStore(ttl_s=60, clock=clock)
    sid = store.create()

    async def long_turn() -> None:
        session = store.get(sid)
        async with session.lock:  # what `SessionServer.chat` holds while the engine generates
            clock.now += 600
            assert store.expire() == 0 and sid in store.sessions
        clock.now += 59  # the idle time starts when the turn ends (close/undo touch the session)
        store.touch(session)

    asyncio.run(long_turn())
    clock.now += 59
    assert store.get(sid).id == sid
    clock.now += 61
    assert store.expire() == 1 and sid not in store.sessions


def test_open_sessions_are_capped_and_an_ended_or_expired_one_frees_its_place():
    clock = Clock()
    store = SessionStore(ttl_s=60, max_sessions=2, clock=clock)
    a = store.create()
    store.create()
    with pytest.raises(RequestError, match=r"^sessions: 2 sessions are open, the cap \(max_sessions=2\)") as e:
        store.create()
    assert e.value.status == 429 and store.stats()["sessions_refused"] == 1
    store.delete(a)
    store.create()  # room again
    clock.now += 61  # both expire: room for two
    store.create()
    store.create()
    assert store.stats()["sessions_open"] == 2


def test_defaults_are_generous_and_bad_bounds_name_the_setting():
    store = SessionStore()
    assert (store.ttl_s, store.max_sessions) == (DEFAULT_TTL_S, DEFAULT_MAX_SESSIONS) and DEFAULT_TTL_S >= 3600
    assert DEFAULT_MAX_SESSIONS >= 1000
    with pytest.raises(ValueError, match="^session_ttl_s: must be > 0"):
        SessionStore(ttl_s=0)
    with pytest.raises(ValueError, match="^max_sessions: must be >= 1"):
        SessionStore(max_sessions=0)
    never = SessionStore(ttl_s=None, max_sessions=None, clock=Clock())
    sid = never.create()
    never.clock.now += 10**9
    assert never.get(sid).id == sid


@pytest.mark.timeout(60)
def test_over_http_expired_is_404_naming_the_session_and_over_the_cap_is_429_naming_it():
    clock = Clock()
    server = SessionServer("http://127.0.0.1:9", session_ttl_s=60, max_sessions=1, clock=clock)
    with ServerThread(server) as sessions:
        sid = httpx.post(sessions.url + "/sessions", json={}).json()["id"]
        r = httpx.post(sessions.url + "/sessions", json={})
        assert r.status_code == 429 and "max_sessions=1" in r.json()["error"]["message"]
        clock.now += 61
        for method, path in (("GET", "samples"), ("POST", "v1/chat/completions"), ("DELETE", "")):
            r = httpx.request(method, f"{sessions.url}/sessions/{sid}/{path}".rstrip("/"), json={"messages": []})
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["message"] == f"session: session '{sid}' expired after 60 s idle " + (
                "(create a new one with POST /sessions)"
            )
        assert httpx.post(sessions.url + "/sessions", json={}).status_code == 200  # its place is free
        assert "furlong_sessions_sessions_expired 1" in httpx.get(sessions.url + "/metrics").text
