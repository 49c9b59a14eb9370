"""The first program inside a local sandbox: sets the limits, then runs `main.py` and reports how it ended.

Standard library only, and never imported by furlong: `LocalSandbox` passes this file's source
as `python -I -c SOURCE CONFIG` (inside bwrap when it runs one), so `-I` keeps the run
directory off `sys.path` (a `json.py` placed there cannot replace what this reads) and nothing
runs in the trainer's threaded process between fork and exec.

Why the limits are set here and not by the parent (`preexec_fn`, `prlimit`): Python code
between fork and exec in a threaded parent can deadlock on a lock another thread held
(allocation, import, logging), and RLIMIT_NPROC set outside a user namespace counts every
task of the uid, the trainer's threads included, so forks in the sandbox failed on a
torch/Ray host. Set here, after bwrap made a user namespace, RLIMIT_NPROC counts only this
sandbox's own tasks (Linux >= 5.14 counts it per user namespace).

Steps: limits (CPU, address space, file size, open files, no core dumps, tasks); without
bwrap, an own user + network namespace where the kernel allows one; Landlock where the kernel
has it (writes only beneath the run directory and to /dev/null; with ABI >= 6 no signals and
no abstract Unix sockets out of the sandbox; TCP denied where no network namespace stands);
a first JSON line on the report pipe saying what is in force (measured here, not assumed);
then `main.py` in a child process (`python -E -s`, its directory importable) and a second
line with its real exit status (negative: the signal that ended it), which bwrap alone
would fold into 128+N. The report pipe is closed in `main.py` and this process is made
non-dumpable, so the code under test can neither inherit nor reopen it to forge a result.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE = 38, 4
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
# Landlock rights that change the filesystem (reads and execution stay allowed everywhere).
LL_WRITE_FILE, LL_TRUNCATE = 1 << 1, 1 << 14
LL_WRITES_V1 = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make *
LL_REFER = 1 << 13  # ABI 2
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
LL_SCOPE_ABSTRACT_UNIX, LL_SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, or 0 when Landlock is not available."""
    version = _LIBC.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(version), 0)


def landlock(workdir: str, *, deny_tcp: bool) -> dict:
    """Writes only beneath `workdir` (and /dev/null); signal and abstract-socket scoping with ABI >= 6;
    TCP denied with `deny_tcp` and ABI >= 4. What was applied, or {} where the kernel refused."""
    abi = landlock_abi()
    if abi < 1:
        return {}
    fs = LL_WRITES_V1 | (LL_REFER if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0)
    net = (LL_NET_BIND_TCP | LL_NET_CONNECT_TCP) if deny_tcp and abi >= 4 else 0
    scoped = (LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL) if abi >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = _LIBC.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return {}
    try:
        for path, rights in ((workdir, fs), ("/dev/null", LL_WRITE_FILE | (LL_TRUNCATE if abi >= 3 else 0))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(rights, fd)
                if _LIBC.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
                    return {}
            finally:
                os.close(fd)
        if _LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return {}
        if _LIBC.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            return {}
        return {"filesystem": "landlock", "tcp": bool(net), "scoped": bool(scoped)}
    finally:
        os.close(ruleset)


def own_tasks() -> int:
    """Tasks (threads included: RLIMIT_NPROC counts threads) of this uid, as the kernel counts them."""
    n = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == os.getuid():
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def set_limits(conf: dict, own_userns: bool) -> None:
    """CPU, memory, file size, open files, core dumps, tasks: inherited by main.py and all it starts."""
    for name, value in (("CPU", conf["cpu_s"]), ("AS", conf["memory_bytes"]), ("FSIZE", conf["file_bytes"])):
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value + (1 if name == "CPU" else 0)))
    resource.setrlimit(resource.RLIMIT_NOFILE, (conf["open_files"], conf["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # In a user namespace of its own the count starts near zero (bwrap's init and this process);
    # outside one it is every task of the uid, so allow those already running.
    base = 2 if own_userns else own_tasks()
    resource.setrlimit(resource.RLIMIT_NPROC, (base + conf["max_procs"], base + conf["max_procs"]))


def isolate(conf: dict) -> dict:
    """Apply every layer this machine allows; the report of what is in force."""
    done = {k: conf[k] for k in ("namespaces", "uid") if conf.get(k) is not None}
    own_userns = bool(conf["namespaces"])
    if conf["network"]:
        done["network"] = "allowed"
    elif conf["netns"]:
        done["network"] = "namespace"
    elif _LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:  # without bwrap, where the kernel allows it
        done["network"], own_userns = "user+net namespace", True
    set_limits(conf, own_userns)
    ll = landlock(conf["workdir"], deny_tcp="network" not in done)
    if "network" not in done:
        done["network"] = "landlock-tcp" if ll.get("tcp") else "unavailable"
    fs = "mount namespace" if conf["namespaces"] else ("uid" if conf.get("uid") is not None else "unavailable")
    done["filesystem"] = ll.get("filesystem", fs)
    done["signals"] = (
        "pid namespace"
        if conf["namespaces"]
        else ("landlock" if ll.get("scoped") else ("uid" if conf.get("uid") is not None else "unavailable"))
    )
    return done


def main() -> None:
    conf = json.loads(sys.argv[1])
    report = conf["report_fd"]
    os.set_inheritable(report, False)  # closed in main.py: it cannot write (forge) this report
    _LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # nor reopen it through /proc/<this pid>/fd
    os.write(report, (json.dumps(isolate(conf)) + "\n").encode())
    pid = os.fork()
    if pid == 0:
        try:
            os.execv(conf["python"], [conf["python"], "-E", "-s", "main.py"])
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    os.write(report, (json.dumps({"exit_code": code}) + "\n").encode())
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
