"""What the remote sandbox providers (E2B, Daytona) share: one machine per provider, one runner per run.

A provider instance creates its remote sandbox on the first `run()` (creation takes
seconds, a run should not) and reuses it; each run gets its own directory there,
removed when it ends, and `close()` deletes the machine. Every run sends
`runner.py` with the job (see that file): the result is the same dict
`LocalSandbox.run` returns, with `isolation` saying what the provider enforces.

Limits, and who enforces them:
- `timeout_s`: the runner kills the program's process group at the deadline
  (`status: timeout`); the SDK call itself is bounded by `timeout_s + grace_s`,
  so a sandbox that stops answering also ends in `timeout`, never a hang.
- `max_output_bytes`: the runner keeps that much of each stream inside the
  sandbox; the client cuts again, so no provider can hand back more.
- `memory_mb`: RLIMIT_AS on the program, as locally.
- `network`: asked of the provider when the machine is created.

A machine that disappeared (killed by its provider's lifetime limit, deleted from
a dashboard) is created anew once and the run retried; any other SDK failure is
raised with the provider's name, not reported as a wrong answer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shlex
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.envs.sandbox.base import SandboxLimits, check_names, result_status
from furlong.envs.sandbox.runner import MARK as RESULT_MARK

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig

RUNNER_SOURCE = (Path(__file__).parent / "runner.py").read_text()  # sent as the command, never imported there
INLINE_COMMAND_BYTES = 100_000  # one argv string must stay under Linux's 128 KiB MAX_ARG_STRLEN


def missing_sdk(provider: str, package: str) -> ImportError:
    return ImportError(
        f"envs.sandbox: {provider} needs the {package!r} package: "
        f"pip install 'furlong[envs]' (or pip install {package})"
    )


def runner_command(python: str, job_arg: str) -> str:
    return f"{python} -I -c {shlex.quote(RUNNER_SOURCE)} {shlex.quote(job_arg)}"


def _cut(text: str, cap: int) -> tuple[str, bool]:
    data = text.encode()
    return (data[:cap].decode(errors="ignore"), True) if len(data) > cap else (text, False)


def parse_result(provider: str, exit_code: int | None, stdout: str, stderr: str, cap: int) -> dict[str, Any]:
    """The runner's JSON line from the command's output, as `LocalSandbox.run`'s result dict."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(RESULT_MARK)), None)
    if line is None:
        tail = (stdout + stderr)[-2000:]
        raise RuntimeError(
            f"{provider} sandbox: the runner printed no result (exit code {exit_code}); is "
            f"python3 in the sandbox image? Output:\n{tail}"
        )
    r = json.loads(line[len(RESULT_MARK) :])
    r["stdout"], cut_out = _cut(r["stdout"], cap)
    r["stderr"], cut_err = _cut(r["stderr"], cap)
    r["truncated"] = bool(r["truncated"] or cut_out or cut_err)
    r["status"] = result_status(r["timed_out"], r["exit_code"], r["stderr"])
    return r


def timeout_result(start: float, why: str) -> dict[str, Any]:
    return {
        "stdout": "",
        "stderr": why,
        "exit_code": -9,
        "status": "timeout",
        "timed_out": True,
        "truncated": False,
        "duration_s": time.monotonic() - start,
        "escaped_processes": False,
    }


class SandboxGone(Exception):
    """The remote machine no longer exists: create a new one."""


class RemoteSandbox:
    """Base of the E2B and Daytona providers: the run protocol; subclasses talk to their SDK."""

    provider = "remote"

    def __init__(self, limits: SandboxLimits | None = None, *, python: str = "python3", grace_s: float = 30.0):
        self.limits = limits or SandboxLimits()
        self.python, self.grace_s = python, grace_s
        self._box: Any = None
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(cls, envs: EnvsConfig, **kw: Any) -> RemoteSandbox:
        """From the `envs` config section (timeout_s, memory_mb, max_output_bytes, network)."""
        return cls(SandboxLimits.from_config(envs), **kw)

    # -- what a provider implements ---------------------------------------------------------
    async def _create(self) -> Any:
        raise NotImplementedError

    async def _exec(self, box: Any, command: str, timeout_s: float) -> tuple[int | None, str, str]:
        """Run a shell command; (exit code, stdout, stderr). Raises TimeoutError, SandboxGone."""
        raise NotImplementedError

    async def _upload(self, box: Any, path: str, data: bytes) -> None:
        raise NotImplementedError

    async def _delete(self, box: Any) -> None:
        raise NotImplementedError

    def _isolation(self, box: Any) -> dict[str, Any]:
        raise NotImplementedError

    # -- the shared protocol ------------------------------------------------------------------
    async def _machine(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            raise RuntimeError(
                f"{type(self).__name__} is bound to the event loop that first used it; "
                "create one provider per event loop"
            )
        self._loop = loop
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._box is None:
                self._box = await self._create()
            return self._box

    async def run(
        self, code: str, *, timeout_s: float | None = None, files: dict[str, str] | None = None, stdin: str = ""
    ) -> dict[str, Any]:
        """Run `code` as `main.py` (beside `files`) in the remote sandbox; the same result dict as LocalSandbox."""
        files = {**(files or {}), "main.py": code}
        check_names(files, "sandbox run")
        timeout = timeout_s or self.limits.timeout_s
        job = json.dumps(
            {
                "files": files,
                "stdin": stdin,
                "timeout_s": timeout,
                "memory_mb": self.limits.memory_mb,
                "max_output_bytes": self.limits.max_output_bytes,
            }
        ).encode()
        start = time.monotonic()
        for attempt in (0, 1):
            box = await self._machine()
            try:
                command = runner_command(self.python, base64.b64encode(job).decode())
                if len(command) > INLINE_COMMAND_BYTES:
                    path = f"/tmp/furlong-job-{uuid.uuid4().hex}.json"
                    await self._upload(box, path, job)
                    command = runner_command(self.python, "@" + path)
                code_, out, err = await asyncio.wait_for(
                    self._exec(box, command, timeout + self.grace_s), timeout + self.grace_s + 5.0
                )
                break
            except SandboxGone:
                if self._box is box:
                    self._box = None
                if attempt:
                    raise
            except TimeoutError:
                return {
                    **timeout_result(start, f"{self.provider}: no answer within {timeout + self.grace_s:.0f}s"),
                    "isolation": self._isolation(box),
                }
        result = parse_result(self.provider, code_, out, err, self.limits.max_output_bytes)
        return {**result, "duration_s": time.monotonic() - start, "isolation": self._isolation(box)}

    async def close(self) -> None:
        """Delete the remote machine (if one was created); a later run creates a new one."""
        box, self._box = self._box, None
        if box is not None:
            await self._delete(box)
