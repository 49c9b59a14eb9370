"""Serve one OpenEnv environment on 127.0.0.1; runs in the openenv connector's own environment.

    python openenv_server.py --env ENV --port PORT [--workdir DIR] [--max-sessions N]

ENV is one of:
  echo        the echo environment of OpenEnv's own `openenv init` template (each
              step echoes the action's `message`; reward min(0.1 * len(message), 1.0));
              generated into DIR and served with `max-sessions` concurrent episodes
  DIR         an OpenEnv environment directory (its `openenv.yaml` names the app,
              e.g. `app: server.app:app`), its packages installed in this environment
  MODULE:APP  a FastAPI app built with `openenv.core.env_server.create_app`, importable here

The app is OpenEnv's own server: `/health`, `/reset`, `/step`, `/schema`, and the
WebSocket `/ws` on which each connection is one stateful episode (furlong uses that).
Standard library and openenv only: this file is never imported by furlong.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path


def echo_app(workdir: Path, max_sessions: int):
    """The template environment `openenv init echo_env` writes, served with `max_sessions` episodes at once."""
    from openenv.cli.commands import init as init_command
    from openenv.core.env_server.http_server import create_app

    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "echo_env" / "openenv.yaml").is_file():
        # a uv lock file needs uv and the network; serving does not
        init_command._generate_uv_lock = lambda env_dir: False
        init_command.init("echo_env", output_dir=str(workdir))
    sys.path.insert(0, str(workdir))
    models = importlib.import_module("echo_env.models")
    server = importlib.import_module("echo_env.server.echo_env_environment")
    return create_app(
        server.EchoEnvironment,
        models.EchoAction,
        models.EchoObservation,
        env_name="echo_env",
        max_concurrent_envs=max_sessions,
    )


def directory_app(root: Path):
    """The app an environment directory's `openenv.yaml` names (`app: server.app:app`)."""
    spec = (root / "openenv.yaml").read_text()
    app = next((ln.split(":", 1)[1].strip() for ln in spec.splitlines() if ln.startswith("app:")), "server.app:app")
    sys.path[:0] = [str(root), str(root.parent)]
    return module_app(app)


def module_app(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr or "app")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workdir", default=".")
    p.add_argument("--max-sessions", type=int, default=256)
    a = p.parse_args()
    if a.env == "echo":
        app = echo_app(Path(a.workdir), a.max_sessions)
    elif Path(a.env).is_dir():
        if not (Path(a.env) / "openenv.yaml").is_file():
            print(f"openenv_server: {a.env} is a directory without openenv.yaml", file=sys.stderr)
            return 2
        app = directory_app(Path(a.env).resolve())
    elif ":" in a.env:
        app = module_app(a.env)
    else:
        print(
            f"openenv_server: unknown environment {a.env!r}: not 'echo', an environment directory, or MODULE:APP",
            file=sys.stderr,
        )
        return 2
    import uvicorn

    print(f"openenv_server: serving {a.env} on http://{a.host}:{a.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", ws_ping_interval=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
