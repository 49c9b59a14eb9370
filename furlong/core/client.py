"""The one client of the engine HTTP contract (DESIGN §3): `EngineClient` (asyncio) and `EngineControl` (blocking).

Why two classes and one module: rollout lives on an event loop and needs
generation with back-pressure; a weight sender lives on threads (one lane per
engine) and needs only control calls. Both speak one URL each, send the run's
admin token on the control paths (`api.CONTROL_PATHS`) and nowhere else, and read
replies the same way (`_Endpoint`): a refusal or an unreachable engine is an
`EngineError` whose message names the method, URL, path, HTTP status and the
engine's own reason, so a caller never has to re-parse a response to say what went wrong.

`EngineClient` (an engine server or the router in front of many; both answer
SGLang's native `/generate`) owns three things every generate function needs and
none should re-implement:

- a concurrency limit (`max_inflight`) on requests in flight, so a rollout of
  thousands of samples does not open thousands of sockets at once;
- retries of requests that failed in transport (connection refused or reset, a
  502/503 from a router with no healthy engine), with backoff, up to
  `max_retries`; after that an `EngineError` names the URL, the attempts and the
  last error, and the caller marks its sample failed with that reason;
- a gate and a registry of in-flight request ids, so the rollout manager can stop
  new requests at a weight sync (`hold()` / `release()`) and abort exactly its own
  requests (`abort_inflight()`) without touching anyone else's on a shared engine.

`EngineControl` is one engine's control surface for weight sync, checksums and the
parameter schema: pause and resume, cache flush, the four weight-update calls, the
weight-update group, checksums, model info, version and health.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx

from furlong.core.aio_transport import AiohttpTransport
from furlong.core.api import (
    ABORT,
    CONTINUE,
    CONTROL_PATHS,
    DESTROY_GROUP,
    FLUSH_CACHE,
    GENERATE,
    HEALTH,
    INIT_GROUP,
    METRICS,
    MODEL_INFO,
    PAUSE,
    PAUSE_MODES,
    SET_THREADS,
    UPDATE_FROM_DISK,
    UPDATE_FROM_DISTRIBUTED,
    UPDATE_FROM_TENSOR,
    WEIGHT_CHECKSUMS,
    WEIGHT_VERSION,
)
from furlong.core.net import tls_context

RETRY_STATUS = {502, 503, 504}
GROUP_NAME = "weight_update_group"


class EngineError(RuntimeError):
    """A request the engine refused or that kept failing; the message says which and why.

    `status` is the HTTP status when the engine answered (None when it could not be reached),
    so a caller can tell "no such endpoint" (404/405) from a refusal without parsing text.
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def error_text(r: httpx.Response) -> str:
    """The engine's own reason from an error reply (OpenAI-style `error.message`, FastAPI `detail`, or raw text)."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message"))
    return str(body.get("detail", body) if isinstance(body, dict) else body)[:500]


def pause_body(mode: str) -> dict[str, str]:
    """The `/pause_generation` body; an unknown mode is refused here rather than as an engine's 400."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode: unknown pause mode {mode!r}; choose one of {list(PAUSE_MODES)}")
    return {"mode": mode}


def _given(**fields: Any) -> dict[str, Any]:
    """A request body of the fields a caller set: an omitted field keeps the engine's default."""
    return {k: v for k, v in fields.items() if v is not None}


class _Endpoint:
    """What both clients share: one URL, the admin header for control paths, and how a reply is read."""

    def __init__(self, url: str, admin_token: str | None):
        self.url = url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    def _headers(self, path: str) -> dict[str, str]:
        return self._auth if path in CONTROL_PATHS else {}

    def _unreachable(self, method: str, path: str, e: httpx.HTTPError) -> EngineError:
        return EngineError(f"{method} {self.url}{path}: {type(e).__name__}: {e}")

    def _reply(self, method: str, path: str, resp: httpx.Response) -> Any:
        """The reply's JSON; a non-200, or a 200 that says `success: false`, raises EngineError.

        A 200 whose body is not JSON (SGLang answers some control calls in plain text, `/health` with
        nothing) is a success and comes back as `{"message": text}`.
        """
        if resp.status_code != 200:
            raise EngineError(
                f"{method} {self.url}{path}: HTTP {resp.status_code}: {error_text(resp)}", resp.status_code
            )
        try:
            out = resp.json()
        except ValueError:
            return {"message": resp.text[:500]}
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"{method} {self.url}{path}: {out.get('message')}", resp.status_code)
        return out


class EngineClient(_Endpoint):
    """Generation and the rollout's control calls to one URL, on asyncio (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        admin_token: str | None = None,
        max_inflight: int = 64,
        max_retries: int = 3,
        retry_backoff_s: float = 0.05,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        if max_inflight < 1:
            raise ValueError(f"EngineClient: max_inflight must be >= 1, got {max_inflight}")
        if max_retries < 0:
            raise ValueError(f"EngineClient: max_retries must be >= 0, got {max_retries}")
        super().__init__(url, admin_token)
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=transport or AiohttpTransport(max_connections=max_inflight + 8),
            verify=tls_context(),
        )
        self._slots = asyncio.Semaphore(max_inflight)
        self._open = asyncio.Event()
        self._open.set()
        self._inflight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.requests = 0  # /generate calls sent, retries included
        self.transport_errors = 0

    # ---- generation ------------------------------------------------------
    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], routing_key: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        """POST /generate with log-probs; retried on transport errors; raises EngineError.

        `routing_key` travels as the `X-Routing-Key` header (never in the body, which an
        engine without a router in front would reject), so the router keeps a session on one engine.
        """
        headers = {"X-Routing-Key": routing_key} if routing_key else None
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(self.retry_backoff_s * 2 ** (attempt - 1), 2.0))
            async with self._slots:
                await self._open.wait()  # a weight sync holds new requests here
                rid = uuid.uuid4().hex
                payload = {
                    "input_ids": list(input_ids),
                    "sampling_params": sampling_params,
                    "return_logprob": True,
                    "rid": rid,
                    **extra,
                }
                self._inflight.add(rid)
                self._idle.clear()
                self.requests += 1
                try:
                    resp = await self._http.post(GENERATE, json=payload, headers=headers)
                except httpx.TransportError as e:
                    self.transport_errors += 1
                    last = f"{type(e).__name__}: {e}"
                    continue
                finally:
                    self._inflight.discard(rid)
                    if not self._inflight:
                        self._idle.set()
            if resp.status_code in RETRY_STATUS:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            return self._reply("POST", GENERATE, resp)
        raise EngineError(f"POST {self.url}{GENERATE} failed {self.max_retries + 1} times; last error: {last}")

    # ---- weight-sync control --------------------------------------------
    def hold(self) -> None:
        """Stop sending new requests (those already sent carry on) until `release()`."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def abort_inflight(self, *, wait_s: float = 30.0) -> int:
        """Abort every request this client has in flight and wait until they have returned.

        An abort can overtake its request on the way to the engine and find nothing to
        abort, so aborts are re-sent until the requests are back. Returns how many
        distinct requests were asked to abort.
        """
        asked: set[str] = set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while self._inflight:
            rids = set(self._inflight)
            asked |= rids
            # An engine that died meanwhile cannot answer the abort; its requests come back
            # as transport errors on their own, which is all an abort is for.
            await asyncio.gather(*(self.abort(rid) for rid in rids), return_exceptions=True)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=min(0.5, max(deadline - loop.time(), 0.01)))
            except TimeoutError:
                if loop.time() >= deadline:
                    left = len(self._inflight)
                    raise EngineError(f"{left} request(s) still in flight {wait_s}s after abort") from None
        return len(asked)

    async def abort(self, rid: str | None = None) -> None:
        """POST /abort_request for one request id, or for every request on the engine."""
        await self._post(ABORT, {"rid": rid} if rid else {"abort_all": True})

    async def pause(self, mode: str = "retract") -> None:
        """POST /pause_generation; `mode` is one of `api.PAUSE_MODES` (what happens to requests in flight)."""
        await self._post(PAUSE, pause_body(mode))

    async def resume(self) -> None:
        await self._post(CONTINUE, {})

    async def set_threads(self, threads: int) -> int:
        """POST /set_threads (furlong's engine only): compute with `threads` CPU threads; returns the count set."""
        return (await self._post(SET_THREADS, {"threads": threads}))["threads"]

    async def health(self) -> None:
        """GET /health; raises EngineError (status None when unreachable or timed out)."""
        await self._get(HEALTH)

    async def metrics(self) -> str:
        """GET /metrics: the engine's Prometheus text."""
        try:
            resp = await self._http.get(METRICS)
        except httpx.TransportError as e:
            raise self._unreachable("GET", METRICS, e) from e
        if resp.status_code != 200:
            raise EngineError(f"GET {self.url}{METRICS}: HTTP {resp.status_code}: {error_text(resp)}", resp.status_code)
        return resp.text

    async def _get(self, path: str) -> Any:
        try:
            resp = await self._http.get(path, headers=self._headers(path))
        except httpx.TransportError as e:
            raise self._unreachable("GET", path, e) from e
        return self._reply("GET", path, resp)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            resp = await self._http.post(path, json=body, headers=self._headers(path))
        except httpx.TransportError as e:
            raise self._unreachable("POST", path, e) from e
        return self._reply("POST", path, resp)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class EngineControl(_Endpoint):
    """One engine's control calls, blocking; safe to share across threads (httpx.Client is).

    Every call returns the engine's JSON reply or raises `EngineError`. Optional
    arguments left at None are not sent, so the engine applies its own default.
    """

    def __init__(
        self,
        url: str,
        *,
        admin_token: str | None = None,
        timeout_s: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ):
        super().__init__(url, admin_token)
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport, verify=tls_context())

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            resp = self._http.request(method, path, json=body, headers=self._headers(path))
        except httpx.HTTPError as e:
            raise self._unreachable(method, path, e) from None
        return self._reply(method, path, resp)

    # ---- state ------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """GET /health: raises EngineError unless the engine answers 200."""
        return self._call("GET", HEALTH)

    def model_info(self) -> dict[str, Any]:
        return self._call("GET", MODEL_INFO)

    def weight_version(self) -> int:
        return self._call("GET", WEIGHT_VERSION)["weight_version"]

    def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """POST /get_weights_checksum: `{"weight_version", "tensors": {name: {dtype, shape, crc32}}}`.

        `names` None asks for every tensor. An engine without the endpoint raises
        EngineError with `status` 404 or 405.
        """
        return self._call("POST", WEIGHT_CHECKSUMS, _given(names=names))

    # ---- serving ----------------------------------------------------------
    def pause(self, mode: str = "retract") -> None:
        """POST /pause_generation; `mode` is one of `api.PAUSE_MODES` (what happens to requests in flight)."""
        self._call("POST", PAUSE, pause_body(mode))

    def resume(self) -> None:
        self._call("POST", CONTINUE, {})

    def flush_cache(self) -> None:
        self._call("POST", FLUSH_CACHE, {})

    # ---- weights ----------------------------------------------------------
    def update_weights_from_tensor(
        self, shm: dict[str, Any], *, weight_version: int | None = None, flush_cache: bool | None = None
    ) -> dict[str, Any]:
        """Load the tensors a shared-memory handle (`weights.tensors.write_shm` format) describes."""
        return self._call(
            "POST", UPDATE_FROM_TENSOR, _given(shm=shm, weight_version=weight_version, flush_cache=flush_cache)
        )

    def update_weights_from_disk(
        self, model_path: str, *, weight_version: int | None = None, flush_cache: bool | None = None
    ) -> dict[str, Any]:
        return self._call(
            "POST",
            UPDATE_FROM_DISK,
            _given(model_path=model_path, weight_version=weight_version, flush_cache=flush_cache),
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        rank_offset: int,
        world_size: int,
        group_name: str = GROUP_NAME,
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> dict[str, Any]:
        """Join a broadcast group; blocks until every member has joined (call it off the rendezvous thread)."""
        return self._call(
            "POST",
            INIT_GROUP,
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
                "timeout_s": timeout_s,
            },
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = GROUP_NAME,
        weight_version: int | None = None,
        flush_cache: bool | None = None,
    ) -> dict[str, Any]:
        """Receive one bucket over the group, in this order of names; returns once it is applied."""
        return self._call(
            "POST",
            UPDATE_FROM_DISTRIBUTED,
            _given(
                names=names,
                dtypes=dtypes,
                shapes=shapes,
                group_name=group_name,
                weight_version=weight_version,
                flush_cache=flush_cache,
            ),
        )

    def destroy_weights_update_group(self, group_name: str = GROUP_NAME) -> dict[str, Any]:
        return self._call("POST", DESTROY_GROUP, {"group_name": group_name})

    # ---- lifecycle --------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
