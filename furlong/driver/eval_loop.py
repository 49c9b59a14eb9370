"""`rollout.eval_mode`: when, and on which engines, held-out eval runs relative to training.

- `blocking` (the default): at an eval step the loop waits for the eval, as before.
- `async`: the eval starts in the background, on its own engine client (so a sync-mode
  hold of the rollout client does not stall it), through the training router, and training
  goes on. Its requests carry `priority=EVAL_PRIORITY` (below the rollouts' 0), so an engine
  admits them only when rollouts leave room (`furlong.engine.request.admission_order`: aging
  keeps them from waiting forever). Its metrics are logged with the first step that ends
  after it finished, tagged with the weight version it started on (`eval/weight_version`),
  the one current when it finished (`eval/weight_version_end`: a weight sync in between
  retracts and resumes its requests on the new weights, so the two can differ) and the step
  that asked (`eval/step`). At most one eval runs at a time: an eval step that finds one
  still running is skipped and counted (`eval/skipped_busy`). The run waits for a running
  eval before its final one.
- `dedicated`: the same background eval, on engines of its own (`engine.eval_num_engines`,
  launched with the topology, not behind the router, so rollouts never queue behind eval).
  At each eval step that finds no eval running, the trainer's weights are pushed to them
  first (`EngineSupervisor.sync_eval_engines`), so an eval sees exactly one version:
  `eval/weight_version` = `eval/weight_version_end`. The before- and after-RL evals run
  there too, so the training engines serve rollouts only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("furlong.driver")
EVAL_PRIORITY = -1  # engine request priority of eval requests; rollouts send none (0)


class PriorityClient:
    """Engine clients whose `/generate` requests carry `priority`, taken in turn (dedicated eval engines are not
    behind a router); everything else is the first client's.

    Why a wrapper: the rollout generate functions call `ctx.client.generate(ids, params)`; the eval passes
    this client in the context, so every generate function (built-in or a plug point) sends eval priority."""

    def __init__(self, clients: list[Any], priority: int = EVAL_PRIORITY) -> None:
        self.clients, self.priority, self._turn = list(clients), priority, 0

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *args: Any, **extra: Any) -> Any:
        client = self.clients[self._turn % len(self.clients)]
        self._turn += 1
        return await client.generate(input_ids, sampling_params, *args, priority=self.priority, **extra)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.clients[0], name)


class BackgroundEval:
    def __init__(
        self, manager: Any, client: Any, version: Any, sync: Callable[[], Awaitable[int]] | None = None
    ) -> None:
        """`sync`: for dedicated eval engines, pushes the current weights to them and returns their version."""
        self.manager, self.client, self.version, self.sync = manager, client, version, sync
        self.task: asyncio.Task | None = None
        self.skipped = 0
        self.sync_failures = 0  # dedicated: eval steps skipped because the weight push failed

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, step: int, pinned: int | None = None) -> None:
        """Begin the eval of `step` unless one is still running (then count the skip). `pinned`: the version
        its engines hold for the whole eval (dedicated engines take no sync meanwhile)."""
        if self.busy:
            self.skipped += 1
            return
        self.task = asyncio.create_task(self._run(step, pinned))

    async def start_synced(self, step: int) -> None:
        """Dedicated engines: push the weights to them (only when no eval runs there), then `start`."""
        if self.busy or self.sync is None:
            self.start(step)  # skipped and counted while busy
            return
        try:
            pinned = await self.sync()
        except Exception as e:  # noqa: BLE001 - an eval engine that cannot take weights skips evals, not the run
            self.sync_failures += 1
            log.warning(
                "eval of step %d skipped: its engines could not take the weights: %s: %s", step, type(e).__name__, e
            )
            return
        self.start(step, pinned=pinned)

    async def _run(self, step: int, pinned: int | None) -> dict[str, float]:
        started = self.version.current if pinned is None else pinned
        metrics = await self.manager.evaluate(step, client=self.client)
        return {
            **metrics,
            "eval/step": float(step),
            "eval/weight_version": float(started),
            "eval/weight_version_end": float(self.version.current if pinned is None else pinned),
        }

    async def now(self, step: int) -> dict[str, float]:
        """A blocking eval on this eval's engines (the before- and after-RL evals of a dedicated run)."""
        if self.busy:
            await asyncio.wait([self.task])
        pinned = await self.sync() if self.sync is not None else None
        return await self.manager.evaluate(step, client=self.client) | (
            {"eval/weight_version": float(pinned)} if pinned is not None else {}
        )

    def collect(self) -> dict[str, float]:
        """The finished eval's metrics (once), or {} while none has finished."""
        if self.task is None or not self.task.done():
            return {}
        task, self.task = self.task, None
        extra = {"eval/sync_failures": float(self.sync_failures)} if self.sync is not None else {}
        return {**task.result(), "eval/skipped_busy": float(self.skipped), **extra}

    async def drain(self) -> dict[str, float]:
        """Wait for a running eval and return its metrics (the run's end)."""
        if self.task is not None:
            await asyncio.wait([self.task])
        return self.collect()

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.client.aclose()
