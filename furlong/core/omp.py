"""Free the OpenMP worker pool of a thread that is done computing, so the thread that computes keeps its speed.

Why this exists: GNU OpenMP (libgomp, which the CPU build of PyTorch links) keeps a pool of
worker threads for every thread that ever ran a parallel region, until that thread exits. When
all pools together hold more threads than the process may use CPUs, libgomp "throttles": its
workers stop spinning between parallel regions (about 100 spins instead of ~300,000) and sleep,
so every parallel region of the thread that is computing pays a futex wake-up of its workers.
An engine loads its model on the caller's thread and decodes on its scheduler thread; that was
enough. Measured on a 2-vCPU Intel Xeon (AMX), 2 threads, one bf16 linear [32, 512] x [512, 1536]:
67 us on the thread that made the only pool, 150 us on a second thread while the first one's
pool lived — slower than one thread (120 us) — and 66 us again once the first pool was freed.
The whole engine decoded 1,330 tokens/s on its scheduler thread against 2,240 on the main thread.

`release()` frees the calling thread's pool (OpenMP 5's `omp_pause_resource_all(omp_pause_hard)`;
a later parallel region on that thread simply makes a new one). Call it on a thread that has
finished its torch work and hands the computing to another: the caller of `Engine.start`, a
worker of `asyncio.to_thread` that loaded weights (`released`). Where the runtime is not libgomp
(Intel's libiomp, a build without OpenMP) it does nothing and says so (returns False).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads (soft would keep them idle)


@functools.cache
def _pause() -> Callable[[int], int] | None:
    """libgomp's `omp_pause_resource_all`, from the copy already loaded into this process (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "gomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        if not os.path.exists(path):
            continue
        try:
            fn = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def release() -> bool:
    """Free the calling thread's OpenMP workers; True where libgomp did it. Must not be called inside a
    parallel region (it is not: furlong calls it between pieces of work)."""
    import torch  # noqa: F401 - libgomp is loaded with torch; importing it first makes `_pause` find it

    fn = _pause()
    return fn is not None and fn(OMP_PAUSE_HARD) == 0


def released(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """`fn(*args, **kw)`, then `release()` on this thread: for torch work handed to a pooled worker
    thread (`asyncio.to_thread(released, load, ...)`), which would otherwise keep its pool for good."""
    try:
        return fn(*args, **kw)
    finally:
        release()
