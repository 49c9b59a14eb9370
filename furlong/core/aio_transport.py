"""An httpx transport that sends through aiohttp's connection pool: `AiohttpTransport`.

Why: a rollout keeps dozens of requests in flight to one engine (or router) and, with agent episodes
waiting on tools, as many idle keep-alive connections. httpcore's pool re-checks every connection
each time a request starts or ends (for an idle one a `getpeername` and a `poll` system call, plus
an attribute dict built per check), so its cost grows with connections x requests: profiling a
64-episode environment-latency rollout found half the driver's CPU there, about half a core taken
from the engine and trainer on a 2-core machine. aiohttp learns that a server closed a pooled
connection from the event loop, with no per-request scan.

Callers keep httpx's API (`httpx.AsyncClient(transport=AiohttpTransport(...))`): its requests,
responses, timeouts and exceptions, and tests keep injecting `httpx.MockTransport`. aiohttp's
errors come back as the httpx exceptions a caller already handles (`httpx.ConnectError`,
`httpx.ReadTimeout`, ...), so retries and error messages are unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import httpx

KEEPALIVE_S = 4.0  # under uvicorn's 5 s keep-alive, so the server rarely closes a connection we are about to reuse


def _timeout(request: httpx.Request) -> aiohttp.ClientTimeout:
    t = request.extensions.get("timeout") or {}
    connect, read = t.get("connect"), t.get("read")
    return aiohttp.ClientTimeout(total=None, sock_connect=connect, connect=t.get("pool") or connect, sock_read=read)


def _error(e: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The httpx exception a caller of httpx would have seen for aiohttp's `e`."""
    msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg, request=request)
    if isinstance(e, (aiohttp.ServerTimeoutError, TimeoutError)):
        return httpx.ReadTimeout(msg, request=request)
    if isinstance(e, aiohttp.ClientConnectorError):
        return httpx.ConnectError(msg, request=request)
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
        return httpx.ReadError(msg, request=request)
    return httpx.RemoteProtocolError(msg, request=request)


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx requests over one aiohttp session (made on first use, on the loop that uses it).

    `max_connections`: the pool's limit on open connections (requests beyond it wait for one).
    Responses are read whole before they are returned: the engine contract answers in JSON bodies.
    """

    def __init__(self, max_connections: int = 100):
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and self._loop is not loop:  # used again under a new `asyncio.run`
            self._session.detach()  # its connections belong to the old loop; leave them to it
            self._session = None
        if self._session is None or self._session.closed:
            self._loop = loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_S),
                auto_decompress=False,  # httpx decodes the body by its Content-Encoding
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers: list[tuple[str, str]] = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "host"]
        try:
            async with self._client().request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                timeout=_timeout(request),
                allow_redirects=False,
            ) as resp:
                content = await resp.read()
                raw: list[tuple[Any, Any]] = list(resp.raw_headers)
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _error(e, request) from e
        return httpx.Response(
            resp.status,
            headers=raw,
            content=content,
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
