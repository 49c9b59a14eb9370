"""Serve an ASGI app (engine, router, dashboard, session server) in a thread of this process.

Every furlong server also runs in-process for tests, benchmarks and colocated
engines. The socket is bound before serving, so the URL is known (port 0 picks a
free one) and there is no race between choosing a port and listening on it.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


def bind(host: str, port: int, what: str = "server") -> socket.socket:
    """A listening socket; port 0 picks a free one. The error names the address."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"{what}: cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class AppThread:
    """`start()` (or `with`) serves `app` until `stop()`; `url` is set from construction on."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, *, name: str = "furlong-http", **uvicorn_kw: Any
    ):
        import uvicorn

        self.name = name
        self._sock = bind(host, port, name)
        self.url = url_of(self._sock)
        self._uvicorn = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, **uvicorn_kw))
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> AppThread:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self._sock]}, name=self.name, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._sock.close()
                raise RuntimeError(f"{self.name} did not start on {self.url} (see the log above)")
            time.sleep(0.01)
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> AppThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
