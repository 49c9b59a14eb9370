"""The program a remote sandbox (E2B, Daytona) runs for one `run(code)`: standard library only.

Why a runner inside the remote machine instead of the provider's own "run code" call:
the providers differ (E2B streams stdout and stderr, Daytona's `exec` merges them)
and neither caps output or reports a timeout the way a reward needs. This script is
sent with the command (`python3 -I -c <this file> <job>`), so every provider gives
the same result as `LocalSandbox`: it writes the job's files into a fresh directory,
runs `main.py` in its own process group under resource limits, enforces the
wall-clock timeout by killing the whole group, keeps at most `max_output_bytes` of
each stream *inside* the sandbox (a program printing forever sends nothing more
over the network), removes the directory, and prints one line: a marker and the
result as JSON.

`<job>` is the job as base64 JSON, or `@<path>` of a file holding that JSON
(uploaded beforehand when the job is too large for a command line); the file is
removed once read. Runs on any Python >= 3.6 a sandbox image may have.
"""

import base64
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

MARK = "@@furlong-sandbox-result@@"


def _limit(memory_mb, cpu_s):
    def apply():
        mem = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _drain(fd, cap, kept, cut):
    """Read `fd` to its end keeping the first `cap` bytes; the rest is read and dropped."""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        room = cap - len(kept)
        if len(chunk) > room:
            cut.append(True)
        kept.extend(chunk[: max(room, 0)])


def _feed(pipe, data):
    try:
        pipe.write(data)
        pipe.close()
    except OSError:  # the program exited without reading its input
        pass


def run(job):
    work = tempfile.mkdtemp(prefix="furlong-run-")
    try:
        for name, text in job["files"].items():
            path = os.path.join(work, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        timeout_s, cap = float(job["timeout_s"]), int(job["max_output_bytes"])
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": work,
            "TMPDIR": work,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        stdin = job.get("stdin") or ""
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-E", "-s", "main.py"],
            cwd=work,
            env=env,
            start_new_session=True,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_limit(int(job["memory_mb"]), int(timeout_s) + 1),
        )
        out, err, cut = bytearray(), bytearray(), []
        threads = [
            threading.Thread(target=_drain, args=(proc.stdout.fileno(), cap, out, cut), daemon=True),
            threading.Thread(target=_drain, args=(proc.stderr.fileno(), cap, err, cut), daemon=True),
        ]
        if stdin:
            threads.append(threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True))
        for t in threads:
            t.start()
        timed_out = False
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        try:  # also reaches children that outlived main.py
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        code = proc.wait()
        for t in threads[:2]:
            t.join(2.0)
        escaped = any(t.is_alive() for t in threads[:2])  # a child left the group and holds the pipes
        return {
            "stdout": out.decode("utf-8", "replace"),
            "stderr": err.decode("utf-8", "replace"),
            "exit_code": code,
            "timed_out": timed_out,
            "truncated": bool(cut),
            "duration_s": time.monotonic() - start,
            "escaped_processes": escaped,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(arg):
    if arg.startswith("@"):
        with open(arg[1:], "rb") as f:
            raw = f.read()
        os.unlink(arg[1:])
    else:
        raw = base64.b64decode(arg)
    result = run(json.loads(raw.decode("utf-8")))
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
