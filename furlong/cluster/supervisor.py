"""The supervisor: a dead or hung engine is replaced while the run goes on; a dead trainer stops cleanly.

Engines (`EngineSupervisor`, an asyncio task in the driver). Every
`router.health_interval_s` each serving engine is probed twice over: its
`ProcessActor.alive()` (did the process exit?) and `GET /health` with a
`router.health_timeout_s` timeout (is it answering? a SIGSTOPped engine is alive
but silent). An exited process is replaced at once; a silent one after
`router.unhealthy_after` failed probes in a row. Replacing is:

    POST router /remove_engine        the router must not re-admit it on health alone
    ProcessActor.restart()            SIGTERM, then SIGKILL; same command, same port
    trainer.resync_engine(url)        the trainer's current weights, at their version
    POST router /add_engine           serving again, only now

Why the re-sync asks the trainer for *its* version instead of pushing the driver's:
between `train_rollout` and the next weight sync the trainer holds weights that no
version names yet. Ray runs one trainer call at a time, in order, so the trainer
itself knows whether its weights are exactly those of the last sync; if they are
not, it declines, and the engine joins the next weight sync instead (state
`pending`), which every engine that is up takes part in. Either way an engine
serves only weights whose version it stamps.

Requests in flight on the dead engine fail at the transport; the router retries
them on another engine, and the rollout manager regenerates a sample whose
retries ran out (its accounting counts each prompt exactly once either way).

Weight syncs go through `sync_weights`: pause, push to every engine that is up,
continue (control calls go to each engine directly, so a failure names its
engine) — and if an engine dies in the middle, it is found, handed to
replacement, and the sync is done again without it. A lock keeps a sync and a
re-sync from interleaving.

Trainer (`run_with_restarts`). A trainer rank that dies surfaces as `TrainerDied`
from the topology's calls. Without `cluster.auto_restart` the run stops with
`RunStopped`, naming the last complete checkpoint and the `--resume` command. With
it, the whole topology is brought down and the run resumes from that checkpoint,
at most `MAX_TRAINER_RESTARTS` times: the checkpoint holds the trainer's and the
driver's full state, so the resumed run trains exactly what the uninterrupted one
would have (tested: final weights are equal).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

OK, RESTARTING, PENDING, FAILED = "ok", "restarting", "pending", "failed"
MAX_RESTART_ATTEMPTS = 3  # per fault: a restart that keeps failing leaves the engine out
MAX_TRAINER_RESTARTS = 3  # cluster.auto_restart: bounded, so a crash loop ends
SYNC_ATTEMPTS = 3  # a weight sync is retried while engines keep dying under it


class TrainerDied(RuntimeError):
    """A trainer rank's process died (Ray reports the actor dead)."""


class RunStopped(RuntimeError):
    """The run cannot go on; the message says why and how to continue."""


@dataclass
class EngineSlot:
    index: int
    url: str
    actor: Any  # the ProcessActor that owns the engine process
    state: str = OK
    failed_probes: int = 0
    fault: dict[str, Any] | None = None  # the record of the fault being repaired
    since: float = 0.0  # when it was found


class EngineSupervisor:
    """Health checks, replacement and weight syncs for the engines of one run (see the module docstring)."""

    def __init__(self, top: Any, cfg: Any, admin_token: str, run_dir: Any, note: Callable[[str], None] = print):
        self.top, self.cfg, self.token, self.note = top, cfg, admin_token, note
        r, w = cfg.router, cfg.weights
        self.interval, self.timeout, self.unhealthy_after = r.health_interval_s, r.health_timeout_s, r.unhealthy_after
        self.push_args = (w.transport, {"bucket_mb": w.bucket_mb, "run_dir": str(run_dir), "verify": w.verify})
        self.slots = [EngineSlot(i, u.rstrip("/"), a) for i, (u, a) in enumerate(zip(top.engine_urls, top.engines))]
        self.version = 0
        self.counts: Counter[str] = Counter()
        self.faults: list[dict[str, Any]] = []  # one record per fault: engine, cause, seconds to recover
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._recoveries: set[asyncio.Task] = set()
        self._http = httpx.AsyncClient(timeout=self.timeout)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start health checking (nothing to watch when the engine is colocated in the trainer)."""
        if self.slots and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="engine-supervisor")

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._recoveries] if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        await self._http.aclose()

    def stats(self) -> dict[str, Any]:
        return {"engines": {s.url: s.state for s in self.slots}, **self.counts, "fault_log": list(self.faults)}

    async def wait_all_serving(self, timeout_s: float = 300.0) -> None:
        """Until every engine is serving again (tests and tools; the run itself never waits for this)."""
        deadline = time.monotonic() + timeout_s
        while any(s.state != OK for s in self.slots):
            if time.monotonic() > deadline or any(s.state == FAILED for s in self.slots):
                raise RuntimeError(f"engines not serving: {self.stats()['engines']}")
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------ health
    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception as e:  # noqa: BLE001 - a failed round must never end supervision
                self.note(f"supervisor: health round failed: {type(e).__name__}: {e}")

    async def check(self, force: bool = False) -> list[EngineSlot]:
        """Probe every serving engine once; replace the dead ones (with `force`, one failed probe is enough)."""
        up = [s for s in self.slots if s.state in (OK, PENDING)]
        problems = await asyncio.gather(*(self._probe(s) for s in up))
        dead = []
        for s, (exited, problem) in zip(up, problems):
            if problem is None:
                s.failed_probes = 0
                continue
            s.failed_probes += 1
            if s.state in (OK, PENDING) and (exited or force or s.failed_probes >= self.unhealthy_after):
                self._replace(s, problem, "exited" if exited else "unresponsive")
                dead.append(s)
        return dead

    async def _probe(self, s: EngineSlot) -> tuple[bool, str | None]:
        """(process exited, problem or None)."""
        if not await self._alive(s):
            return True, "the process exited"
        try:
            r = await self._http.get(s.url + "/health")
        except httpx.TimeoutException:
            return False, f"/health timed out after {self.timeout:g}s"
        except httpx.HTTPError as e:  # refused or reset: often a process in the middle of dying
            exited = not await self._alive(s)
            return exited, "the process exited" if exited else f"/health failed: {type(e).__name__}: {e}"
        return False, None if r.status_code == 200 else f"/health returned {r.status_code}"

    async def _alive(self, s: EngineSlot) -> bool:
        try:
            return await asyncio.wait_for(s.actor.alive.remote(), self.timeout)
        except asyncio.TimeoutError:
            return True  # the owning actor is busy; let /health decide
        except Exception:  # noqa: BLE001 - the owning actor itself is gone, and its process with it
            return False

    # ------------------------------------------------------------------ replacement
    def _replace(self, s: EngineSlot, cause: str, kind: str) -> None:
        s.state = RESTARTING
        self.counts["faults"] += 1
        self.counts[f"faults_{kind}"] += 1
        record = {"engine": s.index, "url": s.url, "kind": kind, "cause": cause, "failed_probes": s.failed_probes,
                  "recovered": False}
        self.faults.append(record)
        s.fault, s.since = record, time.monotonic()
        self.note(f"engine-{s.index} ({s.url}): {cause}; replacing it while the run continues on the others")
        task = asyncio.create_task(self._recover(s), name=f"replace-engine-{s.index}")
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    async def _recover(self, s: EngineSlot) -> None:
        try:
            await self._router("/remove_engine", s.url)
            for attempt in range(1, MAX_RESTART_ATTEMPTS + 1):
                try:
                    await s.actor.restart.remote()
                    break
                except Exception as e:  # noqa: BLE001 - reported, then tried again
                    self.counts["restart_failures"] += 1
                    self.note(f"engine-{s.index}: restart {attempt}/{MAX_RESTART_ATTEMPTS} failed: {e}")
                    await asyncio.sleep(self.interval)
            else:
                s.state = FAILED
                self.note(f"engine-{s.index}: gave up after {MAX_RESTART_ATTEMPTS} restarts; the run goes on without it")
                return
            s.state = PENDING
            async with self._lock:
                if s.state != PENDING:  # a weight sync took it in meanwhile
                    return
                transport, opts = self.push_args
                version = await self.top.acall("resync_engine", transport, s.url, self.token, opts)
                if version is None:
                    self.counts["resyncs_deferred"] += 1  # the trainer is mid-step: the next sync takes it in
                    return
                self.counts["resyncs"] += 1
                await self._admit(s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a dead trainer is the driver's to report
            self.note(f"engine-{s.index}: replacement failed: {type(e).__name__}: {e}")

    async def _admit(self, s: EngineSlot) -> None:
        await self._router("/add_engine", s.url)
        s.state, s.failed_probes = OK, 0
        self.counts["replacements"] += 1
        if s.fault is not None:
            s.fault.update(recovered=True, seconds=round(time.monotonic() - s.since, 2))
        self.note(f"engine-{s.index} ({s.url}) replaced, re-synced to v{self.version} and serving again")

    async def _router(self, path: str, url: str) -> None:
        r = await self._http.post(self.top.router_url + path, json={"url": url},
                                  headers={"Authorization": f"Bearer {self.token}"}, timeout=30.0)
        if r.status_code not in (200, 404):  # 404: already removed
            raise RuntimeError(f"router {path} {url}: HTTP {r.status_code}: {r.text[:200]}")

    # ------------------------------------------------------------------ weight sync
    def _targets(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.state in (OK, PENDING)]

    async def _some_engine_up(self) -> None:
        while self.slots and not self._targets():  # all being replaced: the run waits for the first one back
            if all(s.state == FAILED for s in self.slots):
                raise RunStopped("weight sync: no engine is left (every restart failed); see RUN_DIR/logs/engine-*.log")
            await asyncio.sleep(0.1)

    async def _control(self, urls: list[str], path: str, body: dict[str, Any]) -> None:
        """A control call to each engine directly (not through the router): a failure names its engine."""
        auth = {"Authorization": f"Bearer {self.token}"}
        out = await asyncio.gather(*(self._http.post(u + path, json=body, headers=auth, timeout=60.0) for u in urls),
                                   return_exceptions=True)
        bad = [f"{u}: {r}" if isinstance(r, BaseException) else f"{u}: HTTP {r.status_code}"
               for u, r in zip(urls, out) if isinstance(r, BaseException) or r.status_code != 200]
        if bad:
            raise RuntimeError(f"{path} failed on {'; '.join(bad)}")

    async def sync_weights(self, version: int) -> dict[str, Any]:
        """Pause, push `version` to every engine that is up, continue; an engine dying mid-sync is replaced."""
        transport, opts = self.push_args
        last: Exception | None = None
        for _ in range(SYNC_ATTEMPTS):
            await self._some_engine_up()
            async with self._lock:
                targets = self._targets()
                urls = [s.url for s in targets] if self.slots else list(self.top.engine_urls)
                try:
                    if not urls:
                        raise RuntimeError("every engine went down just before the sync")
                    await self._control(urls, "/pause_generation", {"mode": self.cfg.engine.pause_mode})
                    try:
                        report = await self.top.acall("push_weights", transport, urls, self.token, version, opts)
                    finally:
                        await self._control(urls, "/continue_generation", {})
                except TrainerDied:
                    raise
                except Exception as e:  # noqa: BLE001 - an engine failing under the sync, or a real error
                    last = e
                    await self.check(force=True)
                    if urls and not any(s.state == RESTARTING for s in targets):
                        raise  # no engine died: not ours to hide
                    self.counts["syncs_retried"] += 1
                    continue
                self.version = version
                for s in targets:
                    if s.state == PENDING:  # restarted while the trainer was mid-step: it has the weights now
                        await self._admit(s)
                return report
        assert last is not None
        raise last


def check_finite(per_opt: list[dict[str, float]], limit: int, step: int, note: Callable[[str], None]) -> None:
    """Warn about skipped non-finite optimiser steps; stop the run after `limit` in a row."""
    skipped = sum(int(m.get("nonfinite/skipped", 0)) for m in per_opt)
    streak = int(per_opt[-1].get("nonfinite/streak", 0)) if per_opt else 0
    if skipped:
        note(f"warning: RL step {step}: loss or gradient was NaN/inf in {skipped} optimiser step(s); "
             f"skipped them (weights unchanged), {streak} in a row")
    if streak >= limit:
        raise RunStopped(f"the loss was NaN/inf in {streak} optimiser steps in a row (train.max_nonfinite_steps="
                         f"{limit}), at RL step {step}; the weights are those of the last finite step. Check the "
                         "rewards, the learning rate and any loss or before_train_step plug point")


async def run_with_restarts(run: Any) -> dict[str, Any]:
    """`run.run()`; a dead trainer stops it cleanly, or with `cluster.auto_restart` resumes it from its checkpoint."""
    from furlong.train.run import latest_checkpoint

    restarts = 0
    while True:
        try:
            result = await run.run()
            result["trainer_restarts"] = restarts
            return result
        except TrainerDied as e:
            ckpt = latest_checkpoint(run.run_dir)
            where = f"the last complete checkpoint is {ckpt}" if ckpt else "no checkpoint was complete yet"
            if not run.cfg.cluster.auto_restart:
                raise RunStopped(f"{e}; the run stopped: {where}. Continue it with "
                                 f"`furlong train --resume {run.run_dir}` (or set cluster.auto_restart=true)") from e
            if restarts >= MAX_TRAINER_RESTARTS:
                raise RunStopped(f"{e}; gave up after {restarts} automatic restarts: {where}") from e
            restarts += 1
            print(f"furlong {e}; restarting the trainer group from {ckpt or 'step 0'} "
                         f"(automatic restart {restarts}/{MAX_TRAINER_RESTARTS})", file=sys.stderr)
            run = type(run)(run.cfg, resume=True, progress=run.progress)
