"""The admin token of a standalone server (`furlong serve`, `furlong router`): where it comes from, and what
happens when there is none.

The token guards the control endpoints: whoever holds it can pause the engines or replace
the policy's weights (`/update_weights_from_disk`). It comes from, first found:

1. ``--admin-token-file PATH`` — a file readable by its owner only;
2. ``--admin-token T`` — still accepted for scripts, with a warning: a command line is
   readable by every local user (`ps`, `/proc/<pid>/cmdline`);
3. ``$FURLONG_ADMIN_TOKEN`` — how furlong hands it to the servers it starts (a process's
   environment is readable by its own user only).

Without any, a server bound to a loopback address serves its control endpoints open, with
a warning saying so; one bound to any other address (reachable from the network) generates
a token, stores it in a 0600 file and prints where, so it is never open by accident.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from pathlib import Path

from furlong.core.processes import ADMIN_TOKEN_ENV

log = logging.getLogger("furlong.admin_token")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server off the network (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def token_dir() -> Path:
    """Where generated tokens are kept: ``$XDG_CACHE_HOME/furlong/tokens`` (default ``~/.cache/furlong/tokens``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "furlong" / "tokens"


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path`, mode 0600, in a directory made 0700 if new; never through a symlink."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT: set it
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return path


def read_token_file(path: str) -> str:
    """The token in `path` (surrounding whitespace stripped); ValueError naming the file if unreadable or empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"admin_token_file: cannot read {path}: {e.strerror}") from None
    if not token:
        raise ValueError(f"admin_token_file: {path} is empty")
    return token


def resolve(prog: str, host: str, port: int, flag: str | None, file: str | None) -> str | None:
    """The token `prog` serves with (see the module docstring); None means control endpoints are open."""
    if file:
        return read_token_file(file)
    if flag:
        log.warning(
            "%s: --admin-token puts the token on the command line, where every local user can read it; "
            "use --admin-token-file PATH or $%s instead",
            prog,
            ADMIN_TOKEN_ENV,
        )
        return flag
    token = os.environ.get(ADMIN_TOKEN_ENV) or None
    if token is not None:
        return token
    if is_loopback(host):
        log.warning(
            "%s: no admin token: the control endpoints (pause, abort, weight updates) are open to every "
            "process on this machine; give one with --admin-token-file PATH or $%s",
            prog,
            ADMIN_TOKEN_ENV,
        )
        return None
    token = secrets.token_hex(32)
    path = write_private(token_dir() / f"{prog.split()[-1]}-{port}.token", token + "\n")
    print(
        f"{prog}: bound to {host}, off loopback, without an admin token: generated one and stored it in "
        f"{path} (mode 0600). Control endpoints need 'Authorization: Bearer <token>'; read it with: cat {path}",
        flush=True,
    )
    return token
