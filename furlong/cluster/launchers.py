"""How each server process of a run is started: the engine by `engine.backend`, and the router.

An engine is either a process (`builtin`: `furlong serve`; `sglang`: SGLang's server,
same HTTP contract) that a `ProcessActor` owns, or, with `cluster.colocate`, the
built-in engine inside trainer rank 0. Every engine setting reaches both forms:
the process gets it as flags (`furlong.engine.launch.engine_argv` owns each backend's
spelling), the colocated engine as `Engine(...)` keyword arguments.

The admin token is never on a command line (any local user reads those): each command is a
`core.processes.Command` whose `env` carries it, and the process manager hands that to the
child's environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from furlong.core.processes import Command, furlong_argv, token_env

if TYPE_CHECKING:
    from furlong.config.schema import EngineConfig, RouterConfig


def check_backend(engine: EngineConfig) -> None:
    """Before anything starts: the backend exists and can start here (else a ValueError naming the setting)."""
    from furlong.engine.launch import require_backend

    require_backend(engine.backend)


def engine_command(
    engine: EngineConfig,
    *,
    model_dir: str,
    port: int,
    admin_token: str,
    threads: int,
    host: str | None = None,
    niceness: int = 0,
) -> Command:
    """The argv (and, in its `env`, the admin token) of one engine process, for the launcher `engine.backend` names.

    `host`: the address to bind when the placement decides it (a node's IP across nodes); None: `engine.host`.
    """
    from furlong.engine.launch import engine_argv

    return engine_argv(
        engine.backend,
        model_dir=model_dir,
        host=host or engine.host,
        port=port,
        dtype=engine.dtype,
        kv_cache_mb=engine.kv_cache_mb,
        max_running=engine.max_running,
        max_context=engine.max_context,
        prefix_cache=engine.prefix_cache,
        threads=threads,
        admin_token=admin_token,
        device=engine.device,
        quantization=engine.quantization,
        cuda_graphs=engine.cuda_graphs,
        compile_decode=engine.compile,
        niceness=niceness,
    )


def colocated_engine_kwargs(engine: EngineConfig) -> dict[str, Any]:
    """`Engine(...)` keyword arguments of the engine colocated in trainer rank 0 (built-in engine only)."""
    if engine.backend != "builtin":
        raise ValueError(
            f"cluster.colocate: runs the built-in engine inside the trainer; "
            f"engine.backend={engine.backend} cannot be colocated"
        )
    return dict(
        dtype=engine.dtype,
        kv_cache_mb=engine.kv_cache_mb,
        max_running=engine.max_running,
        max_context=engine.max_context,
        prefix_cache=engine.prefix_cache,
        cuda_graphs=engine.cuda_graphs,
        compile_decode=engine.compile,
        **({"quantization": engine.quantization} if engine.quantization != "none" else {}),
        **({"device": engine.device} if engine.device != "auto" else {}),  # auto: the Engine's own default
    )


def router_command(
    router: RouterConfig, *, engine_urls: list[str], port: int, admin_token: str, host: str | None = None
) -> Command:
    """The argv (and, in its `env`, the admin token) of the `furlong router` process in front of `engine_urls`.

    `host`: the address to bind when the placement decides it; None: `router.host`."""
    engines = [arg for url in engine_urls for arg in ("--engine", url)]
    argv = furlong_argv(
        "router",
        *engines,
        "--host",
        host or router.host,
        "--port",
        str(port),
        "--policy",
        router.policy,
        "--health-interval",
        str(router.health_interval_s),
        "--health-timeout",
        str(router.health_timeout_s),
        "--unhealthy-after",
        str(router.unhealthy_after),
        "--max-retries",
        str(router.max_retries),
    )
    return Command(argv, token_env(admin_token))
