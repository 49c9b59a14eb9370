"""Body limits on the router and the TITO session server: 413 naming the limit, before the body is buffered.

Real servers on 127.0.0.1 with a small limit (1 KiB), so a body over it is cheap to send;
each is sent both with a declared Content-Length and chunked (no length: the limit must be
found while reading), and a body under the limit still gets through to the next check.
"""

from __future__ import annotations

import httpx
import pytest

from furlong.envs.session_server import ServerThread, SessionServer
from furlong.router import serve_in_thread
from furlong.router.bodies import MAX_BODY_BYTES

LIMIT = 1024
TOKEN = "limits-token"


def _bodies(size: int) -> dict[str, object]:
    """The same JSON body of about `size` bytes, with a length and chunked."""
    raw = b'{"text": "' + b"x" * size + b'"}'

    def chunks():
        for i in range(0, len(raw), 256):
            yield raw[i : i + 256]

    return {"content-length": raw, "chunked": chunks}


def _post(url: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body() if callable(body) else body
    return httpx.post(url, content=content, headers={"content-type": "application/json", **(headers or {})}, timeout=30)


@pytest.mark.timeout(150)
def test_router_refuses_a_body_over_its_limit_with_413_naming_it():
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with serve_in_thread([], admin_token=TOKEN, max_body_bytes=LIMIT) as router:
        for path, headers in (("/generate", {}), ("/update_weights_from_disk", bearer), ("/add_engine", bearer)):
            for how, body in _bodies(2 * LIMIT).items():
                r = _post(router.url + path, body, headers)
                assert r.status_code == 413, (path, how, r.text)
                assert r.json()["error"]["message"] == f"{path}: body: request body over the limit of {LIMIT} bytes"
        for how, body in _bodies(LIMIT // 2).items():  # under the limit: on to the next answer (no engine: 503)
            assert _post(router.url + "/generate", body).status_code == 503, how
        assert _post(router.url + "/add_engine", b"{}", bearer).status_code == 400  # read, then found to lack "url"
        assert httpx.get(router.url + "/engines").status_code == 200  # still serving


@pytest.mark.timeout(120)
def test_session_server_refuses_a_body_over_its_limit_with_413_naming_it():
    with ServerThread(SessionServer("http://127.0.0.1:9", max_body_bytes=LIMIT)) as sessions:
        sid = httpx.post(sessions.url + "/sessions", json={}).json()["id"]
        for path in ("/sessions", f"/sessions/{sid}/v1/chat/completions", "/v1/chat/completions", "/tokenize"):
            for how, body in _bodies(2 * LIMIT).items():
                r = _post(sessions.url + path, body)
                assert r.status_code == 413, (path, how, r.text)
                err = r.json()["error"]
                assert err["param"] == "body" and f"over the limit of {LIMIT} bytes" in err["message"]
        for how, body in _bodies(LIMIT // 2).items():
            assert _post(sessions.url + "/sessions", body).status_code == 200, how
        assert httpx.get(sessions.url + "/health").status_code == 200


def test_default_limits_are_the_engines():
    from furlong.engine.http import MAX_BODY_BYTES as ENGINE_LIMIT

    assert MAX_BODY_BYTES == ENGINE_LIMIT  # nothing the engine would take is refused in front of it
    from furlong.router.server import Router

    assert Router([]).max_body_bytes == SessionServer("http://e").max_body_bytes == ENGINE_LIMIT
    with pytest.raises(ValueError, match="^max_body_bytes: must be a positive integer, got 0"):
        Router([], max_body_bytes=0)
