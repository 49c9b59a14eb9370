"""`furlong dashboard RUN_DIR [--port N] [--host 127.0.0.1] [--follow]`: serve a run's dashboard."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from furlong.observe.store import DB_NAME


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="furlong dashboard", description="Serve the dashboard of a run directory (offline, or live with --follow)."
    )
    p.add_argument("run_dir", type=Path, help=f"a run directory (holding {DB_NAME})")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free port, printed)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network)"
    )
    p.add_argument("--follow", action="store_true", help="the run is live: the page polls for new events")
    a = p.parse_args(argv)
    if not a.run_dir.is_dir():
        print(f"furlong dashboard: run directory {a.run_dir} does not exist", file=sys.stderr)
        return 2
    if not (0 <= a.port <= 65535):
        print(f"furlong dashboard: --port {a.port} is not in 0..65535", file=sys.stderr)
        return 2
    if not (a.run_dir / DB_NAME).is_file():
        print(
            f"furlong dashboard: note: {a.run_dir} has no {DB_NAME} yet; the page will say so"
            + ("" if a.follow else " (use --follow to wait for a run that is starting)"),
            file=sys.stderr,
        )

    import time

    from furlong.dashboard.server import make_server

    try:
        server = make_server(a.run_dir, host=a.host, port=a.port, follow=a.follow)
    except OSError as e:
        print(f"furlong dashboard: {e}", file=sys.stderr)
        return 2
    print(f"furlong dashboard: {a.run_dir} at {server.url}/" + (" (following)" if a.follow else ""), flush=True)
    try:
        server.start()
        while server.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
