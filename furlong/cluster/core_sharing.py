"""Time-shared cores: the rollout engines freeze in place while the trainer computes, and go on right after.

With `cluster.share_cores=true` an async run gives the trainer and every engine the threads a sync
run would (`topology.time_shared`: their threads together oversubscribe the cores). Around each train
step the driver freezes the rollout engines (`/pause_generation` with mode `in_place`: requests in
flight and their KV cache kept, new requests queued) and continues them when the step is done.

Why: OS priority alone (the engines at nice +10, even SCHED_IDLE) did not keep a running engine from
slowing a two-thread trainer 2.5-3.5x on 2 vCPUs: its OpenMP barriers wait for whichever thread lost
its core, and the two share caches and memory bandwidth. A frozen engine costs the trainer nothing.
The engines still get every cycle the trainer leaves (its wait for a batch, the weight sync, the
driver's work), and requests keep arriving while they are frozen (an environment's tool call that
finished), so environment latency overlaps training.

Best effort: an engine that fails the pause or the continue (dead, being replaced) is the
supervisor's health checks' to find; the train step goes on either way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from furlong.core.client import EngineClient

CONTROL_TIMEOUT_S = 60.0  # one engine's pause / continue


class EngineYield:
    """Freezes the rollout engines around each train step where the cores are time-shared (`enabled`)."""

    def __init__(self, engine_urls: Callable[[], list[str]], admin_token: str, enabled: bool):
        self.engine_urls, self.token, self.enabled = engine_urls, admin_token, enabled
        self.yields = 0  # train steps the engines were frozen for
        self._clients: dict[str, EngineClient] = {}

    def _client(self, url: str) -> EngineClient:
        if url not in self._clients:
            self._clients[url] = EngineClient(url, admin_token=self.token, timeout_s=CONTROL_TIMEOUT_S)
        return self._clients[url]

    @contextlib.asynccontextmanager
    async def trainer_computing(self) -> AsyncIterator[None]:
        if not self.enabled:
            yield
            return
        clients = [self._client(u) for u in self.engine_urls()]
        await asyncio.gather(*(c.pause("in_place") for c in clients), return_exceptions=True)
        self.yields += 1
        try:
            yield
        finally:
            await asyncio.gather(*(c.resume() for c in clients), return_exceptions=True)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
