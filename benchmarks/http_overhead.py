"""Serving overhead: CPU the engine server and the router spend per `/generate`, with uvicorn's pure-Python
stack (h11 parser, asyncio loop) and with its C stack (httptools, uvloop: what furlong installs), side by side.

Why it matters: an agent rollout sends a `/generate` per turn — hundreds a second on the environment-latency
work (`async_speedup.py --env-latency`: 64 episodes x 5 turns a step) — and on 2 cores every millisecond the
event loops spend is taken from the engine's forward (whose two OpenMP threads stall whenever either core is
taken). Each request here asks for `max_new_tokens=0` with an 80-token prompt (validated, queued to the
scheduler thread, answered with the full response body, never forwarded through the model), so the CPU
measured is the serving path alone: process user + system time over `--requests` sequential requests,
after a warm-up, for the engine called directly and for the router process relaying to it. The two stacks
run in turn, each the median of `--runs` runs.

    python benchmarks/http_overhead.py [--requests 1000] [--runs 3]

Last line: `RATIO engine_cpu_pure_vs_c=<x> router_cpu_pure_vs_c=<y>` (CPU per request, pure-Python stack over
the C stack: above 1 means the C stack is cheaper).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
from engine_throughput import wait_healthy  # noqa: E402

from furlong.core.net import free_port

STACKS = {"pure": ("h11", "asyncio"), "c": ("httptools", "uvloop")}


def serve(role: str, target: str, port: int, http: str, loop: str) -> None:
    """Child process: the engine app (`target` = model dir) or the router app (`target` = engine URL)."""
    import uvicorn

    if role == "engine":
        from furlong.engine.engine import Engine
        from furlong.engine.server import create_app

        engine = Engine(target, kv_cache_mb=64).start()
        app = create_app(engine)
    else:
        from furlong.router.server import Router

        app = Router([target]).app
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, http=http, loop=loop)


def spawn(role: str, target: str, stack: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    http, loop = STACKS[stack]
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", role, target, str(port), http, loop]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def cpu_ms_per_request(client: httpx.Client, url: str, proc: subprocess.Popen, n: int) -> float:
    body = {
        "input_ids": list(range(5, 85)),
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
    }
    for _ in range(100):
        assert client.post(url + "/generate", json=body).status_code == 200
    p = psutil.Process(proc.pid)
    t0 = p.cpu_times()
    for _ in range(n):
        r = client.post(url + "/generate", json=body)
        assert r.status_code == 200, r.text
    t1 = p.cpu_times()
    return 1000 * ((t1.user + t1.system) - (t0.user + t0.system)) / n


def measure(model: str, stack: str, n: int) -> dict[str, float]:
    engine, eurl = spawn("engine", model, stack)
    try:
        router, rurl = spawn("router", eurl, stack)
        try:
            with httpx.Client(timeout=60) as c:
                return {
                    "engine": cpu_ms_per_request(c, eurl, engine, n),
                    "router": cpu_ms_per_request(c, rurl, router, n),
                }
        finally:
            router.terminate()
            router.wait()
    finally:
        engine.terminate()
        engine.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="timed requests per measurement")
    ap.add_argument("--runs", type=int, default=3, help="runs per stack; the median is reported")
    ap.add_argument("--serve", nargs=5, metavar=("ROLE", "TARGET", "PORT", "HTTP", "LOOP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        role, target, port, http, loop = args.serve
        serve(role, target, int(port), http, loop)
        return 0
    missing = [m for m in ("httptools", "uvloop") if importlib.util.find_spec(m) is None]
    if missing:
        ap.error(f"the C stack needs {' and '.join(missing)} (pip install -e . installs them)")
    import torch

    from furlong.models import create_model

    _machine.header(torch.float32)
    model = str(create_model("qwen3", "small"))
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in STACKS}
    for _ in range(max(1, args.runs)):  # in rounds: the machine's drift meets both stacks alike
        for stack in STACKS:
            runs[stack].append(measure(model, stack, args.requests))
            print(f"  measured {stack}: {runs[stack][-1]}", flush=True)
    med = {s: {k: statistics.median(r[k] for r in rs) for k in ("engine", "router")} for s, rs in runs.items()}
    print(f"\n{'stack':<34}{'engine ms CPU/req':>19}{'router ms CPU/req':>19}")
    for s, (http, loop) in STACKS.items():
        print(f"{s + f' ({http} + {loop})':<34}{med[s]['engine']:>19.2f}{med[s]['router']:>19.2f}")
    ratio = {k: med["pure"][k] / max(1e-9, med["c"][k]) for k in ("engine", "router")}
    print(_machine.load_line(1))
    print(f"RATIO engine_cpu_pure_vs_c={ratio['engine']:.2f} router_cpu_pure_vs_c={ratio['router']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
