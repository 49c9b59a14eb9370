"""`torch.profiler` in every process of a run, switched on by one environment variable.

`furlong profile` sets `FURLONG_PROFILE_DIR` before it starts the run; every process inherits it
(Ray workers and the engine and router subprocesses are started from the driver's environment),
and each one that calls `start(name)` profiles until `stop()` (or its exit) and writes
`<dir>/<name>-<pid>.json`, a Chrome trace. Without the variable both calls do nothing, so the
hooks cost nothing in a normal run. `furlong.profile` merges the files into one trace.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROFILE_ENV = "FURLONG_PROFILE_DIR"
_active: dict[str, Any] = {}


def start(name: str) -> bool:
    """Start profiling the calling thread (the profiler sees the thread that starts it) as `name` when
    `FURLONG_PROFILE_DIR` is set; True if it started. Call `stop()` from the same thread."""
    out = os.environ.get(PROFILE_ENV)
    if not out or _active:
        return False
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, record_shapes=False, with_stack=False)
    prof.__enter__()
    _active.update(prof=prof, path=Path(out) / f"{name}-{os.getpid()}.json", thread=threading.get_ident())
    atexit.register(stop)
    return True


def on_sigterm(fn: Callable[[], Any]) -> None:
    """Under profiling, run `fn` (which must end in `stop()`) before this process dies of SIGTERM.

    A server stopped with SIGTERM never reaches atexit: uvicorn re-raises the signal once it has shut
    down, with the handler it found before it started; this installs that handler (main thread only).
    """
    if not os.environ.get(PROFILE_ENV) or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return

    def handler(signum: int, _frame: Any) -> None:
        fn()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


def stop() -> Path | None:
    """Stop and write the trace (idempotent); its path, or None when this thread profiled nothing.

    Only the thread that started the profiler stops it: a colocated engine's scheduler thread, inside
    a trainer rank that profiles itself, leaves the rank's profiler alone."""
    if not _active or _active["thread"] != threading.get_ident():
        return None
    prof, path = _active.pop("prof"), _active.pop("path")
    _active.clear()
    prof.__exit__(None, None, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path
