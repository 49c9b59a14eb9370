"""Network helpers every process needs: a free port on a host, one TLS context for every HTTP client.

Why not simply bind port 0 and hand the number on: the OS picks that port
from its ephemeral range (`ip_local_port_range`), the range it also draws from
for every outgoing connection of every process. Between the probe and the real
bind (a child process starting, a gloo store forming) an outgoing connection
can take the port and the bind fails with EADDRINUSE. A port outside the
ephemeral range is never handed to `connect()`, so `free_port` draws there at
random (not below 20000: Ray's worker ports are 10002-19999) and probes it.
"""

from __future__ import annotations

import functools
import random
import socket
import ssl
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000
_TRIES = 64


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's setting; the IANA range where it cannot be read)."""
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the ephemeral range so no outgoing connection takes it before we bind."""
    lo, hi = ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST, lo - 1), (hi + 1, 65535)) if a <= b]
    draw = random.SystemRandom()  # not the seeded module RNG: processes seeded alike would draw the same ports
    for _ in range(_TRIES if spans else 0):
        a, b = draw.choice(spans)
        port = draw.randint(a, b)
        if _bindable(host, port):
            return port
    with socket.socket() as s:  # every draw taken (or no room outside the range): the OS's choice
        s.bind((host, 0))
        return s.getsockname()[1]


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one TLS context: pass it as `verify=` to every httpx client and module-level call.

    Why: httpx builds a fresh context for each client it is not handed one, and loading the CA
    bundle costs ~45 ms of CPU. The calculator agent recipe opened two clients per episode, and
    that alone took 55% of the driver's CPU (1,541 of 2,771 py-spy samples over its RL steps);
    a health poll every 0.1 s spent a third of a core on it while the process it waited for started.
    """
    import httpx

    return httpx.create_ssl_context()
