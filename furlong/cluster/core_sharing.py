"""Cores shared between trainer and engines in async runs, switched around each train step (`EngineYield`).

Three ways, all off by default:

- **frozen engines** (`cluster.share_cores`): the engines freeze in place while the trainer computes, and
  go on right after;
- **lent cores** (`cluster.lend_idle_cores`): the cores stay split, but while the trainer waits for a
  batch the engines compute with every core (`/set_threads`), and drop back to their share while it
  computes;
- **borrowed cores** (`cluster.borrow_idle_cores`): the cores stay split, but once the engines have
  nothing left to generate before the train step ends (the buffer full of ended episodes), the
  trainer computes with every core from its next micro-batch (or the next node of its backward pass) to
  the end of the step (`TrainerActor.borrow_cores`, furlong/train/threads.py).

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

Borrowed cores, why: where the trainer bounds an async step, split cores cost it half its speed for
the whole step, though the engines finish the next batch well before it ends and then idle. Frozen
engines give the trainer every core but generate nothing while it computes. Borrowing is the
asymmetric schedule between them: the engine generates on its share beside a one-thread trainer
until the next batch is done, then the trainer takes the cores for the rest of its step. The engines
never compute beside a trainer on borrowed threads: the driver lends the cores only when nothing is
left to generate, and nothing new is generated until the step ends (a new window starts only when
the trainer takes its next batch). It combines with lent cores (the engines on every core while the
trainer waits).

Best effort: an engine that fails the pause, the continue or a thread change (dead, being replaced,
an SGLang engine without `/set_threads`) is the supervisor's health checks' to find; the train step
goes on either way, and a restarted engine takes every core again after the next train step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from furlong.core import spans
from furlong.core.client import EngineClient

CONTROL_TIMEOUT_S = 60.0  # one engine's pause / continue
IDLE_POLL_S = 0.02  # how often the driver looks whether the engines have run out of work during a train step


class EngineYield:
    """Around each train step: freezes the rollout engines (`enabled`: the cores are time-shared), or takes
    back the cores lent to them (`lend` = (threads while the trainer computes, threads while it waits)),
    and/or lends the trainer the engines' cores once they are idle (`borrow` = (the trainer's threads then,
    the call that lends every rank that many, 0 taking them back))."""

    def __init__(
        self,
        engine_urls: Callable[[], list[str]],
        admin_token: str,
        enabled: bool,
        lend: tuple[int, int] | None = None,
        borrow: tuple[int, Callable[[int], Awaitable[None]]] | None = None,
    ):
        if enabled and (lend or borrow):
            raise ValueError("EngineYield: freeze the engines or split the cores (lend, borrow), not both")
        self.engine_urls, self.token, self.enabled = engine_urls, admin_token, enabled
        self.lend, self.borrow = lend, borrow
        self.yields = 0  # train steps the engines were frozen for, or gave lent cores back for
        self.borrows = 0  # train steps the trainer computed part of on the engines' idle cores
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
    async def trainer_computing(self, engines_idle: Callable[[], bool] | None = None) -> AsyncIterator[None]:
        """Around one train step. `engines_idle`: true once nothing is left to generate until the step ends
        (with `borrow`, the trainer then takes the engines' cores)."""
        async with self._engines_around_step():
            lender = _Lender(self, engines_idle) if self.borrow and engines_idle is not None else None
            try:
                yield
            finally:
                if lender is not None:
                    await lender.close()

    @contextlib.asynccontextmanager
    async def _engines_around_step(self) -> AsyncIterator[None]:
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


class _Lender:
    """Watches one train step: once the engines are idle, lends their cores to the trainer (once)."""

    def __init__(self, owner: EngineYield, engines_idle: Callable[[], bool]) -> None:
        self.owner, self.engines_idle, self.sent, self.lent_at = owner, engines_idle, False, 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self.engines_idle():
            await asyncio.sleep(IDLE_POLL_S)
        threads, lend_to_trainer = self.owner.borrow
        self.sent, self.lent_at = True, time.time()
        await lend_to_trainer(threads)
        self.owner.borrows += 1

    async def close(self) -> None:
        """At the step's end: a lend not sent yet never will be; one sent is waited for, then taken back, so
        the trainer's next step (not sent before this returns) starts on its own share."""
        if not self.sent:
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # a dead rank: the train step reports it
            await self.task
            if self.sent:
                await self.owner.borrow[1](0)
                spans.record("driver", "cores-lent", self.lent_at, time.time(), threads=self.owner.borrow[0])
