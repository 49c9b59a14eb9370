"""``furlong router``: serve the router in front of running engine servers.

Usage::

    furlong serve --model DIR --port 30001 &
    furlong serve --model DIR --port 30002 &
    furlong router --engine http://127.0.0.1:30001 --engine http://127.0.0.1:30002 --port 30000

    curl -s localhost:30000/engines                      # state, in-flight, failures
    curl -s localhost:30000/generate -d '{"text": "Hi", "sampling_params": {"max_new_tokens": 8}}'
    curl -s localhost:30000/generate -H 'X-Routing-Key: session-7' -d ...   # sticky
    curl -s -XPOST localhost:30000/add_engine -d '{"url": "http://127.0.0.1:30003"}'
    curl -s -XPOST localhost:30000/pause_generation -d '{"mode": "retract"}'  # every engine

Engines may also start with none and register later (``furlong.engine.sglang`` does).

The admin token comes from ``--admin-token-file``, ``--admin-token`` or
``$FURLONG_ADMIN_TOKEN`` (see `furlong.engine.admin_token`): off loopback one is generated
when none is given; on loopback the open control endpoints are warned about.
"""

from __future__ import annotations

import argparse
import logging
import sys

from furlong.router.policies import POLICIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="furlong router", description="Route requests across engine servers.")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="engine base URL, e.g. http://127.0.0.1:30001 (repeat for more)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to bind (default 30000)")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="least_inflight",
        help="placement of requests without a routing key (default least_inflight)",
    )
    p.add_argument(
        "--admin-token",
        default=None,
        help="token required (Authorization: Bearer) by control and add/remove endpoints; visible to every "
        "local user in `ps`: prefer --admin-token-file or $FURLONG_ADMIN_TOKEN",
    )
    p.add_argument("--admin-token-file", default=None, metavar="PATH", help="file holding the admin token (mode 0600)")
    p.add_argument("--health-interval", type=float, default=2.0, metavar="S", help="seconds between health probes")
    p.add_argument("--health-timeout", type=float, default=2.0, metavar="S", help="a probe slower than this fails")
    p.add_argument(
        "--unhealthy-after",
        type=int,
        default=2,
        metavar="N",
        help="consecutive failed probes before quarantine (a failed request quarantines at once)",
    )
    p.add_argument("--max-retries", type=int, default=2, help="other engines to try when one dies (default 2)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port < 65536:
        parser.error(f"--port: {args.port} is not a TCP port")
    import uvicorn

    from furlong.engine import admin_token
    from furlong.router.server import Router

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        token = admin_token.resolve("furlong router", args.host, args.port, args.admin_token, args.admin_token_file)
    except ValueError as e:
        parser.error(str(e))
    try:
        router = Router(
            args.engine,
            policy=args.policy,
            admin_token=token,
            health_interval=args.health_interval,
            health_timeout=args.health_timeout,
            unhealthy_after=args.unhealthy_after,
            max_retries=args.max_retries,
        )
    except ValueError as e:
        field, _, problem = str(e).partition(":")  # messages start with the field they blame
        parser.error(f"--{field.replace('_', '-')}:{problem}")
    print(f"furlong router on http://{args.host}:{args.port} policy={args.policy} engines={args.engine}", flush=True)
    uvicorn.run(router.app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
