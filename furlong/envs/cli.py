"""`furlong envs ...`: the TITO session server and the sandbox, from the command line.

furlong envs sessions --engine http://127.0.0.1:30000 --port 31000
    serve sessions in front of an engine (or the router); an agent uses
    http://127.0.0.1:31000/sessions/<id>/v1 as its OpenAI base_url
furlong envs demos calculator FILE [--n 2000] [--flawed 0.5] [--difficulty 1]
    write calculator tool-use conversations for the SFT warm-up (data.sft_path)
furlong envs setup NAME... | --all [--force]
    build (or reuse) the virtual environment of a connector package
    (openenv, verifiers, nemo-gym, harbor); cached under ~/.cache/furlong/envs
furlong envs list
    the connectors, their Python and requirements, and whether each is built
furlong envs sandbox FILE.py [--timeout 10] [--memory-mb 1024]
    run a program in the local sandbox and print the result as JSON,
    including which isolation layers were in force on this machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="furlong envs", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sessions", help="serve TITO sessions in front of an engine or the router")
    s.add_argument("--engine", required=True, help="engine or router URL, e.g. http://127.0.0.1:30000")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=31000)
    s.add_argument("--model", default=None, help="tokenizer directory (default: the engine's, from /get_model_info)")
    d = sub.add_parser("demos", help="write warm-up conversations (data.sft_path) for a built-in environment")
    d.add_argument("env", choices=["calculator"])
    d.add_argument("out", help="JSONL file to write")
    d.add_argument("--n", type=int, default=2000)
    d.add_argument("--flawed", type=float, default=0.5, help="fraction that skip the tool and answer wrongly")
    d.add_argument("--difficulty", type=int, default=1)
    d.add_argument("--seed", type=int, default=0)
    u = sub.add_parser("setup", help="build the virtual environment of one or more connectors (cached)")
    u.add_argument("names", nargs="*", help="connector names (see `furlong envs list`)")
    u.add_argument("--all", action="store_true", help="every connector")
    u.add_argument("--force", action="store_true", help="rebuild even when cached")
    sub.add_parser("list", help="the connectors and whether their environments are built")
    b = sub.add_parser("sandbox", help="run a Python file in the local sandbox; print the result as JSON")
    b.add_argument("file")
    b.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds")
    b.add_argument("--memory-mb", type=int, default=1024)
    b.add_argument("--network", action="store_true", help="allow network access")
    b.add_argument("--unsafe-allow", action="store_true", help="run without namespaces where the kernel refuses them")
    args = parser.parse_args(argv)
    if args.command == "sessions":
        return _sessions(args)
    if args.command in ("setup", "list"):
        return _setup(args)
    if args.command == "demos":
        from furlong.envs.calculator import write_demonstrations

        path = write_demonstrations(args.out, args.n, seed=args.seed, flawed=args.flawed, difficulty=args.difficulty)
        print(f"wrote {args.n} {args.env} demonstrations to {path}", file=sys.stderr)
        return 0
    return _sandbox(args)


def _sessions(args: argparse.Namespace) -> int:
    import uvicorn

    from furlong.envs.session_server import SessionServer

    tokenizer = None
    if args.model:
        from furlong.models import load_tokenizer

        tokenizer = load_tokenizer(args.model)
    server = SessionServer(args.engine, tokenizer)
    print(f"furlong sessions on http://{args.host}:{args.port} -> {args.engine}", file=sys.stderr)
    uvicorn.run(server.app(), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def _setup(args: argparse.Namespace) -> int:
    from furlong.envs.connectors import CONNECTORS, spec
    from furlong.envs.connectors.venvs import VenvError, ensure, is_built, venv_dir

    if args.command == "list":
        for name in CONNECTORS:
            s = spec(name)
            state = "built" if is_built(s) else "not built"
            print(f"{name:10s} python {s.python}  {state:9s}  {venv_dir(s)}\n{'':10s} {' '.join(s.requirements)}")
        return 0
    names = list(CONNECTORS) if args.all else args.names
    if not names:
        print(
            "furlong envs setup: name one or more connectors, or pass --all; known: " + ", ".join(CONNECTORS),
            file=sys.stderr,
        )
        return 2
    from concurrent.futures import ThreadPoolExecutor

    def build(name: str) -> bool:
        """Builds run side by side: they wait mostly on the package index, not on the CPU."""
        try:
            print(ensure(spec(name), force=args.force).parent.parent, flush=True)
            return True
        except (ValueError, VenvError) as e:
            print(f"furlong envs setup {name}: {e}", file=sys.stderr, flush=True)
            return False

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        ok = list(pool.map(build, names))
    return 0 if all(ok) else 1


def _sandbox(args: argparse.Namespace) -> int:
    from furlong.envs.sandbox.base import SandboxLimits
    from furlong.envs.sandbox.local import LocalSandbox

    try:
        code = open(args.file).read()
    except OSError as e:
        print(f"furlong envs sandbox: cannot read {args.file}: {e}", file=sys.stderr)
        return 2
    from furlong.envs.sandbox.jail import SandboxUnavailable

    limits = SandboxLimits(timeout_s=args.timeout, memory_mb=args.memory_mb, network=args.network)
    box = LocalSandbox(limits, unsafe_allow=args.unsafe_allow)
    try:
        result = asyncio.run(box.run(code))
    except SandboxUnavailable as e:
        print(f"furlong envs sandbox: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0 if result["status"] == "ok" else 1
