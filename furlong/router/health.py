"""The router's view of its engines: who is there, who is healthy, how busy each is.

An engine is ``healthy`` (takes requests) or ``quarantined`` (takes none). It is
quarantined the moment a request to it fails at the transport level (the engine is gone:
waiting would only fail more requests), or after ``unhealthy_after`` consecutive ``/health``
probes fail or time out (one slow probe on a busy machine is not a death). The first probe
that passes again re-admits it — so a crashed engine restarted on the same address rejoins
without anyone telling the router.
Probes run on an interval for every engine, healthy or not, concurrently, so one hung
engine never delays the verdict on the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

log = logging.getLogger("furlong.router")

HEALTHY = "healthy"
QUARANTINED = "quarantined"


def normalize_url(url: str, field_name: str = "url") -> str:
    """``http://host:port`` without a trailing slash; ValueError naming the field otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{field_name}: expected an engine URL such as http://127.0.0.1:30000, got {url!r}")
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{field_name}: {url!r} is not a valid URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{field_name}: {url!r} must be http(s)://host:port")
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"{field_name}: {url!r} must be a bare base URL (no path or query)")
    if port is None:
        raise ValueError(f"{field_name}: {url!r} has no port")
    return url


@dataclass
class Engine:
    url: str
    state: str = QUARANTINED  # until the first probe says otherwise
    inflight: int = 0
    served: int = 0  # requests answered (any status)
    failures: int = 0  # failed probes and failed requests, all time
    failed_probes: int = 0  # consecutive
    last_error: str | None = None
    last_change: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": self.state,
            "inflight": self.inflight,
            "served": self.served,
            "failures": self.failures,
            "failed_probes": self.failed_probes,
            "last_error": self.last_error,
            "since": self.last_change,
        }


class EnginePool:
    """The engines, their states, and the health-check loop."""

    def __init__(self, urls: list[str], interval: float = 2.0, timeout: float = 2.0, unhealthy_after: int = 2) -> None:
        self.engines: dict[str, Engine] = {}
        for url in urls:
            url = normalize_url(url, "engine")
            self.engines[url] = Engine(url)
        self.client: aiohttp.ClientSession | None = None  # the router's pooled session, set by start()
        self.interval = interval
        self.timeout = timeout
        self.unhealthy_after = unhealthy_after
        self._task: asyncio.Task[None] | None = None

    def healthy(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.state == HEALTHY]

    def quarantine(self, engine: Engine, reason: str) -> None:
        engine.failures += 1
        engine.last_error = reason
        if engine.state != QUARANTINED:
            engine.state = QUARANTINED
            engine.last_change = time.time()
            log.warning("engine %s quarantined: %s", engine.url, reason)

    def admit(self, engine: Engine) -> None:
        if engine.state != HEALTHY:
            engine.state = HEALTHY
            engine.last_change = time.time()
            log.info("engine %s admitted", engine.url)

    async def probe(self, engine: Engine) -> bool:
        """One ``GET /health``; updates the engine's state and returns whether it passed."""
        assert self.client is not None, "EnginePool.start() was not called"
        try:
            async with self.client.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                await r.read()
                ok, reason = r.status == 200, f"/health returned {r.status}"
        except TimeoutError:
            ok, reason = False, f"/health timed out after {self.timeout:g}s"
        except aiohttp.ClientError as e:
            ok, reason = False, f"/health failed: {type(e).__name__}: {e}"
        if engine.url not in self.engines:  # removed while the probe was in flight
            return ok
        if ok:
            engine.failed_probes = 0
            self.admit(engine)
        else:
            engine.failed_probes += 1
            if engine.failed_probes >= self.unhealthy_after or engine.state != HEALTHY:
                self.quarantine(engine, reason)
            else:
                engine.failures += 1
                engine.last_error = reason
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in list(self.engines.values())))

    async def add(self, url: str) -> Engine:
        url = normalize_url(url)
        engine = self.engines.get(url)
        if engine is None:
            engine = self.engines[url] = Engine(url)
            log.info("engine %s added", url)
        await self.probe(engine)
        return engine

    def remove(self, url: str) -> Engine:
        """KeyError naming the url when absent. In-flight requests to it still finish."""
        url = normalize_url(url)
        if url not in self.engines:
            raise KeyError(url)
        log.info("engine %s removed", url)
        return self.engines.pop(url)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.probe_all()
            except Exception:  # never let one bad probe end health checking
                log.exception("health check round failed")

    async def start(self, client: aiohttp.ClientSession) -> None:
        self.client = client
        await self.probe_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
