"""The command line that puts a local sandbox run in its own namespaces: bwrap, and setpriv when root.

Why bubblewrap: it is the small, audited tool (Flatpak's) that makes user, PID, mount, network,
IPC and UTS namespaces as an unprivileged user; doing the same by hand (unshare, uid maps,
pivot_root) between fork and exec is where sandboxes get things wrong. Inside:

- a root with only `/usr` (and the `/bin`, `/lib*` links into it), the Python install and its
  venv, read-only, and the run's directory, writable: no home, no run directory, no `/etc`
  credentials, no `/run` or `/tmp` Unix sockets of the host (the network namespace also hides
  abstract ones);
- a private `/tmp`, a fresh `/proc` (the sandbox's own processes only) and a minimal `/dev`;
- `--die-with-parent` (the sandbox dies with the trainer), `--new-session` (no terminal
  injection), `--disable-userns` (no nested namespaces to escape limits from);
- no network unless `envs.network` (then DNS and CA files are bound too).

As root, the run first becomes a throw-away uid (`setpriv`), so that even what bwrap lets
through meets file permissions, and bwrap then runs unprivileged like for anyone else.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

NAMESPACES = "user,pid,mount,net,ipc,uts"
_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates")
_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class SandboxUnavailable(RuntimeError):
    """The local sandbox cannot isolate on this machine; running untrusted code is refused (message says why)."""


def python_roots(python: str) -> list[str]:
    """The directories an interpreter needs: its install (prefix of the resolved binary) and its venv, if any."""
    roots = []
    venv = Path(python).absolute().parent.parent
    if (venv / "pyvenv.cfg").is_file():  # a venv: itself, and the install it was made from (`home`)
        roots.append(str(venv))
        for line in (venv / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                home = Path(os.path.realpath(value.strip()))
                roots.append(str(home.parent if home.name == "bin" else home))
    real = Path(os.path.realpath(python))
    roots.append(str(real.parent.parent if real.parent.name == "bin" else real.parent))
    return [r for r in dict.fromkeys(roots) if r != "/usr" and not r.startswith("/usr/")]


def setpriv_argv(uid: int) -> list[str]:
    """Become `uid` (no groups, no capabilities) before exec: root's way into an unprivileged sandbox."""
    return [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def bwrap_argv(bwrap: str, python: str, workdir: str, *, network: bool) -> list[str]:
    """bwrap's options for one run in `workdir` (bound at the same path, the working directory)."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"]
    argv += ["--share-net"] if network else []
    argv += ["--hostname", "sandbox", "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for link in _ROOT_LINKS:
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    argv += ["--ro-bind-try", "/etc/localtime", "/etc/localtime"]
    for path in _NETWORK_FILES if network else ():
        argv += ["--ro-bind-try", path, path]
    for root in python_roots(python):
        argv += ["--ro-bind", root, root]
    return argv + ["--bind", workdir, workdir, "--chdir", workdir, "--"]


_PROBES: dict[tuple[str | None, str, bool], str | None] = {}  # (bwrap, python, not root) -> what is missing


def _missing_bwrap(bwrap: str | None) -> str | None:
    if bwrap and os.access(bwrap, os.X_OK):
        return None
    return (
        f"bubblewrap ({bwrap or 'bwrap'}) not found: install it (`make setup`, or `apt-get install bubblewrap`)"
        if not bwrap
        else f"bubblewrap not executable at {bwrap}"
    )


async def probe(bwrap: str | None, python: str, uid: int | None) -> str | None:
    """None when bwrap can build this sandbox here (tried once per interpreter and uid), else what is missing."""
    if uid is not None and not shutil.which("setpriv"):  # not even unsafe_allow runs code as root
        raise SandboxUnavailable("setpriv (util-linux) not found: as root the sandbox must drop to a throw-away uid")
    key = (bwrap, python, uid is None)
    if key not in _PROBES:
        _PROBES[key] = await _probe(bwrap, python, uid)
    return _PROBES[key]


async def _probe(bwrap: str | None, python: str, uid: int | None) -> str | None:
    if missing := _missing_bwrap(bwrap):
        return missing
    workdir = tempfile.mkdtemp(prefix="furlong-sandbox-probe-")
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        argv = (setpriv_argv(uid) if uid is not None else []) + bwrap_argv(bwrap, python, workdir, network=False)
        proc = await asyncio.create_subprocess_exec(
            *argv, python, "-I", "-c", "pass", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return "bwrap did not start a sandbox within 30 s"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if proc.returncode == 0:
        return None
    return (
        f"bwrap could not build the sandbox's user, PID, mount and network namespaces "
        f"({err.decode(errors='replace').strip() or f'exit code {proc.returncode}'}); unprivileged user namespaces "
        "may be off: see sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone, or on Ubuntu "
        "kernel.apparmor_restrict_unprivileged_userns"
    )


def refusal(missing: str) -> str:
    """The message `run` raises with when the sandbox cannot isolate, and how to opt out."""
    return (
        f"LocalSandbox refuses to run untrusted code: {missing}. Without namespaces, model code could signal "
        "the trainer and read the run's token and your credentials. Set envs.sandbox_unsafe_allow=true (or "
        "LocalSandbox(unsafe_allow=True)) to run it anyway with rlimits and Landlock only."
    )


def default_bwrap() -> str | None:
    """bwrap on PATH, or in /usr/bin where PATH is trimmed."""
    return shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin") or None


def interpreter_usable_by_others(path: str = sys.executable) -> bool:
    """Whether a user with no special rights can execute `path` (every parent directory searchable)."""
    p = Path(path).resolve()
    if not p.exists() or not p.stat().st_mode & 0o001:
        return False
    return all(d.stat().st_mode & 0o001 for d in p.parents)
