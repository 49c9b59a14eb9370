"""EngineClient: the rollout side of the engine HTTP contract (DESIGN §3), over asyncio.

One client speaks to one URL: an engine server or the router in front of many; both
answer SGLang's native `/generate`. The client owns three things every generate
function needs and none should re-implement:

- a concurrency limit (`max_inflight`) on requests in flight, so a rollout of
  thousands of samples does not open thousands of sockets at once;
- retries of requests that failed in transport (connection refused or reset, a
  502/503 from a router with no healthy engine), with backoff, up to
  `max_retries`; after that an `EngineError` names the URL, the attempts and the
  last error, and the caller marks its sample failed with that reason;
- a gate and a registry of in-flight request ids, so the rollout manager can stop
  new requests at a weight sync (`hold()` / `release()`) and abort exactly its own
  requests (`abort_inflight()`) without touching anyone else's on a shared engine.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx

RETRY_STATUS = {502, 503, 504}


class EngineError(RuntimeError):
    """A request the engine refused or that kept failing; the message says which and why."""


class EngineClient:
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
        self.url = url.rstrip("/")
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._admin_headers = headers
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_inflight + 8, max_keepalive_connections=max_inflight + 8),
            transport=transport,
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
                payload = {"input_ids": list(input_ids), "sampling_params": sampling_params, "return_logprob": True, "rid": rid, **extra}
                self._inflight.add(rid)
                self._idle.clear()
                self.requests += 1
                try:
                    resp = await self._http.post("/generate", json=payload, headers=headers)
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
            if resp.status_code != 200:
                raise EngineError(f"POST {self.url}/generate: HTTP {resp.status_code}: {resp.text[:500]}")
            return resp.json()
        raise EngineError(f"POST {self.url}/generate failed {self.max_retries + 1} times; last error: {last}")

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
                    raise EngineError(f"{len(self._inflight)} request(s) still in flight {wait_s}s after abort") from None
        return len(asked)

    async def abort(self, rid: str | None = None) -> None:
        """POST /abort_request for one request id, or for every request on the engine."""
        await self._control("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    async def pause(self, mode: str = "retract") -> None:
        await self._control("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._control("/continue_generation", {})

    async def _control(self, path: str, body: dict[str, Any]) -> None:
        try:
            resp = await self._http.post(path, json=body, headers=self._admin_headers)
        except httpx.TransportError as e:
            raise EngineError(f"POST {self.url}{path}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise EngineError(f"POST {self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
