"""`core.omp.release` frees the calling thread's OpenMP workers (counted as OS threads of the process),
and `Engine.start` frees its caller's: the pool that made the scheduler thread's parallel regions
sleep between regions (`core/omp.py`). A fresh interpreter per check: the count starts from a known
pool. No timing is asserted; the speed it buys is `benchmarks/engine_throughput.py`'s."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

COUNT = """
import os, time, threading, torch
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def settle(want, deadline=30.0):  # a freed worker leaves /proc/self/task once its exit completes
    end = time.time() + deadline
    while threads() != want and time.time() < end:
        time.sleep(0.05)
    return threads()
def work():
    torch.randn(4_000_000).mul_(2)  # large enough for a parallel region on 2 threads
"""


def run(body: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", COUNT + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=240,
        env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


@pytest.mark.timeout(300)
def test_release_frees_the_calling_threads_workers():
    out = run(
        """
        from furlong.core import omp
        base = threads()
        work()
        with_pool = settle(base + 1)
        ok = omp.release()
        after = settle(base)
        work()  # a later parallel region makes a new pool
        again = settle(base + 1)
        print(base, with_pool, ok, after, again)
        """
    )
    base, with_pool, ok, after, again = out.split()
    assert ok == "True", "torch's libgomp was not found, or omp_pause_resource_all failed"
    assert int(with_pool) == int(base) + 1, out
    assert int(after) == int(base), f"the worker did not exit: {out}"
    assert int(again) == int(base) + 1, out


@pytest.mark.timeout(300)
def test_released_frees_a_pooled_workers_pool():
    """What the engine server does with weights loaded on an `asyncio.to_thread` worker."""
    out = run(
        """
        from concurrent.futures import ThreadPoolExecutor
        from furlong.core import omp
        with ThreadPoolExecutor(1) as pool:
            pool.submit(lambda: None).result()  # the worker thread exists
            base = threads()
            pool.submit(work).result()
            kept = settle(base + 1)  # a plain call leaves its pool behind
            pool.submit(omp.released, work).result()
            freed = settle(base)
        print(base, kept, freed)
        """
    )
    base, kept, freed = map(int, out.split())
    assert kept == base + 1, out
    assert freed == base, out


@pytest.mark.timeout(300)
def test_engine_start_frees_the_callers_pool(tiny_model_dir):
    out = run(
        f"""
        from furlong.engine.engine import Engine
        base = threads()
        eng = Engine({str(tiny_model_dir)!r}, max_running=2, kv_cache_mb=8)
        work()
        built = threads()  # with this thread's OpenMP worker (and whatever the constructor started)
        eng.start()
        time.sleep(0.5)  # the scheduler thread idles: no torch work, no pool of its own
        started = settle(built)  # scheduler +1, this thread's worker -1
        eng.stop()
        print(base, built, started)
        """
    )
    base, built, started = map(int, out.split())
    assert built >= base + 1, out
    assert started == built, f"the caller's OpenMP worker outlived Engine.start: {out}"
