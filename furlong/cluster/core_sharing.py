"""Cores shared between trainer and engines in async runs, switched around each train step (`EngineYield`).

Two ways, both off by default:

- **frozen engines** (`cluster.share_cores`): the engines freeze in place while the trainer computes, and
  go on right after;
- **lent cores** (`cluster.lend_idle_cores`): the cores stay split, but while the trainer waits for a
  batch the engines compute with every core (`/set_threads`), and drop back to their share while it
  computes.

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

Lent cores, why: where generation bounds the step (agent episodes waiting on tools, long
responses), a split trainer waits for its batch while its core idles, and an engine gains from a
second core (1.33x on the 25M model, 2 vCPUs). Frozen engines suit the opposite case, a step bound by
the trainer, which gains more (1.9x) from the second core. The engines' thread count changes between
two of their steps; a compiled decode step (`engine.compile`) compiles once more for the second count
(Dynamo guards the thread count) and keeps both.

Best effort: an engine that fails the pause, the continue or a thread change (dead, being replaced,
an SGLang engine without `/set_threads`) is the supervisor's health checks' to find; the train step
goes on either way, and a restarted engine takes every core again after the next train step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from furlong.core.client import EngineClient

CONTROL_TIMEOUT_S = 60.0  # one engine's pause / continue


class EngineYield:
    """Around each train step: freezes the rollout engines (`enabled`: the cores are time-shared), or takes
    back the cores lent to them (`lend` = (threads while the trainer computes, threads while it waits))."""

    def __init__(
        self,
        engine_urls: Callable[[], list[str]],
        admin_token: str,
        enabled: bool,
        lend: tuple[int, int] | None = None,
    ):
        if enabled and lend:
            raise ValueError("EngineYield: freeze the engines or lend them cores, not both")
        self.engine_urls, self.token, self.enabled, self.lend = engine_urls, admin_token, enabled, lend
        self.yields = 0  # train steps the engines were frozen for, or gave lent cores back for
        self._clients: dict[str, EngineClient] = {}

    def _client(self, url: str) -> EngineClient:
        if url not in self._clients:
            self._clients[url] = EngineClient(url, admin_token=self.token, timeout_s=CONTROL_TIMEOUT_S)
        return self._clients[url]

    async def _each(self, call: Callable[[EngineClient], Awaitable[object]]) -> None:
        await asyncio.gather(*(call(self._client(u)) for u in self.engine_urls()), return_exceptions=True)

    async def start(self) -> None:
        """Lent cores: the engines take every core until the first train step."""
        if self.lend:
            await self._each(lambda c: c.set_threads(self.lend[1]))

    @contextlib.asynccontextmanager
    async def trainer_computing(self) -> AsyncIterator[None]:
        if not (self.enabled or self.lend):
            yield
            return
        if self.lend:
            busy, idle = self.lend
            await self._each(lambda c: c.set_threads(busy))
        else:
            await self._each(lambda c: c.pause("in_place"))
        self.yields += 1
        try:
            yield
        finally:
            await self._each(lambda c: c.set_threads(idle) if self.lend else c.resume())

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
