"""What every sandbox provider shares: the limits, the contract, the file-name check and the result status.

The contract itself (`run(code, *, timeout_s, ...)` -> result dict, `close()`) is the
`envs.sandbox_factory` plug point's `Sandbox` protocol in the registry: one owner,
so a custom provider and the built-in ones are checked against the same thing.
Every provider returns the same result dict (stdout, stderr, exit_code, status,
timed_out, truncated, duration_s, isolation, escaped_processes), so a reward reads
it the same wherever the code ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.config.protocols import Sandbox  # plug points are declared once, in config/protocols.py

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig

__all__ = ["Sandbox", "SandboxLimits", "check_names", "result_status"]


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock
    memory_mb: int = 1024  # address space
    max_procs: int = 32  # processes and threads of the sandbox's uid
    max_output_bytes: int = 65536  # per stream
    max_file_mb: int = 64  # largest file the code may write
    max_open_files: int = 256
    network: bool = False  # allow network

    @classmethod
    def from_config(cls, envs: EnvsConfig) -> SandboxLimits:
        """From the `envs` config section (timeout_s, memory_mb, max_output_bytes, network)."""
        return cls(
            timeout_s=envs.timeout_s,
            memory_mb=envs.memory_mb,
            max_output_bytes=envs.max_output_bytes,
            network=envs.network,
        )


def check_names(files: dict[str, str], who: str) -> None:
    """Refuse a file name that would be written outside the run's directory (ValueError naming `who`)."""
    for name in files:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{who}: file name {name!r} leaves the sandbox directory")


def result_status(timed_out: bool, exit_code: int, stderr: str) -> str:
    """ok | error | timeout | memory | killed: what a reward needs to tell a wrong answer from a contained escape."""
    if timed_out:
        return "timeout"
    if exit_code == 0:
        return "ok"
    if "MemoryError" in stderr:
        return "memory"
    return "killed" if exit_code < 0 else "error"
