"""`core.aio_transport.AiohttpTransport`: httpx's API over aiohttp's pool, against real servers on 127.0.0.1.

What a caller of httpx relies on must hold through it: bodies, headers, statuses and encodings come
back as httpx would give them; aiohttp's failures arrive as the httpx exceptions `EngineClient`
retries on; the pool never opens more connections than its limit, and reuses them."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from furlong.core.aio_transport import AiohttpTransport
from furlong.core.app_thread import AppThread
from furlong.core.client import EngineClient, EngineError

pytestmark = pytest.mark.timeout(60)


def echo_app(peers: set[int]) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> dict:
        peers.add(request.client.port)
        body = await request.json()
        await asyncio.sleep(0.01)
        return {"text": "", "meta_info": {"id": body["rid"], "echo": body["input_ids"]}}

    @app.get("/echo")
    async def echo(request: Request) -> dict:
        return {"headers": dict(request.headers), "query": str(request.url.query)}

    @app.get("/zipped")
    async def zipped() -> Response:
        raw = gzip.compress(json.dumps({"ok": True}).encode())
        return Response(raw, media_type="application/json", headers={"Content-Encoding": "gzip"})

    @app.get("/teapot")
    async def teapot() -> Response:
        return Response('{"detail": "no coffee"}', status_code=418, media_type="application/json")

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(3)
        return {}

    return app


@pytest.fixture(scope="module")
def server():
    peers: set[int] = set()
    with AppThread(echo_app(peers)) as srv:
        srv.peers = peers
        yield srv


def test_requests_and_replies_arrive_as_httpx_sends_and_reads_them(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, transport=AiohttpTransport()) as http:
            got = (await http.get("/echo", params={"a": "1 2"}, headers={"Authorization": "Bearer T"})).json()
            zipped = await http.get("/zipped")
            teapot = await http.get("/teapot")
        return got, zipped, teapot

    got, zipped, teapot = asyncio.run(main())
    assert got["headers"]["authorization"] == "Bearer T" and got["query"] == "a=1+2"
    assert zipped.headers["content-encoding"] == "gzip" and zipped.json() == {"ok": True}  # httpx decoded it
    assert teapot.status_code == 418 and teapot.json() == {"detail": "no coffee"}


def test_many_requests_share_a_bounded_pool_of_reused_connections(server):
    """200 generate calls, 4 in flight at a time: each reply is its own request's, on at most 12 connections."""
    server.peers.clear()

    async def main():
        async with EngineClient(server.url, max_inflight=4) as client:
            replies = await asyncio.gather(*(client.generate([i, i + 1], {"max_new_tokens": 1}) for i in range(200)))
            return replies, client.transport_errors

    replies, errors = asyncio.run(main())
    assert [r["meta_info"]["echo"] for r in replies] == [[i, i + 1] for i in range(200)]
    assert errors == 0 and 1 <= len(server.peers) <= 4 + 8


def test_a_client_used_again_under_a_new_event_loop_still_works(server):
    client = EngineClient(server.url)
    first = asyncio.run(client.generate([1], {}))
    second = asyncio.run(client.generate([2], {}))
    asyncio.run(client.aclose())
    assert first["meta_info"]["echo"] == [1] and second["meta_info"]["echo"] == [2]


def test_a_read_timeout_is_httpx_read_timeout(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, transport=AiohttpTransport(), timeout=0.3) as http:
            await http.get("/slow")

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(main())


def test_a_refused_connection_is_retried_then_an_engine_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        async with EngineClient(f"http://127.0.0.1:{port}", max_retries=2, retry_backoff_s=0.001) as client:
            with pytest.raises(EngineError, match="failed 3 times; last error: ConnectError"):
                await client.generate([1], {})
            return client.transport_errors

    assert asyncio.run(main()) == 3


def test_a_server_that_hangs_up_is_httpx_read_error():
    """A server that reads the request and closes the connection without a reply."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def hang_up():
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()

    async def main():
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        async with httpx.AsyncClient(base_url=url, transport=AiohttpTransport()) as http:
            await http.post("/generate", json={})

    try:
        with pytest.raises(httpx.ReadError, match="ServerDisconnectedError"):
            asyncio.run(main())
    finally:
        listener.close()
