"""The local process sandbox: untrusted code in a separate, limited process in namespaces of its own.

Why a process and not `exec`: model-written code can loop forever, fork-bomb, allocate 10 GB,
write over the checkout, call the network, `kill(-1)` every process of its user or read the
run's admin token and the user's SSH keys. Each of those must hurt only the sandbox, never
the trainer, the engine or the host, and the reward must learn *what happened* (timeout,
memory, killed) rather than crash.

Each `run(code)` writes the code into a fresh temporary directory and starts, in its own
session (process group):

    [setpriv --reuid=THROWAWAY (as root)] bwrap OPTIONS -- python -I -c CHILD CONFIG

- **bwrap** (`jail.py`) gives user, PID, mount, network, IPC and UTS namespaces without root:
  the code sees only `/usr`, the Python install and its own directory (no home, no run
  directory, no host `/tmp` or Unix sockets), a `/proc` with only its own processes, and no
  network (unless `envs.network`). As root it first becomes a throw-away uid.
- **CHILD** (`child.py`, standard library only) sets the rlimits (CPU seconds, address space
  = `envs.memory_mb`, file size, open files, no core dumps, tasks = `max_procs`) and
  Landlock, reports what is in force, then runs `main.py` and reports its real exit status.
  The parent runs no Python between fork and exec (no `preexec_fn`): that would risk a
  deadlock in a threaded trainer, and RLIMIT_NPROC set there counted the trainer's threads.
- **a wall-clock timeout** kills bwrap, and with it (`--die-with-parent`, the PID namespace's
  init) every process of the sandbox, also one that left the group with `setsid`.

Where bwrap or unprivileged user namespaces are missing, `run` raises `SandboxUnavailable`
naming the missing piece, unless `unsafe_allow` (`envs.sandbox_unsafe_allow`): then CHILD runs
without bwrap (rlimits, Landlock, an own network namespace where allowed, the throw-away uid
as root), and `isolation.namespaces` is empty.

Output is read as it comes and capped at `max_output_bytes` per stream, so a program printing
forever cannot fill the trainer's memory. `isolation` in the result reports each layer that
was in force, measured in the child, not assumed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.envs.sandbox import jail
from furlong.envs.sandbox.base import SandboxLimits, check_names, result_status
from furlong.envs.sandbox.jail import SandboxUnavailable

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig

__all__ = ["LocalSandbox", "SandboxUnavailable", "default_python"]

log = logging.getLogger(__name__)
UID_RANGE = (200_000, 2_000_000_000)  # throw-away uids for sandboxes run as root
CHILD_SOURCE = (Path(__file__).parent / "child.py").read_text()
_WARNED: set[str] = set()  # one warning per missing piece and process, not one per run


def default_python() -> str:
    """The interpreter for sandboxed code: this one, unless a throw-away uid could not run it."""
    if os.geteuid() != 0 or jail.interpreter_usable_by_others(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if jail.interpreter_usable_by_others(candidate):
            return candidate
    raise RuntimeError("LocalSandbox: no python3 that an unprivileged uid can run; pass python=")


async def _read_capped(stream: asyncio.StreamReader, cap: int, kept: bytearray) -> bool:
    """Read a stream to its end into `kept`, keeping the first `cap` bytes (draining the rest so the
    child never blocks on a full pipe); returns whether anything was dropped."""
    truncated = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        truncated |= len(chunk) > room
        kept += chunk[: max(room, 0)]
    return truncated


async def _pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """An asyncio reader for the read end of a pipe (the child's report), so waiting never blocks the loop."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader, transport


def _report(raw: bytearray) -> list[dict]:
    """The child's report lines (what is in force; then main.py's exit status); [] where it never started."""
    try:
        return [json.loads(line) for line in raw.decode(errors="replace").splitlines()[:2]]
    except ValueError:
        return []


async def _kill_uid(uid: int, python: str) -> None:
    """Without a PID namespace (unsafe_allow, as root): every process of the throw-away uid, via kill(-1)."""
    code = "import os, signal\nos.kill(-1, signal.SIGKILL)"
    proc = await asyncio.create_subprocess_exec(*jail.setpriv_argv(uid), python, "-I", "-c", code)
    await proc.wait()


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


def _exit_code(returncode: int, report: list[dict], jailed: bool) -> int:
    """main.py's exit status: the child's report; else (the child itself was killed) bwrap's, whose
    128+N means signal N."""
    if len(report) > 1 and isinstance(report[1].get("exit_code"), int):
        return report[1]["exit_code"]
    if jailed and report and returncode > 128:
        return 128 - returncode
    return returncode


class LocalSandbox:
    """The default sandbox provider (`envs.sandbox: local`); see the module docstring."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        python: str | None = None,
        unsafe_allow: bool = False,
        bwrap: str | None = None,
    ):
        self.limits = limits or SandboxLimits()
        self.python = python or default_python()
        self.unsafe_allow = unsafe_allow
        self.bwrap = bwrap or jail.default_bwrap()

    @classmethod
    def from_config(cls, envs: EnvsConfig) -> LocalSandbox:
        """From the `envs` config section (timeout_s, memory_mb, max_output_bytes, network, sandbox_unsafe_allow)."""
        return cls(SandboxLimits.from_config(envs), unsafe_allow=envs.sandbox_unsafe_allow)

    async def _command(
        self, limits: SandboxLimits, workdir: str, uid: int | None, report_fd: int
    ) -> tuple[list[str], bool]:
        """The argv of one run and whether it is in bwrap: bwrap when it works here; else a refusal, or
        (unsafe_allow) the child alone."""
        missing = await jail.probe(self.bwrap, self.python, uid)
        if missing and not self.unsafe_allow:
            raise SandboxUnavailable(jail.refusal(missing))
        if missing and missing not in _WARNED:
            _WARNED.add(missing)
            log.warning("LocalSandbox without namespaces (envs.sandbox_unsafe_allow): %s", missing)
        conf = {
            "cpu_s": int(limits.timeout_s) + 1,
            "memory_bytes": limits.memory_mb * 2**20,
            "file_bytes": limits.max_file_mb * 2**20,
            "open_files": limits.max_open_files,
            "max_procs": limits.max_procs,
            "network": limits.network,
            "netns": not missing and not limits.network,
            "namespaces": "" if missing else jail.NAMESPACES,
            "uid": uid,
            "workdir": workdir,
            "python": self.python,
            "report_fd": report_fd,
        }
        argv = jail.setpriv_argv(uid) if uid is not None else []
        if not missing:
            argv += jail.bwrap_argv(self.bwrap, self.python, workdir, network=limits.network)
        return argv + [self.python, "-I", "-c", CHILD_SOURCE, json.dumps(conf)], not missing

    async def run(
        self, code: str, *, timeout_s: float | None = None, files: dict[str, str] | None = None, stdin: str = ""
    ) -> dict[str, Any]:
        """Run `code` as `main.py` (beside `files`); returns stdout, stderr, exit_code, status and isolation.

        `status` is one of ok | error | timeout | memory | killed: what a reward needs to
        tell a wrong answer from a contained escape attempt. Raises `SandboxUnavailable` where
        this machine cannot isolate the code and `unsafe_allow` is off.
        """
        limits = SandboxLimits(**{**self.limits.__dict__, "timeout_s": timeout_s or self.limits.timeout_s})
        files = {**(files or {}), "main.py": code}
        check_names(files, "LocalSandbox.run")
        uid = random.randrange(*UID_RANGE) if os.geteuid() == 0 else None
        workdir = _workdir(files, uid)
        read_fd, write_fd = os.pipe()
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        env |= {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        try:
            argv, jailed = await self._command(limits, workdir, uid, write_fd)
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=workdir,
                env=env,
                start_new_session=True,
                pass_fds=(write_fd,),
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except BaseException:
            os.close(read_fd)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            os.close(write_fd)
        report_reader, transport = await _pipe_reader(read_fd)
        try:
            result = await self._wait(proc, limits, stdin.encode(), report_reader, uid, jailed)
        finally:
            transport.close()
            shutil.rmtree(workdir, ignore_errors=True)
        return {**result, "duration_s": time.monotonic() - start}

    async def _wait(
        self,
        proc: Any,
        limits: SandboxLimits,
        stdin: bytes,
        report_reader: asyncio.StreamReader,
        uid: int | None,
        jailed: bool,
    ) -> dict[str, Any]:
        """Feed stdin, wait for the exit or the timeout, kill what is left, collect output and the report."""
        out, err, report_raw = bytearray(), bytearray(), bytearray()
        reads = asyncio.gather(
            _read_capped(proc.stdout, limits.max_output_bytes, out),
            _read_capped(proc.stderr, limits.max_output_bytes, err),
            _read_capped(report_reader, 1 << 16, report_raw),
        )

        async def exited() -> int:
            """The sandbox's exit status. Not `proc.wait()`: that also waits for the pipes to close,
            which a child that outlives main.py would hold open until the timeout."""
            delay = 0.001
            while proc.returncode is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.02)
            return proc.returncode

        if proc.stdin is not None:
            proc.stdin.write(stdin)
            proc.stdin.close()
        timed_out = escaped = False
        try:
            returncode = await asyncio.wait_for(exited(), limits.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:  # also reaches children that outlived main.py and still hold its pipes open
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if uid is not None and not jailed:
                await _kill_uid(uid, self.python)
            returncode = await exited()
            try:
                out_cut, err_cut, _ = await asyncio.wait_for(asyncio.shield(reads), 2.0)
            except TimeoutError:  # no PID namespace: a child that left the process group keeps the pipes open
                escaped, out_cut, err_cut = True, False, False
                reads.cancel()
        report = _report(report_raw)
        exit_code = _exit_code(returncode, report, jailed)
        stderr = err.decode(errors="replace")
        return {
            "stdout": out.decode(errors="replace"),
            "stderr": stderr,
            "exit_code": exit_code,
            "status": result_status(timed_out, exit_code, stderr),
            "timed_out": timed_out,
            "truncated": out_cut or err_cut,
            "isolation": report[0] if report else {},
            "escaped_processes": escaped,
        }

    async def close(self) -> None:
        """Nothing persists between runs: each has its own directory, removed when it ends."""
