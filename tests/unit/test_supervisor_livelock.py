"""The supervisor's no-livelock rules, on real HTTP servers in threads standing in for engines and router.

Each stand-in serves `/health` (and, for the router, `/add_engine` / `/remove_engine`,
recording the calls) on 127.0.0.1; its "actor" answers `alive()` / `restart()` like a
`ProcessActor` does, restarting on the same port. No Ray, no model: what is tested is
the supervisor's logic — the router is restarted when it exits and the engines being
replaced are kept out of the new one; nothing able to serve for
`cluster.no_engine_timeout_s` (or nothing able to come back) ends the guarded work
with `EnginesLost`, naming what died and its log file.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from furlong.cluster.supervisor import FAILED, OK, EnginesLost, EngineSupervisor
from furlong.config.schema import ClusterConfig, RouterConfig, WeightsConfig
from furlong.core.app_thread import AppThread
from furlong.core.version import WeightVersion


class Remote:
    """`actor.method.remote(...)` as on a Ray actor handle: an awaitable of the call."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        async def call():
            return await asyncio.to_thread(self.fn, *args, **kwargs)

        return call()


class FakeProcess:
    """A server in a thread, owned like a ProcessActor owns its process: kill, alive, restart on the same port."""

    def __init__(self, calls: list | None = None, restart_fails: bool = False):
        self.calls = calls
        self.restart_fails = restart_fails
        self.restarts = 0
        self.server = self._serve(0)
        self.url = self.server.url
        self.alive = Remote(lambda: self.server is not None and self.server.alive())
        self.restart = Remote(self._restart)

    def _serve(self, port: int) -> AppThread:
        async def health(request: Request) -> JSONResponse:
            return JSONResponse({"ok": True})

        async def record(request: Request) -> JSONResponse:
            self.calls.append((request.url.path, (await request.json())["url"]))
            return JSONResponse({"ok": True})

        routes = [Route("/health", health)]
        if self.calls is not None:
            routes += [Route(p, record, methods=["POST"]) for p in ("/add_engine", "/remove_engine")]
        return AppThread(Starlette(routes=routes), port=port).start()

    def kill(self) -> None:
        self.server.stop()
        self.server = None

    def _restart(self) -> None:
        if self.restart_fails:
            raise RuntimeError("the process exited during start-up")
        if self.server is not None:
            self.server.stop()
        self.server = self._serve(int(self.url.rsplit(":", 1)[1]))
        self.restarts += 1

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class FakeTrainers:
    async def resync_engine(self, url, version, **kw):
        return version


def supervisor(tmp_path: Path, engines: list[FakeProcess], router: FakeProcess, timeout_s: float) -> EngineSupervisor:
    top = SimpleNamespace(
        trainers=FakeTrainers(),
        engines=engines,
        engine_urls=[e.url for e in engines],
        router=router,
        router_url=router.url,
    )
    return EngineSupervisor(
        top,
        router=RouterConfig(health_interval_s=0.05, health_timeout_s=2.0, unhealthy_after=2),
        weights=WeightsConfig(),
        cluster=ClusterConfig(no_engine_timeout_s=timeout_s),
        pause_mode="abort",
        admin_token="t",
        run_dir=tmp_path,
        version=WeightVersion(0),
        note=lambda text: None,
    )


async def until(predicate, what: str, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(60)
def test_a_dead_router_is_restarted_on_its_port_and_engines_being_replaced_stay_out(tmp_path):
    calls: list = []
    engines, router = [FakeProcess(), FakeProcess()], FakeProcess(calls)

    async def main():
        sup = supervisor(tmp_path, engines, router, timeout_s=60)
        sup.slots[1].state = "restarting"  # engine-1 is being replaced when the router dies
        sup.start()
        try:
            router.kill()
            await until(lambda: sup.counts["router_restarts"] == 1, "the router restart")
            assert router.restarts == 1 and router.server.url == router.url  # same port
            assert ("/remove_engine", engines[1].url) in calls and ("/remove_engine", engines[0].url) not in calls
            stats = sup.stats()
            assert stats["router"] == OK and stats["router_fault_log"][0]["kind"] == "exited"
            assert stats["router_fault_log"][0]["recovered"] and stats["fault_log"] == []  # engines: no fault
            assert sup.lost is None
            assert await sup.guard(asyncio.sleep(0, result="done")) == "done"
        finally:
            await sup.stop()

    try:
        asyncio.run(main())
    finally:
        for p in [*engines, router]:
            p.stop()


@pytest.mark.timeout(60)
def test_every_engine_given_up_stops_the_guarded_work_at_once_naming_them_and_their_logs(tmp_path):
    engines, router = [FakeProcess(restart_fails=True), FakeProcess(restart_fails=True)], FakeProcess([])

    async def main():
        sup = supervisor(tmp_path, engines, router, timeout_s=3600)  # "hopeless" must not wait for the timeout
        sup.start()
        flag = asyncio.Event()

        async def endless_prompts():  # what the run did before: draw prompts forever
            try:
                await asyncio.sleep(3600)
            finally:
                flag.set()

        try:
            for e in engines:
                e.kill()
            with pytest.raises(EnginesLost) as err:
                await sup.guard(endless_prompts())
            assert flag.is_set(), "the guarded work was not cancelled"
            assert all(s.state == FAILED for s in sup.slots)
            msg = str(err.value)
            for i, e in enumerate(engines):
                assert (
                    f"engine-{i} ({e.url}) given up after 3 failed restarts" in msg
                    and str(tmp_path / "logs" / f"engine-{i}.log") in msg
                )
            assert "none of them can come back" in msg and "the process exited" in msg
        finally:
            await sup.stop()

    try:
        asyncio.run(main())
    finally:
        for p in [*engines, router]:
            p.stop()


@pytest.mark.timeout(60)
def test_no_engine_serving_for_the_timeout_stops_the_run_a_shorter_outage_does_not(tmp_path):
    engines, router = [FakeProcess()], FakeProcess([])

    async def main():
        sup = supervisor(tmp_path, engines, router, timeout_s=0.5)
        sup.start()
        try:
            sup.slots[0].state = "pending"  # up, but waiting for a weight sync that never comes
            with pytest.raises(EnginesLost, match=r"no engine could serve \(for 0.5s; cluster.no_engine_timeout_s"):
                await sup.guard(asyncio.sleep(3600))
            assert "engine-0" in str(sup.lost) and "pending" in str(sup.lost)
        finally:
            await sup.stop()

        sup = supervisor(tmp_path, engines, router, timeout_s=3600)
        sup.start()
        try:
            engines[0].kill()  # replaced (restart works): serving again long before the timeout
            await until(lambda: sup.counts["replacements"] == 1, "the engine replacement")
            sup.watch_serving()
            assert sup.lost is None and sup._down_since is None
        finally:
            await sup.stop()

    try:
        asyncio.run(main())
    finally:
        for p in [*engines, router]:
            p.stop()


@pytest.mark.timeout(60)
def test_a_router_that_cannot_restart_stops_the_run(tmp_path):
    engines, router = [FakeProcess()], FakeProcess([], restart_fails=True)

    async def main():
        sup = supervisor(tmp_path, engines, router, timeout_s=3600)
        sup.start()
        try:
            router.kill()
            with pytest.raises(EnginesLost) as err:
                await sup.guard(asyncio.sleep(3600))
            msg = str(err.value)
            assert (
                f"router ({router.url}) given up after 3 failed restarts" in msg
                and str(tmp_path / "logs" / "router.log") in msg
            )
            assert sup.counts["router_restart_failures"] == 3
        finally:
            await sup.stop()

    try:
        asyncio.run(main())
    finally:
        for p in [*engines, router]:
            p.stop()


@pytest.mark.timeout(60)
def test_a_refused_health_check_waits_for_the_owner_to_see_the_exit(tmp_path):
    """A SIGKILLed engine closes its port before its owner reaps it (later still on a loaded machine):
    its fault is "exited" once the owner sees it; a live process that refuses connections is "unresponsive"."""
    import time

    dying, refusing = FakeProcess(), FakeProcess()
    router = FakeProcess([])

    def reaped_late(p: FakeProcess, after_s: float | None) -> None:
        p.server.stop()  # the port is closed at once ...
        p.server = None
        t0 = time.monotonic()  # ... the owner says alive for a while (forever: None)
        # (a restart serves again: alive from then on)
        p.alive = Remote(lambda: p.server is not None or after_s is None or time.monotonic() - t0 < after_s)

    async def main():
        sup = supervisor(tmp_path, [dying, refusing], router, timeout_s=3600)
        sup.start()
        try:
            reaped_late(dying, 1.0)
            reaped_late(refusing, None)
            await until(lambda: {f["engine"] for f in sup.faults} == {0, 1}, "a fault of each")
            first = {}
            for f in sup.faults:
                first.setdefault(f["engine"], f["kind"])
            assert first == {0: "exited", 1: "unresponsive"}, sup.faults
        finally:
            await sup.stop()

    try:
        asyncio.run(main())
    finally:
        for p in [dying, refusing, router]:
            p.stop()
