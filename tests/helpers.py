"""Helpers shared by tests that need a real `furlong serve` process, or that look for a run's processes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from furlong.core.net import free_port
from furlong.core.processes import ADMIN_TOKEN_ENV, ManagedProcess, furlong_argv, token_env
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
        "--threads",
        "1",
        "--kv-cache-mb",
        str(kv_cache_mb),
        *extra,
    )
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess("furlong serve", argv, url, log, threads=1, env=token_env(token)).start(timeout_s)
    try:
        yield proc.url, path
    finally:
        proc.stop()


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return b""


def cmdline(pid: int | str) -> bytes:
    """`/proc/<pid>/cmdline` as it is (arguments separated by NUL), b"" if unreadable."""
    return _read(f"/proc/{pid}/cmdline")


def holds_token(pid: int | str, token: str) -> bool:
    """Whether process `pid` was handed `token` the way furlong hands it to its servers (its environment)."""
    return f"{ADMIN_TOKEN_ENV}={token}".encode() in _read(f"/proc/{pid}/environ").split(b"\0")


def token_holders(token: str) -> list[int]:
    """Every process (of this user: environments are private) that was handed `token`."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and holds_token(p, token)]


def cmdlines_with(secret: str) -> list[str]:
    """Every process whose command line contains `secret` (any local user could read it there)."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        cmd = cmdline(p)
        if secret.encode() in cmd:
            text = cmd.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{p}: {text[:160]}")
    return found


def processes_left(token: str, session_dir: str) -> list[str]:
    """Processes handed `token` (engines, router) or holding a file in the Ray session `session_dir` (Ray's own):
    what a finished run must not leave behind."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = cmdline(pid).replace(b"\0", b" ").decode(errors="replace")
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if holds_token(pid, token) or any(f.startswith(session_dir + "/") for f in fds):
            left.append(f"{pid}: {cmd[:120]}")
    return left
