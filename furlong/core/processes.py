"""A server process that furlong starts, health-checks, kills and restarts.

Engines and the router are HTTP servers in processes of their own (one
responsibility per process). `ManagedProcess` owns one: it starts the command in
a new process group (so a kill takes its children too), waits for `GET /health`,
and on `stop()` sends SIGTERM then SIGKILL. It is a plain class so the same code
runs under a Ray actor on a cluster node and directly in tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from furlong.core.net import tls_context

ADMIN_TOKEN_ENV = "FURLONG_ADMIN_TOKEN"  # how a server furlong starts gets the run's admin token


class Command(list):
    """An argv plus the environment its process needs: secrets travel in `env`, never in the argv.

    Any local user reads every process's `/proc/<pid>/cmdline`, but only the process's own
    user reads its `/proc/<pid>/environ`. A `Command` is still a list (every caller that
    builds, inspects or pickles an argv keeps working, Ray included), and `ManagedProcess`
    adds its `env` to the child's environment.
    """

    def __init__(self, argv: list[str] = (), env: dict[str, str] | None = None):
        super().__init__(argv)
        self.env = dict(env or {})

    def __repr__(self) -> str:  # never print a secret: the values of `env` are left out
        return f"Command({list(self)!r}, env={sorted(self.env)})"


def token_env(admin_token: str | None) -> dict[str, str]:
    """The environment entry that hands `admin_token` to a furlong server (empty when there is none)."""
    return {ADMIN_TOKEN_ENV: admin_token} if admin_token else {}


def thread_env(threads: int | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment that caps a child's math threads, so N processes share the cores instead of fighting.

    `extra` (a child's own variables, e.g. its admin token) is added last.
    """
    env = dict(os.environ)
    if threads:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL when the thread that started it ends (see `spawn`), so a killed
    driver or actor never leaves an engine behind holding its port and memory."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def spawn(argv: list[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv, **popen)` whose child dies with this process, and only then.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process:
    a server started from `asyncio.to_thread` (or any short-lived worker thread) was killed
    the moment that thread's executor shut down, while this process still held its URL.
    So a child started off the main thread is forked by one long-lived spawner thread,
    which lives as long as the process does.
    """
    popen["preexec_fn"] = _die_with_parent
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(argv, **popen)
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="furlong-spawner")
    return _spawner.submit(subprocess.Popen, argv, **popen).result()


class ProcessFailed(RuntimeError):
    """A managed process exited or never became healthy; the message carries its log tail."""


class ManagedProcess:
    """One server process: started, health-waited, stopped and restarted with the same command.

    `env` adds variables to the child's environment (over this process's own), after those
    of a `Command` argv; this is how a secret such as the admin token reaches the child
    without appearing in its command line.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        url: str,
        log_path: str | Path,
        threads: int | None = None,
        env: dict[str, str] | None = None,
    ):
        self.name, self.argv, self.url = name, list(argv), url
        self.env = {**getattr(argv, "env", {}), **(env or {})}
        self.log_path = Path(log_path)
        self.threads = threads
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 120.0) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = spawn(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=thread_env(self.threads, self.env),
            start_new_session=True,
        )
        log.close()
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, verify=tls_context()) as http:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise ProcessFailed(f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise ProcessFailed(f"{self.name} not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 5.0) -> None:
        if not self.alive():
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(5)

    def restart(self, timeout_s: float = 120.0) -> None:
        self.stop(grace_s=1.0)
        self.restarts += 1
        self.start(timeout_s)


def furlong_argv(*args: str) -> list[str]:
    """`python -m furlong.cli ...` with this interpreter, so children use the same environment."""
    return [sys.executable, "-m", "furlong.cli", *args]


REAPER_MARK = "FURLONG_REAP_MARK"
_REAPER_PIPES: list[int] = []  # write ends, open until this process ends: their EOF tells each reaper


def reaper_mark() -> str:
    """A mark unique to this driver, for `os.environ[REAPER_MARK]` while it starts the processes to reap."""
    return f"{os.getpid()}-{time.time_ns()}"


def start_reaper(mark: str, session_dir: str) -> None:
    """Kill, once this process is gone, every process that carries `mark` or has a file open under `session_dir`.

    The driver starts a local Ray with the mark in its environment, which Ray's head
    processes pass on to the workers, engines and router below them; Ray's agents
    retitle themselves (setproctitle can overwrite `/proc/<pid>/environ`), but keep
    their logs open in the Ray session directory. A driver that exits normally shuts
    Ray down itself; a SIGKILLed (or OOM-killed) one cannot, and Ray's own fate-sharing
    takes the GCS, raylet and workers down but not the dashboard and runtime-env
    agents, which hang reporting the raylet's death to the dead GCS. The reaper is a
    small process in its own session, waiting for EOF on a pipe only this process holds.
    """
    read_end, write_end = os.pipe()  # both non-inheritable: no child keeps the driver "alive"
    subprocess.Popen(
        [sys.executable, "-c", f"from furlong.core.processes import reap; reap({mark!r}, {session_dir!r})"],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.close(read_end)
    _REAPER_PIPES.append(write_end)


def _marked(pid: str, needle: bytes, session_dir: str) -> bool:
    def under_session(fd: str) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/fd/{fd}").startswith(session_dir)
        except OSError:  # closed meanwhile
            return False

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if needle in f.read().split(b"\0"):
                return True
        return any(map(under_session, os.listdir(f"/proc/{pid}/fd")))
    except OSError:  # gone, or not ours to read
        return False


def reap(mark: str, session_dir: str) -> None:
    """The reaper's body (see `start_reaper`): wait for the driver to end, then SIGKILL what it left."""
    sys.stdin.buffer.read()
    needle, session_dir = f"{REAPER_MARK}={mark}".encode(), session_dir.rstrip("/") + "/"
    for _ in range(20):  # a dying raylet may still spawn a worker: scan until nothing is left
        found = [
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit() and int(p) != os.getpid() and _marked(p, needle, session_dir)
        ]
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)
