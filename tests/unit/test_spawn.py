"""`spawn`: a child dies with the process that started it, never with the thread that happened to start it.

PR_SET_PDEATHSIG is tied to the forking thread: a NeMo Gym server started from
`asyncio.to_thread` died as soon as `asyncio.run` shut its executor down, while the
connector still handed out its URL (a `Connection refused` seen in CI).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

from furlong.core.processes import spawn


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.05)
    return None


def test_a_child_started_from_a_thread_that_ends_lives_on():
    box: dict[str, subprocess.Popen] = {}
    t = threading.Thread(target=lambda: box.setdefault("p", spawn(["sleep", "60"])))
    t.start()
    t.join()
    # what asyncio.run does to its default executor's threads, the way the connector started servers
    box["q"] = asyncio.run(asyncio.to_thread(spawn, ["sleep", "60"]))
    try:
        for p in (box["p"], box["q"]):
            assert wait_exit(p, 1.0) is None, f"killed (code {p.returncode}) when its starting thread ended"
    finally:
        for p in box.values():
            p.kill()
            p.wait()


def test_a_child_still_dies_with_the_process_that_started_it():
    # A middle process spawns a grandchild from a worker thread, prints its pid, then is SIGKILLed.
    code = (
        "import asyncio, sys, time\n"
        "from furlong.core.processes import spawn\n"
        "p = asyncio.run(asyncio.to_thread(spawn, ['sleep', '60']))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(middle.stdout.readline())
        middle.kill()
        middle.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        assert not _alive(pid), "the grandchild outlived the process that started it"
    finally:
        middle.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"  # a zombie has died; init reaps it
    except FileNotFoundError:
        return False
