"""SGLang as a furlong engine (GPU): its command line, and a launch on furlong's one process manager.

SGLang's native HTTP API is the contract the built-in engine copies (DESIGN §3), so once an
SGLang server is up, the router, rollout and weight-sync code talk to it unchanged. This
module only describes how to start it; starting, health-waiting and stopping are
`core.processes.ManagedProcess`, the same code that runs the built-in engine and the router.
The flags the rest of furlong relies on:

* ``--enable-metrics`` — the dashboard and the router read ``/metrics``;
* ``--weight-version`` — every response carries ``meta_info.weight_version``;
* ``admin-api-key`` — control endpoints (pause, weight updates) need the run's admin
  token, like the built-in engine; it is set in a 0600 ``--config`` file that
  `engine.sglang_exec` writes from ``$FURLONG_ADMIN_TOKEN``, never as a flag (every local
  user reads a command line), so `exec_command` is the argv a launcher runs;
* ``--enable-return-routed-experts`` — MoE rollout routing replay (R3);
* ``--enable-memory-saver`` — trainer and engine sharing GPUs (release / resume memory);
* ``--skip-server-warmup`` — RL engines serve real traffic at once; warm-up only delays;
* ``--load-format dummy`` — when the trainer pushes weights before the first rollout.

The run's ``engine.*`` settings map onto SGLang's flags in `config_for`: ``max_context`` →
``--context-length``, ``prefix_cache=False`` → ``--disable-radix-cache``, ``kv_cache_mb`` →
``--max-total-tokens`` (SGLang sizes its KV pool in tokens, so the budget is divided by the
model's KV bytes per token), ``max_running`` → ``--max-running-requests``, ``device`` →
``--device`` (``cuda:N`` → ``--device cuda --base-gpu-id N``; ``auto`` → SGLang's default), plus
``--dtype``, ``--host`` and ``--port``.

Usage::

    from furlong.engine.sglang import SGLangConfig, launch
    server = launch(SGLangConfig(model_path="/ckpt/qwen3-8b", port=30001, tp_size=2),
                    router_url="http://127.0.0.1:30000", admin_token="t")
    ...
    server.stop()

or ``python -m furlong.engine.sglang --model-path DIR --port 30001 --router http://127.0.0.1:30000``.

UNTESTED WITHOUT A GPU: the command line this module builds, the launch, the health wait
and the registration are tested on CPU (with a stand-in ``sglang`` package); a real SGLang
server has not been started by furlong's CI, which has no GPU. Importing this module never
imports sglang.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from furlong.core.net import tls_context
from furlong.core.processes import Command, ManagedProcess, ProcessFailed, token_env

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


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
    max_total_tokens: int | None = None  # KV pool size in tokens; SGLang fills its memory fraction when None
    random_seed: int | None = None
    weight_version: str = "0"
    enable_metrics: bool = True
    skip_warmup: bool = True
    disable_radix_cache: bool = False  # True: no prefix reuse (engine.prefix_cache=false)
    return_routed_experts: bool = False
    enable_memory_saver: bool = False
    deterministic: bool = False
    load_format: str | None = None  # "dummy" when weights arrive from the trainer before the first rollout
    device: str | None = None  # SGLang's --device (cuda, cpu, ...); None: SGLang's default (cuda)
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
        for name in ("context_length", "max_running_requests", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _option(flag: str, value: object) -> list[str]:
    """`flag value`, or `flag=value` when the value starts with '-' (argparse would read it as an option)."""
    text = str(value)
    return [f"{flag}={text}"] if text.startswith("-") else [flag, text]


def build_command(cfg: SGLangConfig, python: str = sys.executable) -> list[str]:
    """SGLang's own ``python -m sglang.launch_server ...`` argv for ``cfg`` (no admin key: see `exec_command`)."""
    cfg.validate()
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(cfg.model_path),
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--dtype",
        cfg.dtype,
        "--tp-size",
        str(cfg.tp_size),
        "--weight-version",
        cfg.weight_version,
    ]
    options = {
        "--mem-fraction-static": cfg.mem_fraction_static,
        "--base-gpu-id": cfg.base_gpu_id or None,
        "--context-length": cfg.context_length,
        "--max-running-requests": cfg.max_running_requests,
        "--max-total-tokens": cfg.max_total_tokens,
        "--random-seed": cfg.random_seed,
        "--load-format": cfg.load_format,
        "--device": cfg.device,
    }
    for flag, value in options.items():
        if value is not None:
            cmd += _option(flag, value)
    switches = {
        "--enable-metrics": cfg.enable_metrics,
        "--skip-server-warmup": cfg.skip_warmup,
        "--disable-radix-cache": cfg.disable_radix_cache,
        "--enable-return-routed-experts": cfg.return_routed_experts,
        "--enable-memory-saver": cfg.enable_memory_saver,
        "--enable-deterministic-inference": cfg.deterministic,
    }
    cmd += [flag for flag, on in switches.items() if on]
    return cmd + list(cfg.extra_args)


def exec_command(cfg: SGLangConfig, admin_token: str | None = None, python: str = sys.executable) -> Command:
    """What a launcher runs: `build_command` under `engine.sglang_exec`, the token in the `Command`'s env."""
    return Command(
        [python, "-m", "furlong.engine.sglang_exec", "--", *build_command(cfg, python)], token_env(admin_token)
    )


def _model_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model_dir: cannot read {path} to size SGLang's KV pool: {e}") from None
    return cfg.get("text_config", cfg)  # multimodal configs nest the language model's


def kv_tokens(model_cfg: dict, dtype: str, kv_cache_mb: int) -> int:
    """How many tokens of K and V fit in `kv_cache_mb` (the built-in engine's formula, from config.json)."""
    heads = model_cfg["num_attention_heads"]
    head_dim = model_cfg.get("head_dim") or model_cfg["hidden_size"] // heads
    kv_heads = model_cfg.get("num_key_value_heads") or heads
    width = DTYPE_BYTES.get(dtype) or DTYPE_BYTES.get(str(model_cfg.get("torch_dtype") or model_cfg.get("dtype")), 2)
    per_token = 2 * model_cfg["num_hidden_layers"] * kv_heads * head_dim * width
    return max(1, kv_cache_mb * 2**20 // per_token)


def config_for(
    *,
    model_dir: str,
    host: str,
    port: int,
    dtype: str,
    kv_cache_mb: int,
    max_running: int,
    max_context: int | None,
    prefix_cache: bool,
    device: str = "auto",
) -> SGLangConfig:
    """The SGLang server that honours the run's `engine.*` settings (the mapping is in the module docstring)."""
    from furlong.engine.engine import context_window

    model_cfg = _model_config(model_dir)
    context_window(int(model_cfg.get("max_position_embeddings", 2048)), max_context)  # same refusal as builtin
    return SGLangConfig(
        model_path=str(model_dir),
        host=host,
        port=port,
        dtype=dtype,
        context_length=max_context,
        max_running_requests=max_running,
        max_total_tokens=kv_tokens(model_cfg, dtype, kv_cache_mb),
        disable_radix_cache=not prefix_cache,
        device=None if device == "auto" else device.split(":")[0],  # cuda:N: the GPU index is --base-gpu-id
        base_gpu_id=int(device.split(":")[1]) if device.startswith("cuda:") else 0,
    )


MISSING = (
    "engine.backend=sglang: the sglang package is not installed for {python}; install it on a GPU "
    "machine (pip install 'sglang[all]') or set engine.backend=builtin"
)


class SGLangServer(ManagedProcess):
    """A running SGLang server: a `ManagedProcess` (its whole process group: SGLang forks schedulers)."""

    @property
    def process(self):
        """The server's `subprocess.Popen`."""
        return self.proc

    def stop(self, grace_s: float = 30.0) -> None:  # SGLang frees GPU memory on SIGTERM: give it time
        super().stop(grace_s)


def register(router_url: str, engine_url: str, admin_token: str | None = None) -> dict:
    """Add ``engine_url`` to a furlong router; RuntimeError with the router's message on failure."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    r = httpx.post(
        router_url.rstrip("/") + "/add_engine",
        json={"url": engine_url},
        headers=headers,
        timeout=30,
        verify=tls_context(),
    )
    if r.status_code != 200:
        raise RuntimeError(f"router {router_url} refused {engine_url}: {r.status_code} {r.text}")
    return r.json()


def launch(
    cfg: SGLangConfig,
    router_url: str | None = None,
    admin_token: str | None = None,
    timeout: float = 900.0,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
) -> SGLangServer:
    """Start SGLang, wait until it is healthy, then register it with ``router_url`` if given.

    `env` adds variables to the server's environment. ProcessFailed (a RuntimeError) with the
    log's tail if the server dies or never gets healthy; a clear one if sglang is not installed.
    """
    argv = exec_command(cfg, admin_token, python)
    log = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="furlong-sglang-")) / "server.log"
    server = SGLangServer("sglang server", argv, cfg.url, log, env=env)
    try:
        server.start(timeout)
    except ProcessFailed:
        tail = server.log_tail()
        if re.search(r"No module named '?sglang\b", tail):
            raise ProcessFailed(MISSING.format(python=python) + f"\n{tail}") from None
        if server.proc is not None and server.proc.returncode is not None:
            raise ProcessFailed(f"sglang server exited with {server.proc.returncode}:\n{tail}") from None
        raise
    try:
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
    cfg = SGLangConfig(
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        tp_size=args.tp_size,
        mem_fraction_static=args.mem_fraction_static,
        extra_args=extra,
    )
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
