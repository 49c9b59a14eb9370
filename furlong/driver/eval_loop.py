"""`rollout.eval_mode`: when held-out eval runs relative to training.

- `blocking` (the default): at an eval step the loop waits for the eval, as before.
- `async`: the eval starts in the background, on its own engine client (so a sync-mode
  hold of the rollout client does not stall it), and training goes on; its metrics are
  logged with the first step that ends after it finished, tagged with the weight version
  it started on (`eval/weight_version`), the one current when it finished
  (`eval/weight_version_end`: a weight sync in between retracts and resumes its requests
  on the new weights, so the two can differ) and the step that asked (`eval/step`). At
  most one eval runs at a time: an eval step that finds one still running is skipped
  and counted (`eval/skipped_busy`). The run waits for a running eval before its final one.
- `dedicated` (its own engines, synced at each eval step) is refused at start: not built.
"""

from __future__ import annotations

import asyncio
from typing import Any


class BackgroundEval:
    def __init__(self, manager: Any, client: Any, version: Any) -> None:
        self.manager, self.client, self.version = manager, client, version
        self.task: asyncio.Task | None = None
        self.skipped = 0

    def start(self, step: int) -> None:
        """Begin the eval of `step` unless one is still running (then count the skip)."""
        if self.task is not None and not self.task.done():
            self.skipped += 1
            return
        self.task = asyncio.create_task(self._run(step))

    async def _run(self, step: int) -> dict[str, float]:
        started = self.version.current
        metrics = await self.manager.evaluate(step, client=self.client)
        return {
            **metrics,
            "eval/step": float(step),
            "eval/weight_version": float(started),
            "eval/weight_version_end": float(self.version.current),
        }

    def collect(self) -> dict[str, float]:
        """The finished eval's metrics (once), or {} while none has finished."""
        if self.task is None or not self.task.done():
            return {}
        task, self.task = self.task, None
        return {**task.result(), "eval/skipped_busy": float(self.skipped)}

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
