"""The local sandbox is a boundary for a user without root: what model code could do to that user.

Each test runs a small client *as a non-root user* (this user; `nobody` when the tests run as
root, as in CI), which starts a real LocalSandbox run and sets up, as that same user, what the
code attacks: a sentinel process, an admin-token file (0600) in a run directory, a fake
`~/.ssh/id_rsa`, a Unix socket (path and abstract) and a TCP server on 127.0.0.1. Outside the
sandbox each of these is reachable by that user (the client checks it first, so the test can
fail); inside it none is. Fork and memory bombs are contained, and the host still works.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import pwd
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from furlong.config.schema import EnvsConfig
from furlong.envs.sandbox.local import LocalSandbox, SandboxUnavailable

REPO = Path(__file__).resolve().parents[2]

# Runs as the sandbox's user; the test's own code follows it; the last stdout line is JSON.
PRELUDE = """
import asyncio, json, os, shutil, socket, subprocess, sys, tempfile, time
from furlong.envs.sandbox.base import SandboxLimits
from furlong.envs.sandbox.local import LocalSandbox

BOX = LocalSandbox(SandboxLimits(timeout_s=3.0, memory_mb=256, max_procs=16, max_output_bytes=4000))
SCRATCH = tempfile.mkdtemp(prefix="furlong-boundary-")  # this user's own files, outside the sandbox

def run(code):
    return asyncio.run(BOX.run(code))

# A child subreaper: a process the sandbox starts that leaves its session (setsid, double fork) is
# re-parented to this client rather than to init, so "what is left" is this client's descendants,
# whatever else runs on the machine (other tests, the user's own programs).
import ctypes
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

def mine():
    '''Live descendants of this process (zombies excluded): everything the sandbox runs, escaped or not.'''
    kids, live = {}, set()
    for p in os.listdir("/proc"):
        try:
            if p.isdigit():
                fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
                kids.setdefault(int(fields[1]), []).append(int(p))
                if fields[0] not in "ZX":
                    live.add(int(p))
        except (OSError, IndexError):
            pass
    out, todo = set(), [os.getpid()]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out & live

def settled(before):
    '''New descendants left once SIGKILL has been delivered (waits for delivery, no threshold).'''
    for _ in range(100):
        left = mine() - before
        if not left:
            return left
        time.sleep(0.05)
    return left

def host_ok():
    return subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout == b"1\\n" and (
        run("print('fine')")["stdout"] == "fine\\n"
    )

def done(**out):
    shutil.rmtree(SCRATCH, ignore_errors=True)
    print(json.dumps(out))
"""


def _usable_by_others(path: str, bit: int = 0o001) -> bool:
    """Whether a user with no special rights can reach `path` (every parent searchable, `bit` on it)."""
    p = Path(path).resolve()
    return p.exists() and bool(p.stat().st_mode & bit) and all(d.stat().st_mode & 0o001 for d in p.parents)


def client_command() -> tuple[list[str], dict[str, str]]:
    """How to run Python as a non-root user that can import furlong: this user, or `nobody` when root."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    if os.geteuid() != 0:
        return [sys.executable, "-c"], env | {"HOME": os.environ.get("HOME", "/tmp")}
    user = pwd.getpwnam("nobody")
    drop = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    python, paths = sys.executable, [str(REPO)]
    if not _usable_by_others(python):  # e.g. a pyenv under /root: the system python of the same version
        python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
        paths += dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    unreachable = [p for p in [python, *paths] if not _usable_by_others(p, 0o005 if p != python else 0o001)]
    if unreachable:
        pytest.fail(f"the sandbox must be tested as a non-root user, and `nobody` cannot reach {unreachable}")
    return drop + [python, "-c"], env | {"PYTHONPATH": ":".join(paths), "HOME": "/nonexistent"}


def as_user(body: str, timeout: float = 90) -> dict:
    """Run PRELUDE + `body` as the non-root user; its JSON result."""
    argv, env = client_command()
    out = subprocess.run(
        [*argv, PRELUDE + textwrap.dedent(body)], env=env, cwd="/", capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.timeout(120)
def test_kill_minus_one_hurts_nothing_outside():
    r = as_user("""
        sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        os.kill(sentinel.pid, 0)  # control: outside the sandbox this user can signal it
        res = run(f'''import os
        try:
            os.kill({sentinel.pid}, 9)
            print("direct: sent")
        except OSError as e:
            print("direct:", type(e).__name__)
        os.kill(-1, 9)
        print("survived")''')
        ok = host_ok()
        alive = sentinel.poll() is None
        sentinel.kill()
        done(res=res, alive=alive, ok=ok, uid=os.getuid())
    """)
    assert r["uid"] != 0
    res = r["res"]
    # Host processes are not even visible; kill(-1) spares its caller, so main.py may print "survived"
    # before the sandbox ends: its child runner, killed, takes the whole PID namespace with it.
    assert res["stdout"].splitlines()[0] == "direct: ProcessLookupError", res
    assert res["status"] == "killed" and res["exit_code"] == -9, res
    assert r["alive"] and r["ok"]
    assert res["isolation"]["namespaces"] and res["isolation"]["signals"] == "pid namespace"


@pytest.mark.timeout(120)
def test_admin_token_and_ssh_key_are_unreadable():
    r = as_user("""
        run_dir = os.path.join(tempfile.mkdtemp(dir="/var/tmp" if os.access("/var/tmp", os.W_OK) else SCRATCH), "run")
        home = os.path.join(SCRATCH, "home")
        secrets = {}
        for path in (os.path.join(run_dir, "admin_token"), os.path.join(home, ".ssh", "id_rsa")):
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            secrets[path] = os.urandom(12).hex()
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(secrets[path])
        control = all(open(p).read() == s for p, s in secrets.items())  # this user can read them outside
        code = "import os\\n" + "".join(
            f"try:\\n    print(open({p!r}).read())\\nexcept OSError as e:\\n    print(type(e).__name__)\\n" for p in secrets
        ) + "print(sorted(os.listdir('/')))\\nprint(os.path.expanduser('~'))"
        res = run(code)
        shutil.rmtree(os.path.dirname(run_dir))
        done(res=res, control=control, secrets=list(secrets.values()))
    """)
    res = r["res"]
    assert r["control"] and res["status"] == "ok", res
    lines = res["stdout"].splitlines()
    assert lines[:2] == ["FileNotFoundError", "FileNotFoundError"], res
    assert not any(s in res["stdout"] + res["stderr"] for s in r["secrets"])
    top = ast.literal_eval(lines[2])
    assert not {"root", "run", "var"} & set(top), top  # no /root, no /run (sockets, tokens), no /var/tmp
    assert lines[3].startswith("/tmp/furlong-sandbox-")  # HOME is the run's own directory


@pytest.mark.timeout(120)
def test_host_unix_sockets_are_unreachable():
    r = as_user("""
        path = os.path.join(SCRATCH, "ray.sock")
        abstract = "\\0furlong-boundary-" + os.urandom(4).hex()
        servers = []
        for address in (path, abstract):
            s = socket.socket(socket.AF_UNIX)
            s.bind(address)
            s.listen(4)
            s.setblocking(False)
            servers.append(s)
            c = socket.socket(socket.AF_UNIX)
            c.connect(address)  # control: reachable outside the sandbox
            s.accept()[0].close()
            c.close()
        code = "import socket\\n" + "".join(
            f"try:\\n    socket.socket(socket.AF_UNIX).connect({a!r})\\n    print('connected')\\n"
            f"except OSError as e:\\n    print(type(e).__name__)\\n" for a in (path, abstract)
        )
        res = run(code)
        reached = []
        for s in servers:
            try:
                s.accept()
                reached.append(True)
            except BlockingIOError:
                reached.append(False)
        done(res=res, reached=reached)
    """)
    res = r["res"]
    assert res["status"] == "ok", res
    assert res["stdout"].splitlines() == ["FileNotFoundError", "ConnectionRefusedError"], res
    assert r["reached"] == [False, False]


@pytest.mark.timeout(120)
def test_network_is_off():
    r = as_user("""
        server = socket.create_server(("127.0.0.1", 0))
        server.setblocking(False)
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # control: reachable outside
        server.accept()[0].close()
        res = run(f"import socket\\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\\nprint('connected')")
        try:
            server.accept()
            reached = True
        except BlockingIOError:
            reached = False
        done(res=res, reached=reached)
    """)
    res = r["res"]
    assert res["status"] == "error" and "ConnectionRefusedError" in res["stderr"], res
    assert "connected" not in res["stdout"] and not r["reached"]
    assert res["isolation"]["network"] == "namespace"


@pytest.mark.timeout(120)
def test_fork_bomb_is_contained():
    r = as_user("""
        before = mine()
        res = run("import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass")
        left = settled(before)
        done(res=res, left=sorted(left), ok=host_ok())
    """)
    assert r["res"]["status"] in ("timeout", "killed"), r["res"]
    assert r["left"] == [] and r["ok"]


@pytest.mark.timeout(120)
def test_memory_bomb_is_contained():
    r = as_user("""
        res = run("chunks = []\\nwhile True:\\n    chunks.append(bytearray(16 * 2**20))")
        done(res=res, ok=host_ok())
    """)
    assert r["res"]["status"] in ("memory", "killed"), r["res"]
    assert r["ok"]


@pytest.mark.timeout(120)
def test_a_child_that_left_the_session_dies_with_the_run():
    r = as_user("""
        marker = "%d.%06d" % (200 + os.getpid() % 100, int.from_bytes(os.urandom(3), "big") % 10**6)
        res = run(f"import os\\nif os.fork() == 0:\\n    os.setsid()\\n    os.execv('/bin/sleep', ['sleep', '{marker}'])\\n"
                  "print('parent done')")
        def with_marker():
            found = []
            for p in mine():
                try:
                    if marker in open(f"/proc/{p}/cmdline").read():
                        found.append(p)
                except OSError:
                    pass
            return found
        for _ in range(100):  # SIGKILL delivery, not a threshold
            if not with_marker():
                break
            time.sleep(0.05)
        done(res=res, left=with_marker())
    """)
    assert r["res"]["status"] == "ok" and r["res"]["stdout"] == "parent done\n", r["res"]
    assert r["left"] == [] and not r["res"]["escaped_processes"]


@pytest.mark.timeout(120)
def test_the_callers_threads_do_not_use_up_the_process_limit():
    # RLIMIT_NPROC counts threads; set outside a user namespace it counted the trainer's too.
    r = as_user("""
        import threading
        stop = threading.Event()
        threads = [threading.Thread(target=stop.wait) for _ in range(64)]
        for t in threads:
            t.start()
        res = run("import os\\nn = 0\\nfor _ in range(8):\\n    if os.fork() == 0:\\n        os._exit(0)\\n"
                  "    n += 1\\nprint(n)")
        stop.set()
        done(res=res)
    """)
    assert r["res"]["status"] == "ok" and r["res"]["stdout"] == "8\n", r["res"]


@pytest.mark.timeout(60)
def test_without_bwrap_the_run_is_refused_unless_allowed():
    box = LocalSandbox(bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match="bubblewrap.*envs.sandbox_unsafe_allow=true"):
        asyncio.run(box.run("print(1)"))
    unsafe = LocalSandbox(bwrap="/nonexistent/bwrap", unsafe_allow=True)
    r = asyncio.run(unsafe.run("print(6 * 7)"))
    assert r["status"] == "ok" and r["stdout"] == "42\n" and r["isolation"]["namespaces"] == ""
    assert LocalSandbox.from_config(EnvsConfig(sandbox_unsafe_allow=True)).unsafe_allow
    assert not LocalSandbox.from_config(EnvsConfig()).unsafe_allow
