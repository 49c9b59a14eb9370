"""SGLang as a furlong engine (GPU): build the launch command, start it, register it.

SGLang's native HTTP API is the contract the built-in engine copies (DESIGN §3), so once an
SGLang server is up, the router, rollout and weight-sync code talk to it unchanged. This
module only has to start it with the flags that code relies on:

* ``--enable-metrics`` — the dashboard and the router read ``/metrics``;
* ``--weight-version`` — every response carries ``meta_info.weight_version``;
* ``--admin-api-key`` — control endpoints (pause, weight updates) need the run's admin
  token, exactly like the built-in engine's ``--admin-token``;
* ``--enable-return-routed-experts`` — MoE rollout routing replay (R3);
* ``--enable-memory-saver`` — trainer and engine sharing GPUs (release / resume memory);
* ``--skip-server-warmup`` — RL engines serve real traffic at once; warm-up only delays;
* ``--load-format dummy`` — when the trainer pushes weights before the first rollout.

Usage::

    from furlong.engine.sglang import SGLangConfig, launch
    server = launch(SGLangConfig(model_path="/ckpt/qwen3-8b", port=30001, tp_size=2),
                    router_url="http://127.0.0.1:30000", admin_token="t")
    ...
    server.stop()

or ``python -m furlong.engine.sglang --model-path DIR --port 30001 --router http://127.0.0.1:30000``.

UNTESTED WITHOUT A GPU: the command line this module builds, the process handling, the
health wait and the registration are tested on CPU (with a stand-in ``sglang`` package);
a real SGLang server has not been started by furlong's CI, which has no GPU. Importing
this module never imports sglang.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


@dataclass
class SGLangConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    tp_size: int = 1
    mem_fraction_static: float | None = None  # SGLang picks one from the GPU's memory when None
    base_gpu_id: int = 0
    context_length: int | None = None
    max_running_requests: int | None = None
    random_seed: int | None = None
    weight_version: str = "0"
    enable_metrics: bool = True
    skip_warmup: bool = True
    return_routed_experts: bool = False
    enable_memory_saver: bool = False
    deterministic: bool = False
    load_format: str | None = None  # "dummy" when weights arrive from the trainer before the first rollout
    extra_args: list[str] = field(default_factory=list)  # anything else, passed verbatim

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        if not self.model_path:
            raise ValueError("model_path: required")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static: must be in (0, 1], got {self.mem_fraction_static}")
        for name in ("context_length", "max_running_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_command(cfg: SGLangConfig, admin_token: str | None = None, python: str = sys.executable) -> list[str]:
    """The ``python -m sglang.launch_server ...`` argv for ``cfg``."""
    cfg.validate()
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(cfg.model_path), "--host", cfg.host,
           "--port", str(cfg.port), "--dtype", cfg.dtype, "--tp-size", str(cfg.tp_size),
           "--weight-version", cfg.weight_version]
    options = {"--mem-fraction-static": cfg.mem_fraction_static, "--base-gpu-id": cfg.base_gpu_id or None,
               "--context-length": cfg.context_length, "--max-running-requests": cfg.max_running_requests,
               "--random-seed": cfg.random_seed, "--load-format": cfg.load_format, "--admin-api-key": admin_token}
    for flag, value in options.items():
        if value is not None:
            cmd += [flag, str(value)]
    switches = {"--enable-metrics": cfg.enable_metrics, "--skip-server-warmup": cfg.skip_warmup,
                "--enable-return-routed-experts": cfg.return_routed_experts,
                "--enable-memory-saver": cfg.enable_memory_saver,
                "--enable-deterministic-inference": cfg.deterministic}
    cmd += [flag for flag, on in switches.items() if on]
    return cmd + list(cfg.extra_args)


@dataclass
class SGLangServer:
    """A running SGLang server process (and its process group: SGLang forks schedulers)."""

    url: str
    process: subprocess.Popen
    log_path: Path | None = None

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _log_tail(path: Path | None, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path is not None and path.exists() else ""


def wait_healthy(server: SGLangServer, timeout: float) -> None:
    """Poll ``/health`` until 200; RuntimeError with the log's tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"sglang server exited with {server.process.returncode}:\n{_log_tail(server.log_path)}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"sglang server at {server.url} not healthy after {timeout:g}s:\n{_log_tail(server.log_path)}")


def register(router_url: str, engine_url: str, admin_token: str | None = None) -> dict:
    """Add ``engine_url`` to a furlong router; RuntimeError with the router's message on failure."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    r = httpx.post(router_url.rstrip("/") + "/add_engine", json={"url": engine_url}, headers=headers, timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"router {router_url} refused {engine_url}: {r.status_code} {r.text}")
    return r.json()


def launch(cfg: SGLangConfig, router_url: str | None = None, admin_token: str | None = None,
           timeout: float = 900.0, log_path: str | Path | None = None, env: dict[str, str] | None = None,
           python: str = sys.executable) -> SGLangServer:
    """Start SGLang, wait until it is healthy, then register it with ``router_url`` if given."""
    cmd = build_command(cfg, admin_token, python)
    log = Path(log_path) if log_path else None
    out = log.open("wb") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
    finally:
        if log:
            out.close()  # the child holds its own descriptor
    server = SGLangServer(cfg.url, proc, log)
    try:
        wait_healthy(server, timeout)
        if router_url:
            register(router_url, server.url, admin_token)
    except BaseException:
        server.stop()
        raise
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m furlong.engine.sglang", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--router", help="furlong router URL to register with once healthy")
    p.add_argument("--admin-token", default=os.environ.get("FURLONG_ADMIN_TOKEN"))
    p.add_argument("--log", help="file for the server's output")
    args, extra = p.parse_known_args(argv)
    cfg = SGLangConfig(model_path=args.model_path, host=args.host, port=args.port, dtype=args.dtype,
                       tp_size=args.tp_size, mem_fraction_static=args.mem_fraction_static, extra_args=extra)
    try:
        server = launch(cfg, args.router, args.admin_token, log_path=args.log)
    except (ValueError, RuntimeError) as e:
        print(f"furlong sglang: {e}", file=sys.stderr)
        return 2
    print(f"sglang serving at {server.url}" + (f", registered with {args.router}" if args.router else ""), flush=True)
    try:
        return server.process.wait() or 0
    except KeyboardInterrupt:
        server.stop()
        return 0


if __name__ == "__main__":
    sys.exit(main())
