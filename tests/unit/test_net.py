"""free_port: a port outside the ephemeral range, so no outgoing connection takes it before the real bind.

The suite once failed with EADDRINUSE when a gloo store bound a port probed
from the ephemeral range; these tests pin the rule that prevents it.
"""

from __future__ import annotations

import random
import socket

from furlong.core import net


def test_ports_are_free_and_outside_the_ephemeral_range():
    lo, hi = net.ephemeral_range()
    ports = {net.free_port() for _ in range(50)}
    for port in ports:
        assert not lo <= port <= hi, port
        assert port >= 20000  # Ray's worker ports are 10002-19999
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing holds it


def test_a_port_in_use_is_never_returned(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    monkeypatch.setattr(net, "_LOWEST", port)
    monkeypatch.setattr(net, "ephemeral_range", lambda: (port + 1, 65535))  # the only port outside it is held
    try:
        assert port not in {net.free_port() for _ in range(5)}  # every draw refused: the OS's choice instead
    finally:
        held.close()


def test_no_room_outside_the_range_falls_back_to_the_os(monkeypatch):
    monkeypatch.setattr(net, "ephemeral_range", lambda: (1024, 65535))
    port = net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_processes_seeded_alike_do_not_draw_alike():
    random.seed(0)
    first = [net.free_port() for _ in range(5)]
    random.seed(0)
    assert [net.free_port() for _ in range(5)] != first


def test_the_range_is_read_from_the_os(monkeypatch, tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    monkeypatch.setattr(net, "_RANGE_FILE", f)
    assert net.ephemeral_range() == (40000, 50000)
    f.write_text("garbage")
    assert net.ephemeral_range() == (49152, 65535)


# ------------------------------------------------------------------ one TLS context per process
CALLS = {"Client", "AsyncClient", "get", "post", "put", "patch", "delete", "head", "request", "stream"}


def test_every_httpx_client_furlong_makes_is_handed_the_shared_tls_context():
    """httpx loads the CA bundle (~45 ms of CPU) for each client not given a context: an agent episode
    that opened two spent more of the driver's CPU on that than on anything else."""
    import ast
    from pathlib import Path

    root = Path(net.__file__).resolve().parents[1]
    missing = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "httpx":
                if f.attr in CALLS and not any(k.arg == "verify" for k in node.keywords):
                    missing.append(f"{path.relative_to(root.parent)}:{node.lineno} httpx.{f.attr}")
    assert not missing, "pass verify=tls_context() (furlong/core/net.py):\n" + "\n".join(missing)


def test_clients_share_one_context_built_once(monkeypatch):
    import ssl

    import httpx._config
    import httpx._transports.default

    from furlong.core.client import EngineClient, EngineControl

    monkeypatch.setattr(httpx._transports.default, "create_ssl_context", httpx._config.create_ssl_context)  # conftest's
    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    net.tls_context.cache_clear()
    try:
        for _ in range(5):
            EngineControl("http://127.0.0.1:1")
            EngineClient("http://127.0.0.1:1")
        assert len(built) == 1
        assert net.tls_context() is net.tls_context()
    finally:
        net.tls_context.cache_clear()
