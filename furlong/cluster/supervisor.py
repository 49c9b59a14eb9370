"""The engine supervisor: a dead or hung engine is replaced while the run goes on.

`EngineSupervisor` is an asyncio task in the driver. Every `router.health_interval_s`
each serving engine is probed twice over: its `ProcessActor.alive()` (did the process exit?)
and `GET /health` with a `router.health_timeout_s` timeout (is it answering? a SIGSTOPped
engine is alive but silent). An exited process is replaced at once; a silent one after
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

The router is watched the same way: when it exits or stops answering it is restarted
(same command: same port, same engines), and the engines not serving at that moment are
removed from the new router again. Router calls during its replacement wait for it.

No livelock: while no engine is serving (every one being replaced, pending, or given
up) or the router is down, prompts would fail and be drawn again forever. So the
supervisor times it: after `cluster.no_engine_timeout_s` of that (at once when nothing
can come back: every engine, or the router, given up), it records `EnginesLost`,
naming what died and its log file under RUN_DIR/logs, and `guard()` ends the work it
wraps (the driver's run) with that error; the driver adds the last checkpoint and the
`--resume` command (`furlong.driver.restarts`).

A dead trainer is not this module's: `TrainerDied` goes to `furlong.driver.restarts`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from furlong.cluster.trainer_group import TrainerDied
from furlong.core.client import EngineClient
from furlong.core.net import tls_context
from furlong.core.version import WeightVersion

if TYPE_CHECKING:
    from furlong.cluster.topology import Topology
    from furlong.config.schema import ClusterConfig, RouterConfig, WeightsConfig

T = TypeVar("T")

OK, RESTARTING, PENDING, FAILED = "ok", "restarting", "pending", "failed"
MAX_RESTART_ATTEMPTS = 3  # per fault: a restart that keeps failing leaves the engine out
SYNC_ATTEMPTS = 3  # a weight sync is retried while engines keep dying under it
CONTROL_TIMEOUT_S = 60.0  # pause / continue of one engine
EXIT_GRACE_S = 3.0  # a refused /health: how long to watch for the process exit before calling it unresponsive


class EnginesLost(RuntimeError):
    """No engine (or no router) can serve, and none came back in time: the run cannot go on."""


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
        cluster: ClusterConfig,
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
        self.transport = getattr(top, "transport", None) or weights.transport  # across nodes: what the placement allows
        self.push_opts = {"bucket_mb": weights.bucket_mb, "run_dir": str(run_dir), "verify": weights.verify}
        self.push_opts.update(getattr(top, "weight_opts", None) or {})  # e.g. broadcast's rendezvous address
        self.slots = [EngineSlot(i, u.rstrip("/"), a) for i, (u, a) in enumerate(zip(top.engine_urls, top.engines))]
        self.router = EngineSlot(-1, top.router_url.rstrip("/"), top.router) if top.router is not None else None
        self.router_faults: list[dict[str, Any]] = []  # one record per router fault
        self.no_engine_timeout = cluster.no_engine_timeout_s
        self.logs = Path(run_dir) / "logs"
        self.lost: EnginesLost | None = None  # set once nothing could serve for too long: the run stops
        self._lost_event = asyncio.Event()
        self._down_since: float | None = None
        self._clients: dict[str, EngineClient] = {}  # control calls (pause / continue), one client per engine
        self.counts: Counter[str] = Counter()
        self.faults: list[dict[str, Any]] = []  # one record per fault: engine, cause, seconds to recover
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._recoveries: set[asyncio.Task] = set()
        self._http = httpx.AsyncClient(timeout=self.timeout, verify=tls_context())

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
        out = {"engines": {s.url: s.state for s in self.slots}, **self.counts, "fault_log": list(self.faults)}
        if self.router is not None:
            out.update(router=self.router.state, router_fault_log=list(self.router_faults))
        return out

    async def guard(self, work: Awaitable[T]) -> T:
        """`work`'s result; it is cancelled and `EnginesLost` raised instead once nothing can serve (`lost`)."""
        task = asyncio.ensure_future(work)
        lost = asyncio.ensure_future(self._lost_event.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            lost.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert self.lost is not None
        raise self.lost

    def serving(self) -> bool:
        """Whether a request can be served now: the router up and at least one engine serving."""
        router_ok = self.router is None or self.router.state == OK
        return router_ok and (not self.slots or any(s.state == OK for s in self.slots))

    async def wait_serving(self) -> bool:
        """Until a request can be served again; True when it had to wait (an outage), False at once otherwise.

        The rollout manager calls it after a failed generate: a failure during an outage (every engine
        being replaced, the router restarting) is not the sample's, so it waits here instead of spending
        one of the sample's attempts and, once those are gone, dropping its prompt. While waiting,
        `guard()` still ends the run with `EnginesLost` after `cluster.no_engine_timeout_s`.
        """
        if self.serving():
            return False
        while not self.serving():
            if self.lost is not None:
                raise self.lost
            await asyncio.sleep(0.1)
        return True

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
            self.watch_serving()

    async def check(self, force: bool = False) -> list[EngineSlot]:
        """Probe every serving engine and the router once; replace the dead ones.

        With `force` (a sync failed), one failed probe is enough for an engine."""
        up = [s for s in self.slots if s.state in (OK, PENDING)]
        router = [self.router] if self.router is not None and self.router.state == OK else []
        problems = await asyncio.gather(*(self._probe(s) for s in up + router))
        dead = []
        for s, (exited, problem) in zip(up + router, problems):
            if problem is None:
                s.failed_probes = 0
                continue
            s.failed_probes += 1
            engine_force = force and s is not self.router
            if s.state in (OK, PENDING) and (exited or engine_force or s.failed_probes >= self.unhealthy_after):
                kind = "exited" if exited else "unresponsive"
                if s is self.router:
                    self._replace_router(s, problem, kind)
                else:
                    self._replace(s, problem, kind)
                    dead.append(s)
        return dead

    # ------------------------------------------------------------------ no livelock
    def _name(self, s: EngineSlot) -> str:
        return "router" if s is self.router else f"engine-{s.index}"

    def _down_report(self, down: list[EngineSlot]) -> str:
        """What is down, each with its state, the fault's cause and its log file: the message a stopped run prints."""
        return "; ".join(
            f"{self._name(s)} ({s.url}) "
            + (f"given up after {MAX_RESTART_ATTEMPTS} failed restarts" if s.state == FAILED else s.state)
            + (f", its fault: {s.fault['cause']}" if s.fault else "")
            + f", log {self.logs / (self._name(s) + '.log')}"
            for s in down
        )

    def watch_serving(self) -> None:
        """Record `lost` when nothing can serve: after `no_engine_timeout`, or at once when nothing can come back."""
        if self.lost is not None:
            return
        engines_down = bool(self.slots) and not any(s.state == OK for s in self.slots)
        router_down = self.router is not None and self.router.state != OK
        if not (engines_down or router_down):
            self._down_since = None
            return
        now = time.monotonic()
        self._down_since = self._down_since if self._down_since is not None else now
        hopeless = (bool(self.slots) and all(s.state == FAILED for s in self.slots)) or (
            self.router is not None and self.router.state == FAILED
        )
        if not hopeless and now - self._down_since < self.no_engine_timeout:
            return
        what = self._down_report([s for s in self.slots if s.state != OK] + ([self.router] if router_down else []))
        why = "none of them can come back" if hopeless else f"for {self.no_engine_timeout:g}s"
        self.lost = EnginesLost(
            f"no engine could serve ({why}; cluster.no_engine_timeout_s={self.no_engine_timeout:g}): {what}"
        )
        self.note(str(self.lost))
        self._lost_event.set()

    # ------------------------------------------------------------------ the router
    def _replace_router(self, s: EngineSlot, cause: str, kind: str) -> None:
        s.state = RESTARTING
        self.counts["router_faults"] += 1
        record = {"url": s.url, "kind": kind, "cause": cause, "failed_probes": s.failed_probes, "recovered": False}
        self.router_faults.append(record)
        s.fault, s.since = record, time.monotonic()
        self.note(f"router ({s.url}): {cause}; restarting it (same port, same engines)")
        task = asyncio.create_task(self._recover_router(s), name="restart-router")
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    async def _recover_router(self, s: EngineSlot) -> None:
        for attempt in range(1, MAX_RESTART_ATTEMPTS + 1):
            try:
                await s.actor.restart.remote()
                break
            except Exception as e:  # noqa: BLE001 - reported, then tried again
                self.counts["router_restart_failures"] += 1
                self.note(f"router: restart {attempt}/{MAX_RESTART_ATTEMPTS} failed: {e}")
                await asyncio.sleep(self.interval)
        else:
            s.state = FAILED
            self.note(f"router: gave up after {MAX_RESTART_ATTEMPTS} restarts")
            self.watch_serving()
            return
        s.state, s.failed_probes = OK, 0
        try:  # the new router starts with every engine: those not serving now must stay out
            for e in [e for e in self.slots if e.state != OK]:
                await self._router("/remove_engine", e.url)
        except Exception as e:  # noqa: BLE001 - reported; the engine's own replacement removes it again
            self.note(f"router: removing the engines being replaced failed: {type(e).__name__}: {e}")
        self.counts["router_restarts"] += 1
        if s.fault is not None:
            s.fault.update(recovered=True, seconds=round(time.monotonic() - s.since, 2))
        self.note(f"router ({s.url}) restarted and serving again")

    async def _probe(self, s: EngineSlot) -> tuple[bool, str | None]:
        """(process exited, problem or None)."""
        if not await self._alive(s):
            return True, "the process exited"
        try:
            r = await self._http.get(s.url + "/health")
        except httpx.TimeoutException:
            return False, f"/health timed out after {self.timeout:g}s"
        except httpx.HTTPError as e:  # refused or reset: most often a process in the middle of dying, which its
            # owner sees exit a moment later (later still under load: a SIGKILLed engine was once "unresponsive")
            deadline = time.monotonic() + EXIT_GRACE_S
            while (alive := await self._alive(s)) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return not alive, f"/health failed: {type(e).__name__}: {e}" if alive else "the process exited"
        # The router's /health is 503 while no engine is healthy: it answered, so it is serving (restarting
        # it would not bring an engine back; the engines' own replacement does).
        answering = (200, 503) if s is self.router else (200,)
        return False, None if r.status_code in answering else f"/health returned {r.status_code}"

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
        """A router call; while the router is down (being restarted), it is tried again until it is back."""
        deadline = time.monotonic() + self.no_engine_timeout
        while True:
            try:
                r = await self._http.post(
                    self.top.router_url + path,
                    json={"url": url},
                    headers={"Authorization": f"Bearer {self.token}"},
                    timeout=30.0,
                )
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or (self.router is not None and self.router.state == FAILED):
                    raise
                await asyncio.sleep(self.interval)
        if r.status_code not in (200, 404):  # 404: already removed
            raise RuntimeError(f"router {path} {url}: HTTP {r.status_code}: {r.text[:200]}")

    # ------------------------------------------------------------------ weight sync
    def _targets(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.state in (OK, PENDING)]

    async def _some_engine_up(self) -> None:
        while self.slots and not self._targets():  # all being replaced: the run waits for the first one back
            if self.lost is not None:
                raise self.lost
            if all(s.state == FAILED for s in self.slots):
                raise EnginesLost(
                    f"weight sync: no engine is left (every restart failed): {self._down_report(self.slots)}"
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

    async def sync_eval_engines(self) -> int:
        """Give the dedicated eval engines (`rollout.eval_mode=dedicated`) the trainer's weights as the current
        version; that version. The replaced-engine path (`resync_engine`), so weights no version names yet
        (the trainer mid-step) are never pushed: the driver calls it right after a weight sync. Eval engines
        are not behind the router nor health-checked: one that dies fails its eval, not the run's rollouts."""
        urls = getattr(self.top, "eval_engine_urls", [])
        if not urls:
            raise RuntimeError("rollout.eval_mode=dedicated: the topology started no eval engines")
        async with self._lock:
            version = self.version.current
            for url in urls:
                got = await self.trainers.resync_engine(
                    url, version, transport=self.transport, admin_token=self.token, opts=self.push_opts
                )
                if got is None:
                    raise RuntimeError(f"eval engine {url}: the trainer's weights are newer than v{version}")
            self.counts["eval_syncs"] += 1
            return version

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
