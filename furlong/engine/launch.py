"""The engine command line for each `engine.backend`: what a launcher runs, not how it runs it.

The cluster starts every engine the same way (a `core.processes.ManagedProcess`, under a
Ray actor or directly); only the argv differs by backend, so choosing the backend is
choosing the argv. Both honour the same `engine.*` settings:

* ``builtin`` — ``furlong serve`` (`engine.cli`), this package's own engine, CPU or GPU;
* ``sglang`` — ``python -m sglang.launch_server`` with the flags `engine.sglang` maps our
  settings onto (GPU only; the package is not a dependency of furlong).

`threads` caps the built-in engine's torch threads through ``--threads``; SGLang has no such
flag, so a launcher also passes `threads` to the process manager, which caps the math
libraries' threads of either backend through the environment.

The admin token is never a flag: any local user reads every process's command line
(`/proc/<pid>/cmdline`). The argv comes back as a `core.processes.Command` whose `env`
carries the token (``FURLONG_ADMIN_TOKEN``), which the process manager puts in the child's
environment, readable only by the same user. `furlong serve` reads it from there; SGLang
reads it from a 0600 config file that `engine.sglang_exec` writes from that variable.
"""

from __future__ import annotations

import importlib.util
import sys

from furlong.core.processes import Command, furlong_argv, token_env

BACKENDS = ("builtin", "sglang")


def engine_argv(
    backend: str,
    *,
    model_dir: str,
    host: str,
    port: int,
    dtype: str,
    kv_cache_mb: int,
    max_running: int,
    max_context: int | None,
    prefix_cache: bool,
    threads: int,
    admin_token: str,
    device: str = "auto",
    quantization: str = "none",
    cuda_graphs: bool = False,
    compile_decode: bool = False,
    niceness: int = 0,
) -> Command:
    """The argv (and environment: the admin token) that starts one engine server of `backend`.

    `niceness`: the built-in engine lowers its own CPU priority by this much (time-shared cores,
    `cluster.share_cores`); SGLang ignores it (it computes on a GPU).

    ValueError naming `engine.backend` for an unknown backend, and (sglang) naming the setting
    SGLang cannot honour, e.g. a `max_context` over the model's positions.
    """
    if backend == "builtin":
        argv = furlong_argv(
            "serve",
            "--model",
            str(model_dir),
            "--host",
            host,
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--kv-cache-mb",
            str(kv_cache_mb),
            "--max-running",
            str(max_running),
            "--threads",
            str(threads),
        )
        if max_context is not None:
            argv += ["--max-context", str(max_context)]
        if not prefix_cache:
            argv.append("--no-prefix-cache")
        if device != "auto":
            argv += ["--device", device]
        if quantization != "none":
            argv += ["--quantization", quantization]
        if cuda_graphs:
            argv.append("--cuda-graphs")
        if compile_decode:
            argv.append("--compile")
        if niceness:
            argv += ["--niceness", str(niceness)]
        return Command(argv, token_env(admin_token))
    if backend == "sglang":
        from furlong.engine import sglang

        cfg = sglang.config_for(
            model_dir=str(model_dir),
            host=host,
            port=port,
            dtype=dtype,
            kv_cache_mb=kv_cache_mb,
            max_running=max_running,
            max_context=max_context,
            prefix_cache=prefix_cache,
            device=device,
        )
        return sglang.exec_command(cfg, admin_token)
    raise ValueError(f"engine.backend: unknown backend {backend!r}; choose one of {list(BACKENDS)}")


def require_backend(backend: str) -> None:
    """Fail early, naming the setting, when `backend` cannot start from this interpreter.

    A launcher calls it before starting anything, so a run with `engine.backend=sglang` on a
    machine without SGLang stops at once with the fix in the message, not minutes later
    with an engine's log tail.
    """
    if backend not in BACKENDS:
        raise ValueError(f"engine.backend: unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if backend == "sglang" and importlib.util.find_spec("sglang") is None:
        from furlong.engine.sglang import MISSING

        raise ValueError(MISSING.format(python=sys.executable))
