"""Virtual environments for connector packages, built on demand and cached.

Why separate environments: OpenEnv, Verifiers, NeMo Gym and Harbor pin conflicting
versions of `mcp` and `openai`, two of them need Python >= 3.12, and none of them
needs torch. Importing any of them into furlong's own environment would break it.
So each connector describes the environment its package needs (`VenvSpec`), and
furlong drives the package from there: a server it starts, or a small *driver*
script (`furlong/envs/connectors/drivers/`, standard library + the package only)
that reads one JSON request on stdin and writes one JSON reply on stdout.

Cache: `$FURLONG_ENVS_CACHE` (default `~/.cache/furlong/envs`)/`<name>-<key>`, where
the key hashes the Python version and the requirements, so changing a pin builds a
fresh environment and an unchanged one is reused across checkouts and runs. A
build holds a file lock (two test workers never build the same one twice) and
writes its stamp (`furlong-venv.json`, with `pip freeze`) last: a directory without
a stamp is a broken build and is rebuilt.

Every pip call passes a constraints file pinning `torch==2.13.0`, so a package that
pulls torch in indirectly gets this machine's CPU build, never a multi-GB download.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAMP = "furlong-venv.json"
TORCH_PIN = "torch==2.13.0\n"
DRIVERS = Path(__file__).parent / "drivers"


class VenvError(RuntimeError):
    """A connector environment could not be built, or its driver failed; the message says which and why."""


@dataclass(frozen=True)
class VenvSpec:
    """What one connector package needs: a Python version and pinned requirements."""

    name: str  # the connector's name: openenv, verifiers, nemo-gym, harbor
    python: str  # "3.11", "3.12": major.minor
    requirements: tuple[str, ...]  # pip requirement strings, pinned
    # environment variables its processes need (e.g. offline switches)
    env: dict[str, str] = field(default_factory=dict)
    doc: str = ""  # one line for `furlong envs list`

    def key(self) -> str:
        text = json.dumps([self.python, sorted(self.requirements)])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("FURLONG_ENVS_CACHE", Path.home() / ".cache" / "furlong" / "envs"))


def venv_dir(spec: VenvSpec) -> Path:
    return cache_root() / f"{spec.name}-{spec.key()}"


def venv_python(spec: VenvSpec) -> Path:
    return venv_dir(spec) / "bin" / "python"


def is_built(spec: VenvSpec) -> bool:
    return (venv_dir(spec) / STAMP).is_file()


def find_python(version: str) -> str:
    """An interpreter for `version` (major.minor): this one, one on PATH, or a pyenv build."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    found = shutil.which(f"python{version}")
    candidates = ([found] if found else []) + sorted(
        glob.glob(
            str(
                Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
                / "versions"
                / f"{version}.*"
                / "bin"
                / "python"
            )
        ),
        reverse=True,
    )
    for exe in candidates:
        try:
            out = subprocess.run(
                [exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return exe
    raise VenvError(
        f"no Python {version} interpreter found (looked for python{version} on PATH and in pyenv); "
        f"install one, e.g. `pyenv install {version}`"
    )


def _run(argv: list[str], what: str, log: Path, env: dict[str, str] | None = None) -> None:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise VenvError(f"{what} failed (exit {proc.returncode}); log {log}:\n{tail}")


def ensure(spec: VenvSpec, *, force: bool = False, quiet: bool = False) -> Path:
    """The environment's python, building it first when it is missing (or `force`)."""
    root = venv_dir(spec)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(spec) and not force:
            return venv_python(spec)
        shutil.rmtree(root, ignore_errors=True)
        log = root.parent / f"{root.name}.log"
        log.write_text("")
        start = time.monotonic()
        if not quiet:
            print(
                f"furlong envs: building the {spec.name} environment (Python {spec.python}) in {root} ...",
                file=sys.stderr,
                flush=True,
            )
        _run([find_python(spec.python), "-m", "venv", str(root)], f"creating the {spec.name} venv", log)
        constraints = root / "constraints.txt"
        constraints.write_text(TORCH_PIN)
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        _run(
            [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(constraints), *spec.requirements],
            f"installing {spec.name} ({', '.join(spec.requirements)})",
            log,
            env=env,
        )
        freeze = subprocess.run(
            [str(root / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True
        ).stdout
        (root / STAMP).write_text(
            json.dumps(
                {
                    "name": spec.name,
                    "python": spec.python,
                    "requirements": list(spec.requirements),
                    "freeze": freeze.split(),
                    "built_s": round(time.monotonic() - start, 1),
                },
                indent=1,
            )
        )
        if not quiet:
            print(f"furlong envs: {spec.name} ready in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        return venv_python(spec)


def driver_env(spec: VenvSpec, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a connector's processes run with: this one minus furlong's venv, plus the spec's settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    bin_dir = str(venv_dir(spec) / "bin")
    env["PATH"] = os.pathsep.join(
        [
            bin_dir,
            *(
                p
                for p in env.get("PATH", "").split(os.pathsep)
                if p and Path(p).resolve() != Path(sys.prefix, "bin").resolve()
            ),
        ]
    )
    env["VIRTUAL_ENV"] = str(venv_dir(spec))
    return {**env, **spec.env, **(extra or {})}


def run_driver(
    spec: VenvSpec,
    driver: str,
    request: dict[str, Any],
    *,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> dict[str, Any]:
    """Run `drivers/<driver>.py` in the spec's environment with `request` on stdin; returns its JSON reply.

    The reply is the last line the driver prints to stdout.

    A driver reports its own failures as `{"error": "..."}`; a crash, a timeout or output
    that is not JSON raises VenvError with the tail of its stderr.
    """
    script = DRIVERS / f"{driver}.py"
    if not script.is_file():
        raise VenvError(f"no driver {script}")
    python = ensure(spec, quiet=True)
    try:
        proc = subprocess.run(
            [str(python), str(script)],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=driver_env(spec, env),
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as e:
        raise VenvError(
            f"{spec.name} driver {driver}: no reply within {timeout_s:.0f} s; stderr tail:\n"
            f"{(e.stderr or b'')[-2000:]!r}"
        ) from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        reply = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        reply = None
    if proc.returncode != 0 or not isinstance(reply, dict):
        raise VenvError(
            f"{spec.name} driver {driver} failed (exit {proc.returncode}); stderr tail:\n{proc.stderr[-3000:]}"
        )
    if "error" in reply:
        raise VenvError(f"{spec.name} driver {driver}: {reply['error']}")
    return reply
