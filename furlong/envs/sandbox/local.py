"""The local process sandbox: untrusted code in a separate, limited, isolated process.

Why a process and not `exec`: model-written code can loop forever, fork-bomb,
allocate 10 GB, write over the checkout or call the network. Each of those must
hurt only the sandbox, never the trainer, the engine or the host, and the reward
must learn *what happened* (timeout, memory, killed) rather than crash.

Each `run(code)` writes the code into a fresh temporary directory and starts
`python -E -s main.py` there (its directory importable), in its own session (process group), with, applied in
`preexec_fn` between fork and exec:

- **limits** (`resource.setrlimit`): CPU seconds, address space (memory), file
  size, open files, core dumps off, and a process count (RLIMIT_NPROC) that stops
  a fork bomb at `max_procs`;
- **no network**: a new, empty network namespace (`unshare(CLONE_NEWNET)`; without
  privileges, inside a new user namespace); where namespaces are refused, Landlock
  (Linux >= 6.7) denies TCP connect and bind; where neither works the result says
  `network: "unavailable"` — never a silent claim of isolation;
- **no writes outside the temp dir**: Landlock allows writes only beneath it (and
  to /dev/null); when running as root the code also runs as a throw-away uid (so
  file permissions and RLIMIT_NPROC apply: root ignores RLIMIT_NPROC);
- **a wall-clock timeout**: the whole process group is killed, and when running
  under a throw-away uid every process of that uid is killed too (a child that
  left the group with `setsid` cannot escape).

Output is read as it comes and capped at `max_output_bytes` per stream, so a
program printing forever cannot fill the trainer's memory. The result reports
each isolation layer that was actually in force (`isolation`), measured in the
child, not assumed.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import resource
import shutil
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.envs.sandbox.base import SandboxLimits, check_names, result_status

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig

_LIBC = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_NO_NEW_PRIVS = 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
# Landlock filesystem rights that change the filesystem (reads and execution stay allowed everywhere).
LL_WRITE_FILE, LL_TRUNCATE = 1 << 1, 1 << 14
LL_WRITES_V1 = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make *
LL_REFER = 1 << 13  # ABI 2
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
UID_RANGE = (200_000, 2_000_000_000)  # throw-away uids for sandboxes run as root


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, or 0 when Landlock is not available."""
    _LIBC.syscall.restype = ctypes.c_long
    version = _LIBC.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(version), 0)


LANDLOCK_ABI = landlock_abi()


def _world_usable(path: str) -> bool:
    """Whether a user with no special rights can execute `path` (every parent dir searchable)."""
    p = Path(path).resolve()
    if not p.exists() or not p.stat().st_mode & stat.S_IXOTH:
        return False
    return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)


def default_python() -> str:
    """The interpreter for sandboxed code: this one, unless a throw-away uid could not run it."""
    if os.geteuid() != 0 or _world_usable(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_usable(candidate):
            return candidate
    raise RuntimeError("LocalSandbox: no python3 that an unprivileged uid can run; pass python=")


def _isolate(limits: SandboxLimits, workdir: str, uid: int | None, report_fd: int) -> None:
    """Runs in the child between fork and exec. Only os/resource/ctypes calls: no imports, no locks."""
    done: dict[str, Any] = {}
    cpu = int(limits.timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    fsize = limits.max_file_mb * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.network:
        done["network"] = "allowed"
    elif _LIBC.unshare(CLONE_NEWNET) == 0:
        done["network"] = "namespace"
    elif uid is None and _LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        done["network"] = "user+net namespace"
    if uid is not None:  # root: become a throw-away uid so NPROC and file permissions apply
        os.setgroups([])
        os.setgid(uid)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))
        os.setuid(uid)
        done["uid"] = uid
    else:  # RLIMIT_NPROC counts every process of this uid, so allow those already running
        mine = sum(1 for p in os.listdir("/proc") if p.isdigit() and _owned(p))
        resource.setrlimit(resource.RLIMIT_NPROC, (mine + limits.max_procs, mine + limits.max_procs))
    done["filesystem"] = (
        "landlock"
        if _landlock(workdir, net=not limits.network and "network" not in done)
        else ("uid" if uid is not None else "unavailable")
    )
    if "network" not in done:
        done["network"] = "landlock-tcp" if done["filesystem"] == "landlock" and LANDLOCK_ABI >= 4 else "unavailable"
    os.write(report_fd, json.dumps(done).encode())
    os.close(report_fd)


def _owned(pid: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _landlock(workdir: str, *, net: bool) -> bool:
    """Allow writes only beneath `workdir` (and /dev/null); with `net`, deny TCP too. False if refused."""
    if LANDLOCK_ABI < 1:
        return False
    fs = LL_WRITES_V1 | (LL_REFER if LANDLOCK_ABI >= 2 else 0) | (LL_TRUNCATE if LANDLOCK_ABI >= 3 else 0)
    attr = _RulesetAttr(fs, (LL_NET_BIND_TCP | LL_NET_CONNECT_TCP) if net and LANDLOCK_ABI >= 4 else 0)
    size = ctypes.sizeof(_RulesetAttr) if LANDLOCK_ABI >= 4 else 8
    ruleset = _LIBC.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return False
    try:
        for path, rights in ((workdir, fs), ("/dev/null", LL_WRITE_FILE | (LL_TRUNCATE if LANDLOCK_ABI >= 3 else 0))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(rights, fd)
                if _LIBC.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
                    return False
            finally:
                os.close(fd)
        if _LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return False
        return _LIBC.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) == 0
    finally:
        os.close(ruleset)


async def _read_capped(stream: asyncio.StreamReader, cap: int, kept: bytearray) -> bool:
    """Read a stream to its end into `kept`, keeping the first `cap` bytes (draining the rest so the
    child never blocks on a full pipe); returns whether anything was dropped."""
    truncated = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        truncated |= len(chunk) > room
        kept += chunk[: max(room, 0)]
    return truncated


def _kill_all(pgid: int, uid: int | None) -> None:
    """Kill the process group and, under a throw-away uid, every process of that uid."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if uid is None:
        return
    pid = os.fork()  # a reaper that becomes the uid: kill(-1) then reaches exactly that uid's processes
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _workdir(files: dict[str, str], uid: int | None) -> str:
    """A fresh directory holding `files`, owned by `uid` when the sandbox drops to one (as root)."""
    workdir = tempfile.mkdtemp(prefix="furlong-sandbox-")
    for name, text in files.items():
        target = Path(workdir) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    if uid is not None:
        for root, dirs, names in os.walk(workdir):
            for p in [root, *(os.path.join(root, n) for n in dirs + names)]:
                os.chown(p, uid, uid)
    return workdir


class LocalSandbox:
    """The default sandbox provider (`envs.sandbox: local`); see the module docstring."""

    def __init__(self, limits: SandboxLimits | None = None, *, python: str | None = None):
        self.limits = limits or SandboxLimits()
        self.python = python or default_python()

    @classmethod
    def from_config(cls, envs: EnvsConfig) -> LocalSandbox:
        """From the `envs` config section (timeout_s, memory_mb, max_output_bytes, network)."""
        return cls(SandboxLimits.from_config(envs))

    async def run(
        self, code: str, *, timeout_s: float | None = None, files: dict[str, str] | None = None, stdin: str = ""
    ) -> dict[str, Any]:
        """Run `code` as `main.py` (beside `files`); returns stdout, stderr, exit_code, status and isolation.

        `status` is one of ok | error | timeout | memory | killed: what a reward needs to
        tell a wrong answer from a contained escape attempt.
        """
        limits = SandboxLimits(**{**self.limits.__dict__, "timeout_s": timeout_s or self.limits.timeout_s})
        files = {**(files or {}), "main.py": code}
        check_names(files, "LocalSandbox.run")
        uid = random.randrange(*UID_RANGE) if os.geteuid() == 0 else None
        workdir = _workdir(files, uid)
        read_fd, write_fd = os.pipe()
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python,
                "-E",
                "-s",
                "main.py",
                cwd=workdir,
                env=env,
                start_new_session=True,
                pass_fds=(write_fd,),
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                preexec_fn=lambda: _isolate(limits, workdir, uid, write_fd),
            )
        except BaseException:
            os.close(read_fd)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            os.close(write_fd)
        try:
            isolation = json.loads(os.read(read_fd, 4096) or b"{}")
        finally:
            os.close(read_fd)
        out, err = bytearray(), bytearray()
        reads = asyncio.gather(
            _read_capped(proc.stdout, limits.max_output_bytes, out),
            _read_capped(proc.stderr, limits.max_output_bytes, err),
        )

        async def main_exit() -> int:
            """main.py's exit status. Not `proc.wait()`: that also waits for the pipes to close,
            which a child that outlives main.py would hold open until the timeout."""
            if stdin:
                proc.stdin.write(stdin.encode())
                proc.stdin.close()
            delay = 0.001
            while proc.returncode is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.02)
            return proc.returncode

        timed_out = escaped = False
        try:
            code_ = await asyncio.wait_for(main_exit(), limits.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:  # also reaches children that outlived main.py and still hold its pipes open
            _kill_all(proc.pid, uid)
            try:
                code_ = await main_exit()
                out_cut, err_cut = await asyncio.wait_for(asyncio.shield(reads), 2.0)
            except TimeoutError:  # not root: a child that left the process group keeps the pipes open
                escaped, out_cut, err_cut = True, False, False
                reads.cancel()
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        stderr = err.decode(errors="replace")
        status = result_status(timed_out, code_, stderr)
        return {
            "stdout": out.decode(errors="replace"),
            "stderr": stderr,
            "exit_code": code_,
            "status": status,
            "timed_out": timed_out,
            "truncated": out_cut or err_cut,
            "duration_s": time.monotonic() - start,
            "isolation": isolation,
            "escaped_processes": escaped,
        }

    async def close(self) -> None:
        """Nothing persists between runs: each has its own directory, removed when it ends."""
