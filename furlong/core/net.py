"""Network helpers every process needs: a free port on a host."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on `host` now (another process may still take it before we bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
