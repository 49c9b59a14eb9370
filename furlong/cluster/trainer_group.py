"""TrainerGroup: the N FSDP2 ranks of a run, as one typed trainer.

Every rank gets every call (they are collectives: FSDP all-gathers, all-reduces and
the weight push need all ranks), and rank 0's answer is the group's. Methods the
driver awaits while other work runs (the rollout manager generating, the supervisor
probing) are async; the others block, and the driver runs them in a thread.

A rank whose process died surfaces as `TrainerDied`, naming the call, whichever
method hit it: the driver's restart policy (`furlong.driver.restarts`) decides
whether the run stops at its last checkpoint or resumes from it.

Ray runs one call of an actor at a time, in the order sent, so a rank's calls
never interleave: `resync_engine` sent between two steps sees exactly the weights
the last call left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import ray


class TrainerDied(RuntimeError):
    """A trainer rank's process died (Ray reports the actor dead)."""


def trainer_died(method: str, e: BaseException) -> TrainerDied:
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return TrainerDied(f"a trainer rank died during {method}() ({why})")


class TrainerGroup:
    """Typed calls to every `TrainerActor` rank (see the module docstring); rank 0's answer is returned."""

    def __init__(self, actors: list[Any]):
        self.actors = list(actors)

    def __len__(self) -> int:
        return len(self.actors)

    # ---- plumbing: one call on every rank, dead ranks as TrainerDied
    def _get(self, method: str, send: Callable[[Any], Any]) -> Any:
        refs = [send(a) for a in self.actors]
        try:
            return ray.get(refs)[0]
        except ray.exceptions.RayActorError as e:
            raise trainer_died(method, e) from e

    async def _await(self, method: str, send: Callable[[Any], Any]) -> Any:
        refs = [send(a) for a in self.actors]
        try:
            return (await asyncio.gather(*refs))[0]
        except ray.exceptions.RayActorError as e:
            raise trainer_died(method, e) from e

    # ---- set-up
    def build_refs(self, model_dir: str, train_cfg: Any, algo_cfg: Any, temperature: float, hooks: Any) -> list[Any]:
        """Start building the trainer on every rank; `wait_built` collects (engines start meanwhile)."""
        return [a.build.remote(model_dir, train_cfg, algo_cfg, temperature, hooks) for a in self.actors]

    def wait_built(self, refs: list[Any]) -> list[int]:
        """The ranks' process ids, once built (a failure here fails the start, it is not a trainer death)."""
        return ray.get(refs)

    # ---- training
    async def train_rollout(self, samples: list[Any]) -> dict[str, Any]:
        """Optimiser steps on one rollout batch: {"metrics": [per optimiser step], "span": (t0, t1), provenance}."""
        return await self._await("train_rollout", lambda a: a.train_rollout.remote(samples))

    async def borrow_cores(self, threads: int) -> None:
        """Every rank computes on `threads` from its next micro-batch on; 0 gives them back."""
        await self._await("borrow_cores", lambda a: a.borrow_cores.remote(threads))

    async def spans(self, since: list[int]) -> list[dict[str, Any]]:
        """Every rank's timeline spans after its cursor (`TrainerActor.spans`), in rank order."""
        refs = [a.spans.remote(c) for a, c in zip(self.actors, since)]
        try:
            return list(await asyncio.gather(*refs))
        except ray.exceptions.RayActorError as e:
            raise trainer_died("spans", e) from e

    async def sft_step(self, samples: list[Any]) -> dict[str, float]:
        return await self._await("sft_step", lambda a: a.sft_step.remote(samples))

    async def compute_logprobs(self, samples: list[Any]) -> list[list[float]]:
        return await self._await("compute_logprobs", lambda a: a.compute_logprobs.remote(samples))

    # ---- checkpoints (blocking: the driver runs them in a thread)
    def save(self, path: str) -> str:
        return self._get("save", lambda a: a.save.remote(path))

    def load(self, path: str) -> int:
        """Restore every rank from `path`; returns the trainer's optimiser step."""
        return self._get("load", lambda a: a.load.remote(path))

    # ---- weights
    async def push_weights(
        self, urls: list[str], version: int, *, transport: str, admin_token: str, opts: dict[str, Any]
    ) -> dict[str, Any]:
        """Send the weights to the engines at `urls`, stamped `version`; the sender's report."""
        return await self._await(
            "push_weights", lambda a: a.push_weights.remote(transport, urls, admin_token, version, opts)
        )

    async def resync_engine(
        self, url: str, version: int, *, transport: str, admin_token: str, opts: dict[str, Any]
    ) -> int | None:
        """Give one replaced engine the weights as `version`; None when they changed since the last push."""
        return await self._await(
            "resync_engine", lambda a: a.resync_engine.remote(transport, url, admin_token, version, opts)
        )

    def weight_checksums(self) -> dict[str, int]:
        return self._get("weight_checksums", lambda a: a.weight_checksums.remote())

    def pids(self) -> list[int]:
        try:
            return ray.get([a.pid.remote() for a in self.actors])
        except ray.exceptions.RayActorError as e:
            raise trainer_died("pid", e) from e

    # ---- teardown
    def shutdown(self, timeout_s: float = 20.0) -> None:
        """Close senders and colocated engines on every rank still alive (best effort), then kill the actors."""
        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - a dead rank has nothing left to close
                pass
        for a in self.actors:
            ray.kill(a)
