"""Helpers shared by tests that need a real `furlong serve` process."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from furlong.core.processes import ManagedProcess, free_port, furlong_argv
from furlong.models import create_model


@contextmanager
def engine_process(
    token: str, *extra: str, model_dir: str | Path | None = None, kv_cache_mb: int = 16, timeout_s: float = 120
) -> Iterator[tuple[str, Path]]:
    """A tiny-model engine on a free loopback port, one thread; yields (url, model dir) and stops it after."""
    path = Path(model_dir or create_model("qwen3", "tiny"))
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="furlong-engine-")) / "engine.log"
    argv = furlong_argv(
        "serve",
        "--model",
        str(path),
        "--port",
        str(port),
        "--admin-token",
        token,
        "--threads",
        "1",
        "--kv-cache-mb",
        str(kv_cache_mb),
        *extra,
    )
    proc = ManagedProcess("furlong serve", argv, f"http://127.0.0.1:{port}", log, threads=1).start(timeout_s)
    try:
        yield proc.url, path
    finally:
        proc.stop()
