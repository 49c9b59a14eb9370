"""The engine supervisor: a dead or hung engine is replaced while the run goes on.

`EngineSupervisor` is an asyncio task in the driver. Every
`router.health_interval_s` each serving engine is probed twice over: its
`ProcessActor.alive()` (did the process exit?) and `GET /health` with a
`router.health_timeout_s` timeout (is it answering? a SIGSTOPped engine is alive
but silent). An exited process is replaced at once; a silent one after
`router.unhealthy_after` failed probes in a row. Replacing is:

    POST router /remove_engine        the router must not re-admit it on health alone
    ProcessActor.restart()            SIGTERM, then SIGKILL; same command, same port
    trainers.resync_engine(url, v)    the trainer's weights, as the run's current version v
    POST router /add_engine           serving again, only now

Why the trainer may decline the re-sync: the version comes from the run's one
`WeightVersion` owner, but between `train_rollout` and the next weight sync the
trainer holds weights that no version names yet. Ray runs one trainer call at a
time, in order, so the trainer itself knows whether its weights changed since its
last push; if they did, it declines, and the engine joins the next weight sync
instead (state `pending`), which every engine that is up takes part in. Either way
an engine serves only weights whose version it stamps.

Requests in flight on the dead engine fail at the transport; the router retries
them on another engine, and the rollout manager regenerates a sample whose
retries ran out (its accounting counts each prompt exactly once either way).

Weight syncs go through `sync_weights`: pause, push to every engine that is up,
continue (control calls go to each engine directly, through `EngineClient`, so a
failure names its engine) — and if an engine dies in the middle, it is found,
handed to replacement, and the sync is done again without it. The moment the
trainer's push succeeds, the sync advances the run's `WeightVersion` (under the
lock, so a re-sync never stamps new weights with the old version). A lock keeps a
sync and a re-sync from interleaving.

A dead trainer is not this module's: `TrainerDied` passes through to the driver's
restart policy (`furlong.driver.restarts`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from furlong.cluster.trainer_group import TrainerDied
from furlong.core.client import EngineClient
from furlong.core.version import WeightVersion

if TYPE_CHECKING:
    from furlong.cluster.topology import Topology
    from furlong.config.schema import RouterConfig, WeightsConfig

OK, RESTARTING, PENDING, FAILED = "ok", "restarting", "pending", "failed"
MAX_RESTART_ATTEMPTS = 3  # per fault: a restart that keeps failing leaves the engine out
SYNC_ATTEMPTS = 3  # a weight sync is retried while engines keep dying under it
CONTROL_TIMEOUT_S = 60.0  # pause / continue of one engine


class EnginesLost(RuntimeError):
    """Every engine is gone and none could be restarted: the run cannot go on."""


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

    def __init__(
        self,
        top: Topology,
        *,
        router: RouterConfig,
        weights: WeightsConfig,
        pause_mode: str,
        admin_token: str,
        run_dir: Path,
        version: WeightVersion,
        note: Callable[[str], None] = print,
    ):
        """`version`: the run's weight-version owner; syncs advance it, re-syncs stamp engines with it."""
        self.top, self.trainers, self.token, self.note = top, top.trainers, admin_token, note
        self.pause_mode, self.version = pause_mode, version
        r = router
        self.interval, self.timeout, self.unhealthy_after = r.health_interval_s, r.health_timeout_s, r.unhealthy_after
        self.transport = weights.transport
        self.push_opts = {"bucket_mb": weights.bucket_mb, "run_dir": str(run_dir), "verify": weights.verify}
        self.slots = [EngineSlot(i, u.rstrip("/"), a) for i, (u, a) in enumerate(zip(top.engine_urls, top.engines))]
        self._clients: dict[str, EngineClient] = {}  # control calls (pause / continue), one client per engine
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
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

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
        except TimeoutError:
            return True  # the owning actor is busy; let /health decide
        except Exception:  # noqa: BLE001 - the owning actor itself is gone, and its process with it
            return False

    # ------------------------------------------------------------------ replacement
    def _replace(self, s: EngineSlot, cause: str, kind: str) -> None:
        s.state = RESTARTING
        self.counts["faults"] += 1
        self.counts[f"faults_{kind}"] += 1
        record = {
            "engine": s.index,
            "url": s.url,
            "kind": kind,
            "cause": cause,
            "failed_probes": s.failed_probes,
            "recovered": False,
        }
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
                self.note(
                    f"engine-{s.index}: gave up after {MAX_RESTART_ATTEMPTS} restarts; the run goes on without it"
                )
                return
            s.state = PENDING
            async with self._lock:
                if s.state != PENDING:  # a weight sync took it in meanwhile
                    return
                version = await self.trainers.resync_engine(
                    s.url, self.version.current, transport=self.transport, admin_token=self.token, opts=self.push_opts
                )
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
        self.note(f"engine-{s.index} ({s.url}) replaced, re-synced to v{self.version.current} and serving again")

    async def _router(self, path: str, url: str) -> None:
        r = await self._http.post(
            self.top.router_url + path,
            json={"url": url},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30.0,
        )
        if r.status_code not in (200, 404):  # 404: already removed
            raise RuntimeError(f"router {path} {url}: HTTP {r.status_code}: {r.text[:200]}")

    # ------------------------------------------------------------------ weight sync
    def _targets(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.state in (OK, PENDING)]

    async def _some_engine_up(self) -> None:
        while self.slots and not self._targets():  # all being replaced: the run waits for the first one back
            if all(s.state == FAILED for s in self.slots):
                raise EnginesLost(
                    "weight sync: no engine is left (every restart failed); see RUN_DIR/logs/engine-*.log"
                )
            await asyncio.sleep(0.1)

    def _client(self, url: str) -> EngineClient:
        if url not in self._clients:
            self._clients[url] = EngineClient(url, admin_token=self.token, timeout_s=CONTROL_TIMEOUT_S)
        return self._clients[url]

    async def _control(self, urls: list[str], what: str, call: Callable[[EngineClient], Any]) -> None:
        """A control call to each engine directly (not through the router): a failure names its engine."""
        out = await asyncio.gather(*(call(self._client(u)) for u in urls), return_exceptions=True)
        bad = [f"{u}: {r}" for u, r in zip(urls, out) if isinstance(r, BaseException)]
        if bad:
            raise RuntimeError(f"{what} failed on {'; '.join(bad)}")

    async def sync_weights(self, version: int) -> dict[str, Any]:
        """Pause, push `version` to every engine that is up, continue; an engine dying mid-sync is replaced.

        The run's `WeightVersion` advances to `version` as soon as the trainer's push succeeded."""
        last: Exception | None = None
        for _ in range(SYNC_ATTEMPTS):
            await self._some_engine_up()
            async with self._lock:
                targets = self._targets()
                urls = [s.url for s in targets] if self.slots else list(self.top.engine_urls)
                try:
                    if not urls:
                        raise RuntimeError("every engine went down just before the sync")
                    await self._control(urls, "pause", lambda c: c.pause(self.pause_mode))
                    try:
                        report = await self.trainers.push_weights(
                            urls, version, transport=self.transport, admin_token=self.token, opts=self.push_opts
                        )
                        self.version.advance(version)  # the trainer's weights are `version` now, on every target
                    finally:
                        await self._control(urls, "continue", lambda c: c.resume())
                except TrainerDied:
                    raise
                except Exception as e:  # noqa: BLE001 - an engine failing under the sync, or a real error
                    last = e
                    await self.check(force=True)
                    if urls and not any(s.state == RESTARTING for s in targets):
                        raise  # no engine died: not ours to hide
                    self.counts["syncs_retried"] += 1
                    continue
                for s in targets:
                    if s.state == PENDING:  # restarted while the trainer was mid-step: it has the weights now
                        await self._admit(s)
                return report
        assert last is not None
        raise last
