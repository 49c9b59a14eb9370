"""The engine server's guard (`server.Guard`, plain ASGI): admin token on control paths, JSON errors, a 500 for one
request that raises while the server keeps serving — over a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from furlong.core import api as P
from furlong.core.app_thread import AppThread
from furlong.engine.server import add_guards


@pytest.fixture(scope="module")
def url():
    app = FastAPI()
    add_guards(app, "s3cret")

    @app.post(P.FLUSH_CACHE)
    async def flush():
        return {"success": True}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput")

    @app.get("/bad")
    async def bad():
        raise P.BadRequest("sampling_params.top_p", "must be in (0, 1]")

    @app.get("/stream")
    async def stream():
        async def gen():
            yield "data: 1\n\n"
            raise RuntimeError("mid-stream")

        return StreamingResponse(gen(), media_type="text/event-stream")

    with AppThread(app) as server:
        yield server.url


def test_control_paths_need_the_admin_token(url):
    r = httpx.post(url + P.FLUSH_CACHE)
    assert r.status_code == 401 and r.json()["error"]["param"] == "Authorization"
    assert httpx.post(url + P.FLUSH_CACHE, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.post(url + P.FLUSH_CACHE, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json() == {"success": True}


def test_an_unexpected_error_is_a_500_for_that_request_only(url):
    r = httpx.get(url + "/boom")
    assert r.status_code == 500 and r.json()["message"] == "internal error: RuntimeError: kaput"
    r = httpx.get(url + "/bad")
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.top_p"
    with pytest.raises(httpx.HTTPError):  # a stream already under way can only be cut, not turned into a 500
        with httpx.stream("GET", url + "/stream") as s:
            assert s.status_code == 200
            s.read()
    assert httpx.get(url + "/boom").status_code == 500  # still serving
