"""Per-step engine gauges for the dashboard's engines view, read from each engine's Prometheus `/metrics`."""

from __future__ import annotations

import asyncio
import time

from furlong.core.client import EngineClient, EngineError


def parse_prometheus(text: str, prefix: str = "furlong_engine_") -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.partition(" ")
            try:
                out[name[len(prefix) :]] = float(value)
            except ValueError:
                continue
    return out


class EngineStats:
    """`engine/<i>/{healthy,queue,tokens_per_s,kv_cache_usage}`; tokens/s from the generated-token counter."""

    def __init__(self, urls: list[str], timeout_s: float = 2.0):
        self.urls, self.timeout_s = list(urls), timeout_s
        self._last: dict[str, tuple[float, float]] = {}

    async def _one(self, i: int, url: str) -> dict[str, float]:
        key = f"engine/{i}"
        try:
            async with EngineClient(url, timeout_s=self.timeout_s, max_retries=0) as client:
                text = await client.metrics()
        except EngineError:
            return {f"{key}/healthy": 0.0}
        m, now = parse_prometheus(text), time.monotonic()
        tokens = m.get("generation_tokens_total", 0.0)
        out = {
            f"{key}/healthy": 1.0,
            f"{key}/queue": m.get("running_requests", 0.0) + m.get("waiting_requests", 0.0),
            f"{key}/kv_cache_usage": m.get("kv_cache_usage", 0.0),
        }
        if url in self._last:
            t0, n0 = self._last[url]
            out[f"{key}/tokens_per_s"] = max(0.0, tokens - n0) / max(1e-6, now - t0)
        self._last[url] = (now, tokens)
        return out

    async def poll(self) -> dict[str, float]:
        parts = await asyncio.gather(*(self._one(i, u) for i, u in enumerate(self.urls)))
        return {k: v for part in parts for k, v in part.items()}
