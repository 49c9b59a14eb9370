"""The router's HTTP server: one address in front of many engine servers.

Usage (in process)::

    from furlong.router.server import serve_in_thread
    with serve_in_thread(["http://127.0.0.1:30001", "http://127.0.0.1:30002"]) as router:
        requests.post(router.url + "/generate", json={...})

or mount ``Router(engines).app`` in any ASGI server. From the shell: ``furlong router``.

What it does, and why:

* **Forwards** ``/generate``, ``/v1/chat/completions``, ``/v1/completions``, ``/tokenize``,
  ``/detokenize`` (and GETs such as ``/get_model_info``, ``/v1/models``) to one engine,
  passing the request and response bytes through untouched — token ids, log-probs and
  ``weight_version`` metadata must reach the rollout layer exactly as the engine wrote
  them. The only addition is an ``X-Furlong-Engine`` response header naming the engine.
  Streaming responses (SSE) are relayed chunk by chunk.
* **Routes** by the policy (see ``policies``); a request with an ``X-Routing-Key`` header
  (or a ``routing_key`` body field, which is stripped before forwarding) sticks to one
  engine for the whole session.
* **Fails over**: if the engine cannot be reached, drops the connection before the
  response is complete, or answers 502/503, the engine is quarantined on the spot and the
  *same* request is sent to another engine (at most ``max_retries`` times). Resuming a
  partial generation is the rollout layer's job, not the router's. A stream that breaks
  after its first bytes cannot be replayed; it ends with an SSE ``error`` event instead.
* **Fans out** control calls (abort, pause, continue, flush, weight updates) to every
  healthy engine concurrently and answers with each engine's result: a weight update that
  failed on one engine must never look like success. ``?engine=URL`` targets just one
  (``/init_weights_update_group`` needs a different ``rank_offset`` per engine, so the
  weight-sync layer calls it once per engine that way).
  Control calls and ``/add_engine`` / ``/remove_engine`` need ``Authorization: Bearer
  <admin token>`` when the router has one; the header is forwarded to the engines.
* **Bounds request bodies**: one over ``max_body_bytes`` (default 64 MiB, the engine's own
  limit) is refused with 413 naming the limit, before it is buffered (``bodies``).
* **Own endpoints**: ``GET /health`` (200 while any engine is healthy), ``GET /engines``
  (state, in-flight count, failures of each), ``GET /metrics`` (Prometheus text).

Overhead is kept low with one pooled ``aiohttp.ClientSession`` for every upstream call and
by not parsing request bodies unless a routing key or session affinity needs it. Measured
on a 2-core machine, the router process spends ~0.7 ms of CPU per proxied ``/generate``
(its inbound uvicorn included); with ``httpx.AsyncClient`` upstream it spent ~1.5 ms.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from furlong.core import api, spans
from furlong.core.app_thread import AppThread
from furlong.router.bodies import MAX_BODY_BYTES, BodyTooLarge, check_limit, read_body
from furlong.router.health import HEALTHY, Engine, EnginePool, normalize_url
from furlong.router.policies import Policy, derive_session_key

log = logging.getLogger("furlong.router")

ROUTING_HEADER = "x-routing-key"
ENGINE_HEADER = "X-Furlong-Engine"
FORWARD_POST = (api.GENERATE, "/v1/chat/completions", "/v1/completions", api.TOKENIZE, api.DETOKENIZE)
FORWARD_GET = (api.MODEL_INFO, api.HEALTH_GENERATE, "/v1/models", api.SERVER_INFO, api.WEIGHT_VERSION)
CONTROL = api.CONTROL_PATHS  # fanned out to every engine; the engine API's one list (furlong/core/api.py)
RETRY_STATUSES = (502, 503)
# Not forwarded in either direction: they describe one hop, not the message.
_HOP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
    }
)


def error(status: int, message: str) -> JSONResponse:
    """The error shape of SGLang and OpenAI, so every client reports the message."""
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


class Router:
    """Router state and its ASGI app (``Router(...).app``)."""

    def __init__(
        self,
        engines: list[str],
        policy: str = "least_inflight",
        admin_token: str | None = None,
        health_interval: float = 2.0,
        health_timeout: float = 2.0,
        unhealthy_after: int = 2,
        max_retries: int = 2,
        connect_timeout: float = 5.0,
        control_timeout: float | None = 600.0,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if health_interval <= 0:
            raise ValueError(f"health_interval: must be > 0, got {health_interval}")
        if health_timeout <= 0:
            raise ValueError(f"health_timeout: must be > 0, got {health_timeout}")
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after: must be >= 1, got {unhealthy_after}")
        if max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {max_retries}")
        self.policy = Policy(policy)
        self.pool = EnginePool(
            engines, interval=health_interval, timeout=health_timeout, unhealthy_after=unhealthy_after
        )
        self.admin_token = admin_token or None
        self.max_retries = max_retries
        self.connect_timeout = connect_timeout
        self.control_timeout = control_timeout
        self.max_body_bytes = check_limit(max_body_bytes)
        self.client: aiohttp.ClientSession | None = None
        self.counts: Counter[str] = Counter()  # requests per path, retries, ...
        routes = [Route(p, self.forward, methods=["POST"]) for p in FORWARD_POST]
        routes += [Route(p, self.forward, methods=["GET"]) for p in FORWARD_GET]
        routes += [Route(p, self.fanout, methods=["POST"]) for p in CONTROL]
        routes += [
            Route("/health", self.health, methods=["GET"]),
            Route("/engines", self.list_engines, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route(spans.SPANS_PATH, self.timeline_spans, methods=["GET"]),
            Route("/add_engine", self.add_engine, methods=["POST"]),
            Route("/remove_engine", self.remove_engine, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes, lifespan=self._lifespan, exception_handlers={BodyTooLarge: _body_too_large})

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # No read timeout on forwarded calls: a long generation is not a dead engine
        # (the health probe, with its own timeout, decides that). Idle connections are
        # dropped after 2 s, before uvicorn's 5 s idle close, so a pooled connection is
        # never reused just as the engine closes it (which would look like a dead engine).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout)
        # auto_decompress off: bodies are relayed byte for byte, with their content-encoding
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as client:
            self.client = client
            await self.pool.start(client)
            try:
                yield
            finally:
                await self.pool.stop()

    # ---------------------------------------------------------------- forwarding

    async def forward(self, request: Request) -> Response:
        t_in = time.time()  # the request's time in the router (routing, retries) is one span of the router's lane
        path = request.url.path
        self.counts[f"requests{path}"] += 1
        raw = await read_body(request, self.max_body_bytes)
        key = request.headers.get(ROUTING_HEADER)
        derive = key is None and self.policy.name == "session_affinity"
        if request.method == "POST" and (derive or b'"routing_key"' in raw):  # else: bytes pass unparsed
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                return error(400, f"body: not valid JSON ({e})")
            if not isinstance(body, dict):
                return error(400, f"body: expected a JSON object, got {type(body).__name__}")
            if "routing_key" in body:
                body_key = body.pop("routing_key")
                if body_key is not None and not isinstance(body_key, str):
                    return error(400, f"routing_key: expected a string, got {type(body_key).__name__}")
                key = key if key is not None else body_key
                raw = json.dumps(body).encode()
            if key is None and derive:
                key = derive_session_key(path, body)
        headers = _request_headers(request)
        tried: list[str] = []
        problems: list[str] = []
        for attempt in range(self.max_retries + 1):
            candidates = [e for e in self.pool.healthy() if e.url not in tried]
            if not candidates:
                break
            engine = self.policy.choose(candidates, key)
            tried.append(engine.url)
            if attempt:
                self.counts["retries"] += 1
            t_send = time.time()
            response = await self._send(engine, request.method, path, raw, headers, request.url.query, problems)
            if response is not None:
                queued = round(t_send - t_in, 6)
                spans.record("router", "route", t_in, time.time(), path=path, attempts=attempt + 1, queue_s=queued)
                return response
            spans.record("router", "retry", t_send, time.time(), path=path, engine=engine.url)
        spans.record("router", "route", t_in, time.time(), path=path, attempts=len(tried), error="unavailable")
        return error(503, self._unavailable(path, problems))

    async def _send(
        self,
        engine: Engine,
        method: str,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        query: str,
        problems: list[str],
    ) -> Response | None:
        """One attempt on one engine; None (and the engine quarantined) if it failed."""
        assert self.client is not None
        url = engine.url + path + (f"?{query}" if query else "")
        engine.inflight += 1
        streaming = False
        resp: aiohttp.ClientResponse | None = None
        try:
            resp = await self.client.request(method, url, data=raw, headers=headers)
            if resp.status in RETRY_STATUSES:
                reason = f"{path} returned {resp.status}"
            elif resp.headers.get("content-type", "").startswith("text/event-stream"):
                streaming = True
                return _Relay(self.pool, engine, resp)
            else:
                content = await resp.read()
                engine.served += 1
                return Response(content, status_code=resp.status, headers=_response_headers(resp, engine))
        except (TimeoutError, aiohttp.ClientError) as e:
            reason = f"{path} failed: {type(e).__name__}: {e}"
        finally:
            if not streaming:
                engine.inflight -= 1
                if resp is not None:
                    resp.release()
        problems.append(f"{engine.url}: {reason}")
        self.pool.quarantine(engine, reason)
        return None

    def _unavailable(self, path: str, problems: list[str]) -> str:
        if problems:
            return f"no engine could serve {path}: " + "; ".join(problems)
        n = len(self.pool.engines)
        if n == 0:
            return f"no engine available for {path}: no engine is registered (POST /add_engine)"
        return f"no engine available for {path}: all {n} registered engines are quarantined (see GET /engines)"

    # ---------------------------------------------------------------- control fan-out

    def _authorized(self, request: Request) -> bool:
        if self.admin_token is None:
            return True
        given = request.headers.get("authorization", "")
        return secrets.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode())

    async def fanout(self, request: Request) -> Response:
        path = request.url.path
        if not self._authorized(request):
            return error(401, f"{path} needs the admin token: Authorization: Bearer <token>")
        self.counts[f"requests{path}"] += 1
        raw = await read_body(request, self.max_body_bytes)
        headers = _request_headers(request)
        skipped: dict[str, str] = {}
        target = request.query_params.get("engine")
        if target is not None:
            try:
                engine = self.pool.engines.get(normalize_url(target, "engine"))
            except ValueError as e:
                return error(400, str(e))
            if engine is None:
                return error(404, f"engine: {target!r} is not registered (see GET /engines)")
            engines = [engine]
        else:
            engines = self.pool.healthy()
            skipped = {e.url: e.state for e in self.pool.engines.values() if e.state != HEALTHY}
        if not engines:
            return error(503, self._unavailable(path, []))
        results = await asyncio.gather(*(self._control_one(e, path, raw, headers) for e in engines))
        by_engine = dict(zip([e.url for e in engines], results))
        failed = [r["status"] for r in results if not r["ok"]]
        if not failed:
            status = 200
        elif all(400 <= s < 500 for s in failed):
            status = failed[0]  # the engines rejected the request itself: the caller's error
        else:
            status = 502
        body: dict[str, Any] = {"ok": not failed, "results": by_engine, "skipped": skipped}
        if failed:
            why = "; ".join(f"{url}: {_summary(r)}" for url, r in by_engine.items() if not r["ok"])
            message = f"{path} failed on {len(failed)} of {len(engines)} engines: {why}"
            body["error"] = {"message": message, "code": status}
        return JSONResponse(body, status_code=status)

    async def _control_one(self, engine: Engine, path: str, raw: bytes, headers: dict[str, str]) -> dict[str, Any]:
        assert self.client is not None
        timeout = aiohttp.ClientTimeout(total=self.control_timeout, sock_connect=self.connect_timeout)
        try:
            async with self.client.post(engine.url + path, data=raw, headers=headers, timeout=timeout) as r:
                status, content = r.status, await r.read()
        except TimeoutError:  # slow (a big weight load), not dead: the health probe decides
            return {"ok": False, "status": 504, "error": f"no answer within {self.control_timeout}s"}
        except aiohttp.ClientError as e:
            reason = f"{type(e).__name__}: {e}"
            self.pool.quarantine(engine, f"{path} failed: {reason}")
            return {"ok": False, "status": 502, "error": reason}
        try:
            body: Any = json.loads(content)
        except ValueError:
            body = content.decode(errors="replace")
        # SGLang answers some failed updates with 200 and {"success": false}
        ok = 200 <= status < 300 and not (isinstance(body, dict) and body.get("success") is False)
        return {"ok": ok, "status": status, "body": body}

    # ---------------------------------------------------------------- own endpoints

    async def health(self, request: Request) -> Response:
        n = len(self.pool.healthy())
        body = {"status": "ok" if n else "unavailable", "healthy_engines": n, "engines": len(self.pool.engines)}
        return JSONResponse(body, status_code=200 if n else 503)

    async def list_engines(self, request: Request) -> Response:
        return JSONResponse({"policy": self.policy.name, "engines": [e.to_dict() for e in self.pool.engines.values()]})

    async def timeline_spans(self, request: Request) -> Response:
        """The router's spans after `?since=` (read-only): the driver pulls them each step."""
        try:
            since = int(request.query_params.get("since", "0"))
        except ValueError:
            return error(400, "since: expected an integer")
        return JSONResponse(spans.RECORDER.since(since))

    async def metrics(self, request: Request) -> Response:
        lines = ["# TYPE furlong_router_requests_total counter"]
        for name, value in sorted(self.counts.items()):
            if name.startswith("requests/"):
                lines.append(f'furlong_router_requests_total{{path="{name[len("requests") :]}"}} {value}')
        lines += [
            "# TYPE furlong_router_retries_total counter",
            f"furlong_router_retries_total {self.counts['retries']}",
        ]
        engines = list(self.pool.engines.values())
        for metric, kind, attr in (
            ("engine_inflight", "gauge", "inflight"),
            ("engine_served_total", "counter", "served"),
            ("engine_failures_total", "counter", "failures"),
        ):
            lines.append(f"# TYPE furlong_router_{metric} {kind}")
            lines += [f'furlong_router_{metric}{{engine="{e.url}"}} {getattr(e, attr)}' for e in engines]
        lines.append("# TYPE furlong_router_engine_healthy gauge")
        lines += [f'furlong_router_engine_healthy{{engine="{e.url}"}} {int(e.state == HEALTHY)}' for e in engines]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def _admin_url(self, request: Request) -> str | Response:
        """The ``url`` of an add/remove call (JSON body or query), or the error response."""
        if not self._authorized(request):
            return error(401, f"{request.url.path} needs the admin token: Authorization: Bearer <token>")
        url = request.query_params.get("url")
        if url is None:
            raw = await read_body(request, self.max_body_bytes)
            try:
                body = json.loads(raw) if raw.strip() else {}
            except (ValueError, UnicodeDecodeError) as e:
                return error(400, f"body: not valid JSON ({e})")
            if not isinstance(body, dict) or "url" not in body:
                return error(400, 'url: missing; send {"url": "http://host:port"}')
            url = body["url"]
        try:
            return normalize_url(url)
        except ValueError as e:
            return error(400, str(e))

    async def add_engine(self, request: Request) -> Response:
        url = await self._admin_url(request)
        if isinstance(url, Response):
            return url
        engine = await self.pool.add(url)
        return JSONResponse(engine.to_dict())

    async def remove_engine(self, request: Request) -> Response:
        url = await self._admin_url(request)
        if isinstance(url, Response):
            return url
        try:
            engine = self.pool.remove(url)
        except KeyError:
            return error(404, f"url: {url} is not registered (see GET /engines)")
        return JSONResponse(engine.to_dict())


class _Relay(StreamingResponse):
    """A streamed engine response relayed chunk by chunk.

    Clean-up lives in ``__call__`` rather than in the chunk generator, because a client
    that disconnects early can cancel the response before the generator ever starts, and
    the engine's in-flight count must drop whatever happens.
    """

    def __init__(self, pool: EnginePool, engine: Engine, resp: aiohttp.ClientResponse) -> None:
        self.pool, self.engine, self.upstream = pool, engine, resp
        super().__init__(self._chunks(), status_code=resp.status, headers=_response_headers(resp, engine))

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as e:
            reason = f"stream broke: {type(e).__name__}: {e}"
            self.pool.quarantine(self.engine, reason)
            message = f"engine {self.engine.url} failed mid-stream ({reason}); the output so far is incomplete"
            yield f"data: {json.dumps({'error': {'message': message, 'code': 502}})}\n\n".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.inflight -= 1
            self.engine.served += 1
            if self.upstream.content.at_eof():
                self.upstream.release()  # back to the pool
            else:
                self.upstream.close()  # client left early: drop the connection so the engine aborts the request


async def _body_too_large(request: Request, e: Exception) -> Response:
    return error(413, f"{request.url.path}: {e}")


def _summary(result: dict[str, Any]) -> str:
    """One engine's failed control result in a few words (its own error message if any)."""
    body = result.get("body")
    if isinstance(body, dict):
        err = body.get("error")
        message = err.get("message") if isinstance(err, dict) else err or body.get("message") or body.get("detail")
    else:
        message = body
    return f"{result['status']} {message or result.get('error', '')}".strip()[:500]


def _request_headers(request: Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k not in _HOP_HEADERS}
    headers.setdefault("accept-encoding", "identity")  # raw bytes are relayed: never ask for an unasked encoding
    return headers


def _response_headers(resp: aiohttp.ClientResponse, engine: Engine) -> dict[str, str]:
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
    headers[ENGINE_HEADER] = engine.url
    return headers


class RouterHandle(AppThread):
    """A router serving in a thread of this process; ``stop()`` (or leaving ``with``) ends it."""

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0):
        super().__init__(router.app, host, port, name="furlong-router")
        self.router = router


def serve_in_thread(engines: list[str], port: int = 0, host: str = "127.0.0.1", **router_kwargs: Any) -> RouterHandle:
    """Start a router in this process (port 0 picks a free one) and return once it serves."""
    return RouterHandle(Router(engines, **router_kwargs), host, port).start(timeout_s=60)
