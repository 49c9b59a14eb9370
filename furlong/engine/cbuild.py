"""Small C kernels compiled for this CPU on first use, shared by the engine's native kernels.

Each kernel (`blockcopy.py`, `rows_kernel.py`) is one C source compiled with the system C compiler
(`$CC`, else `cc`/`gcc`) and `-march=native` into `$FURLONG_CACHE_DIR` (default
`~/.cache/furlong`)/kernels, keyed by the source, the flags, the compiler's path and this CPU's model
and flags, so a home directory shared between machines never loads a binary built for another CPU.
A machine without a compiler, a failed build, or `FURLONG_NATIVE_KERNELS=0` gets None, and every
caller keeps a PyTorch path that computes the same thing.

`-fopenmp` links libgomp by its soname, `libgomp.so.1`: the copy PyTorch's CPU build already
loaded, so a kernel's parallel loop uses the calling thread's OpenMP team and thread count (what
`torch.set_num_threads` set), never a second runtime whose workers would fight torch's for the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def cpu_identity() -> str:
    """What a `-march=native` binary depends on: the machine and its CPU's model and flags."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            ident += "".join(line for line in f if line.startswith(("flags", "model name", "Features")))
    except OSError:
        pass
    return ident


def cache_dir() -> Path:
    root = os.environ.get("FURLONG_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "furlong")
    return Path(root) / "kernels"


def _build(name: str, source: str, flags: tuple[str, ...], cc: str, out: Path) -> bool:
    """Compile `source` into `out` (atomically: engines started together may build at once)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, so = Path(tmp) / f"{name}.c", Path(tmp) / out.name
        src.write_text(source)
        for arch in (["-march=native"], []):  # some compilers (or CPUs) refuse -march=native
            cmd = [cc, "-O3", *arch, *flags, "-shared", "-fPIC", "-o", str(so), str(src)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.info("%s: %s failed (%s); PyTorch's path is used instead", name, cc, exc)
                return False
            if done.returncode == 0:
                os.replace(so, out)
                return True
        log.info("%s: %s could not build the kernel (%s); PyTorch's path is used instead", name, cc, done.stderr[-300:])
        return False


def load(name: str, source: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library compiled from `source` (built on first use and cached; None: no compiler, a failed
    build, or `FURLONG_NATIVE_KERNELS=0`). Callers cache the result and set their functions' argtypes."""
    if os.environ.get("FURLONG_NATIVE_KERNELS", "1") == "0":
        return None
    cc = next((p for p in (os.environ.get("CC"), "cc", "gcc") if p and shutil.which(p)), None)
    if cc is None:
        log.info("%s: no C compiler found; PyTorch's path is used instead", name)
        return None
    key = hashlib.sha256(f"{source}\0{flags}\0{shutil.which(cc)}\0{cpu_identity()}".encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.so"
    try:
        if not path.exists() and not _build(name, source, flags, cc, path):
            return None
        return ctypes.CDLL(str(path))
    except OSError as exc:
        log.info("%s: cannot load %s (%s); PyTorch's path is used instead", name, path, exc)
        return None
