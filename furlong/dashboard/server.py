"""The dashboard's HTTP server: JSON API over `RunReader` plus the static page.

Every endpoint answers any run directory state without a 5xx: a missing directory
is 404, a corrupt store 422, bad query parameters 400/422, and a run that has not
written anything yet an empty payload with a `message`. The page polls the same
endpoints when the server was started with `follow=True` (a live run).

`serve_in_thread` is what `furlong train` calls when `observe.dashboard=true`:

    handle = serve_in_thread(run_dir, port=cfg.observe.dashboard_port, follow=True)
    print(f"dashboard: {handle.url}")
    ...
    handle.stop()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from furlong.core.app_thread import AppThread
from furlong.core.spans import PHASES
from furlong.observe.advisories import advise
from furlong.observe.reader import RunError, RunReader

I64 = 2**63 - 1  # SQLite integers: a bigger query parameter is a 422, not an overflow

STATIC = Path(__file__).parent / "static"


def create_app(run_dir: str | Path, *, follow: bool = False, poll_s: float = 2.0) -> FastAPI:
    run_dir = Path(run_dir)
    app = FastAPI(title=f"furlong dashboard: {run_dir.name}", docs_url="/api/docs", redoc_url=None)

    @app.exception_handler(RunError)
    async def run_error(_: Request, e: RunError) -> JSONResponse:
        return JSONResponse({"detail": e.message}, status_code=e.status)

    def reader() -> RunReader:
        return RunReader(run_dir)

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/api/summary")
    def summary() -> dict[str, Any]:
        return reader().summary() | {"follow": follow, "poll_s": poll_s, "phases": list(PHASES)}

    @app.get("/api/metrics")
    def metrics(
        names: str | None = Query(None, description="comma-separated metric names; all when absent"),
    ) -> dict[str, Any]:
        return reader().metrics([n for n in names.split(",") if n] if names else None)

    @app.get("/api/timeline")
    def timeline(
        step_from: int | None = Query(None, ge=-I64, le=I64),
        step_to: int | None = Query(None, ge=-I64, le=I64),
        limit: int = Query(20000, ge=1, le=200000),
    ) -> dict[str, Any]:
        return reader().timeline(step_from, step_to, limit)

    @app.get("/api/samples")
    def samples(
        step: int | None = Query(None, ge=-I64, le=I64),
        status: str | None = None,
        group: int | None = Query(None, ge=-I64, le=I64),
        q: str | None = None,
        sort: str = "id",
        order: str = "asc",
        limit: int = Query(200, ge=1, le=5000),
        offset: int = Query(0, ge=0, le=I64),
    ) -> dict[str, Any]:
        return reader().samples(
            step=step, status=status, group=group, q=q, sort=sort, order=order, limit=limit, offset=offset
        )

    @app.get("/api/samples/{sample_id}")
    def sample(sample_id: int = PathParam(ge=-I64, le=I64)) -> dict[str, Any]:
        return reader().sample(sample_id)

    @app.get("/api/groups")
    def groups(step: int | None = Query(None, ge=-I64, le=I64)) -> dict[str, Any]:
        return reader().groups(step)

    @app.get("/api/engines")
    def engines() -> dict[str, Any]:
        return reader().engines()

    @app.get("/api/advisories")
    def advisories() -> dict[str, Any]:
        return advise(reader(), live=follow)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def make_server(
    run_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0, follow: bool = False, poll_s: float = 2.0
) -> AppThread:
    """The dashboard bound to host:port (its `url` known), not yet serving."""
    return AppThread(
        create_app(run_dir, follow=follow, poll_s=poll_s), host, port, name="furlong-dashboard", lifespan="off"
    )


def serve_in_thread(
    run_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    follow: bool = True,
    poll_s: float = 2.0,
    timeout_s: float = 30.0,
) -> AppThread:
    """Start the dashboard in a daemon thread of this process; returns once it answers."""
    return make_server(run_dir, host=host, port=port, follow=follow, poll_s=poll_s).start(timeout_s)
