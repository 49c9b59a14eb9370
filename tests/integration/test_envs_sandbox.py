"""The local process sandbox contains what model-written code may try, and reports it.

Each escape attempt runs in a real sandboxed process; the test checks both that the
result says what happened and that the host is unaffected (no file written, no
connection accepted, no process left, the next run works).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from furlong.envs.sandbox.base import SandboxLimits
from furlong.envs.sandbox.local import LocalSandbox

BOX = LocalSandbox(SandboxLimits(timeout_s=2.0, memory_mb=512, max_procs=16, max_output_bytes=1000))


def run(code: str, **kw) -> dict:
    return asyncio.run(BOX.run(code, **kw))


def processes_of(uid: int | None) -> list[int]:
    """Live (not zombie) processes of the sandbox's throw-away uid, once SIGKILL has been delivered."""
    if uid is None:
        return []
    for _ in range(50):  # SIGKILL is delivered asynchronously: wait for it, not a timing threshold
        out = []
        for p in os.listdir("/proc"):
            try:
                if p.isdigit() and os.stat(f"/proc/{p}").st_uid == uid:
                    state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state not in ("Z", "X"):
                        out.append(int(p))
            except OSError:
                pass
        if not out:
            return out
        time.sleep(0.1)
    return out


def host_ok() -> None:
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout == b"1\n"
    assert run("print('still fine')")["stdout"] == "still fine\n"


def test_normal_run_reports_its_isolation():
    r = run(
        "import os, sys\nprint(os.getcwd())\nopen('out.txt', 'w').write('x')\nprint(sys.stdin.read())", stdin="hello"
    )
    assert r["status"] == "ok" and r["exit_code"] == 0, r
    cwd = r["stdout"].splitlines()[0]
    assert cwd.startswith("/tmp/furlong-sandbox-") and not Path(cwd).exists()  # its temp dir is gone
    assert r["stdout"].splitlines()[1] == "hello"
    iso = r["isolation"]
    assert iso["network"] in ("namespace", "user+net namespace", "landlock-tcp", "unavailable")
    assert iso["filesystem"] in ("landlock", "mount namespace", "uid", "unavailable")
    print("isolation on this machine:", iso)


def test_infinite_loop_is_killed_at_the_timeout():
    r = run("while True:\n    pass")
    assert r["status"] == "timeout" and r["timed_out"] and r["exit_code"] < 0
    assert processes_of(r["isolation"].get("uid")) == []
    host_ok()


def test_fork_bomb_is_bounded_and_every_process_killed():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = run(code)
    assert r["status"] == "timeout"
    assert processes_of(r["isolation"].get("uid")) == []
    host_ok()


def test_escaped_child_is_killed_too():
    # A child that leaves the process group (setsid) and outlives main.py.
    r = run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')")
    assert r["status"] == "ok"
    uid = r["isolation"].get("uid")
    if uid is None:
        pytest.skip("not root: no throw-away uid, a setsid child can only be reached by its process group")
    assert processes_of(uid) == []


def test_10gb_allocation_is_refused():
    r = run("b = bytearray(10 * 1024**3)\nprint('allocated')")
    assert r["status"] == "memory" and "MemoryError" in r["stderr"] and "allocated" not in r["stdout"]
    host_ok()


def test_write_outside_the_temp_dir_is_denied(tmp_path):
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # so only the sandbox's own rules can stop the write
    r = run(f"open({str(target)!r}, 'w').write('x')")
    if r["isolation"]["filesystem"] == "unavailable":
        pytest.skip("filesystem isolation unavailable on this machine (no Landlock, not root)")
    # In a mount namespace the host's /tmp is not even there (FileNotFoundError); without one,
    # Landlock or the throw-away uid refuses the write (PermissionError).
    denied = "FileNotFoundError" if r["isolation"].get("namespaces") else "PermissionError"
    assert r["status"] == "error" and denied in r["stderr"]
    assert not target.exists()
    r = run("open('/etc/furlong-sandbox-test', 'w').write('x')")
    assert r["status"] == "error" and not Path("/etc/furlong-sandbox-test").exists()


def test_network_connection_is_blocked():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        r = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')")
        if r["isolation"]["network"] == "unavailable":
            pytest.skip("network isolation unavailable on this machine")
        assert r["status"] == "error" and "connected" not in r["stdout"]
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host
    finally:
        server.close()


def test_output_is_capped():
    r = run("import sys\nsys.stdout.write('x' * 100000)\nsys.stderr.write('y' * 5000)")
    assert r["status"] == "ok" and r["truncated"]
    assert r["stdout"] == "x" * 1000 and r["stderr"] == "y" * 1000


def test_files_are_placed_and_names_cannot_escape():
    r = run("import helper\nprint(helper.VALUE)", files={"helper.py": "VALUE = 42"})
    assert r["stdout"] == "42\n"
    with pytest.raises(ValueError, match="leaves the sandbox"):
        run("pass", files={"../evil.py": ""})


def test_cli_runs_a_file(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("print(6 * 7)")
    out = subprocess.run(
        [sys.executable, "-m", "furlong.cli", "envs", "sandbox", str(prog), "--timeout", "5"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and '"stdout": "42\\n"' in out.stdout
