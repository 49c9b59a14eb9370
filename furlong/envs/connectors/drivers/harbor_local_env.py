"""A Docker-free Harbor environment: the task's container filesystem as a private root on this machine.

Harbor tasks are written for a container: the instruction says "create /app/x", the
verifier's `tests/test.sh` writes `/logs/verifier/reward.txt`, and the agent's terminal
lives in the container. Harbor's default environment builds the task's Dockerfile and
runs it in Docker; where no Docker engine runs, this class gives every trial its own
root directory instead and runs each command in a Linux mount namespace chrooted into it:

    <state>/root/
        usr, etc, opt, ...   the host's top-level directories, bound read-only
        bin -> usr/bin ...   the host's top-level symlinks, as they are
        app/ (the workdir)   fresh, with the task's environment/ files copied in
        logs/ tests/ solution/ tmp/ root/   fresh and writable, private to the trial

so the task's absolute paths mean what they mean in a container, and nothing the agent
or the verifier writes lands outside the trial's directory. Each `exec` is
`unshare --mount [--user --map-root-user when not root] [--net when the task has no
network] -- sh MOUNT_SCRIPT`, which binds the host directories, makes them read-only,
chroots and drops every capability from the bounding set before the command runs.
Processes a command leaves running (Terminus' tmux server) are found by their root
directory and killed at `stop()`.

What it is not: a build of the task's image (the Dockerfile's RUN steps do not run;
only WORKDIR is read, and loose environment/ files are copied), per-user execution
(`user=` is ignored: commands run as the caller, mapped to root when that is possible),
or a security boundary against hostile code (the host's files are readable). Use
Harbor's Docker environment or a VM for that.

This module is imported by the Harbor driver in the connector's own virtual
environment (standard library + harbor only), named by `EnvironmentConfig.import_path`.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path, PurePosixPath

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.trial.paths import EnvironmentPaths

PRIVATE = {"tmp", "root", "logs", "tests", "solution", "proc"}  # fresh in every trial; proc is bound as itself
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm-256color",
    "SHELL": "/bin/bash",
}
MOUNT_SCRIPT = r"""
set -e
root="$1"; shift; cwd="$1"; shift
for name in $BINDS; do
  mount --rbind "/$name" "$root/$name"
  mount -o remount,bind,ro "$root/$name" 2>/dev/null || true
done
mount --rbind /proc "$root/proc"
mkdir -p "$root$cwd"
drop=""
if command -v setpriv >/dev/null 2>&1; then drop="setpriv --bounding-set=-all --inh-caps=-all --"; fi
exec chroot "$root" $drop /bin/sh -c 'cd "$0" && exec "$@"' "$cwd" "$@"
"""


def dockerfile_workdir(environment_dir: Path) -> str | None:
    """The last WORKDIR of the task's Dockerfile, the directory its commands start in."""
    dockerfile = environment_dir / "Dockerfile"
    if not dockerfile.is_file():
        return None
    found = re.findall(r"^\s*WORKDIR\s+(\S+)", dockerfile.read_text(), flags=re.MULTILINE | re.IGNORECASE)
    return found[-1] if found else None


class LocalEnvironment(BaseEnvironment):
    """See the module docstring."""

    @staticmethod
    def type() -> str:
        return "furlong-local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        """Nothing to build: a task needs no Dockerfile here (only its WORKDIR is read when there is one)."""
        for tool in ("unshare", "chroot", "mount"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"the furlong-local Harbor environment needs `{tool}` (util-linux) on PATH")

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self, force_build: bool) -> None:
        self.workdir = self.task_env_config.workdir or dockerfile_workdir(self.environment_dir) or "/app"
        if not self.workdir.startswith("/"):
            raise ValueError(f"environment workdir {self.workdir!r} must be an absolute path")
        self.state = Path(tempfile.mkdtemp(prefix=f"harbor-local-{self.environment_name}-"))
        self.root = self.state / "root"
        private = PRIVATE | set(PurePosixPath(self.workdir).parts[1:2])  # the workdir's top directory is fresh too
        self.binds = []
        self.root.mkdir()
        for entry in sorted(Path("/").iterdir()):
            if entry.name in private:
                continue
            if entry.is_symlink():
                (self.root / entry.name).symlink_to(os.readlink(entry))
            elif entry.is_dir():
                (self.root / entry.name).mkdir()
                self.binds.append(entry.name)
        for name in private:
            (self.root / name).mkdir(exist_ok=True)
        (self.root / "tmp").chmod(0o1777)
        paths = EnvironmentPaths.for_os(self.os)  # what Docker would mount from the trial directory
        for d in (paths.agent_dir, paths.verifier_dir, paths.artifacts_dir):
            (self.root / str(d).lstrip("/")).mkdir(parents=True, exist_ok=True)
        (self.state / "mount.sh").write_text(MOUNT_SCRIPT)
        workdir = self.root / self.workdir.lstrip("/")
        workdir.mkdir(parents=True, exist_ok=True)
        if self.environment_dir.is_dir():
            for item in self.environment_dir.iterdir():
                if item.name in ("Dockerfile", "docker-compose.yaml", "docker-compose.yml", ".dockerignore"):
                    continue
                if item.is_dir():
                    shutil.copytree(item, workdir / item.name, symlinks=True, dirs_exist_ok=True)
                else:
                    shutil.copy2(item, workdir / item.name)
        probe = await self.exec("true", timeout_sec=30)
        if probe.return_code != 0:
            raise RuntimeError(
                f"the furlong-local environment cannot enter its root (mount namespaces refused?): "
                f"{(probe.stderr or probe.stdout or '').strip()[-500:]}"
            )

    async def stop(self, delete: bool) -> None:
        state = getattr(self, "state", None)
        if state is None:
            return
        self._kill_leftovers()
        if delete:
            # Mounts live only in the commands' private namespaces; on this side the bind
            # targets are empty directories. Refuse to delete if that ever is not so.
            if any(os.path.ismount(self.root / name) for name in self.binds):
                self.logger.warning(f"not deleting {state}: a bind mount is visible outside its namespace")
                return
            shutil.rmtree(state, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """Kill every process whose root directory is this trial's root (a daemon a command left running)."""
        root = str(self.root)
        for _ in range(3):
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if os.readlink(f"/proc/{pid}/root") == root:
                        found.append(int(pid))
                except OSError:
                    continue
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    # ---- commands ------------------------------------------------------------------
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        argv = ["unshare", "--mount", "--propagation", "private", "--fork"]
        if os.geteuid() != 0:
            argv += ["--user", "--map-root-user"]
        if self._network_disabled:
            argv += ["--net"]
        argv += [
            "/bin/sh",
            str(self.state / "mount.sh"),
            str(self.root),
            cwd or self.workdir,
            "/bin/bash",
            "-c",
            command,
        ]
        proc_env = {**BASE_ENV, **(self._merge_env(env) or {}), "BINDS": " ".join(self.binds)}
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=proc_env,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except (TimeoutError, asyncio.CancelledError) as e:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            return ExecResult(stdout="", stderr=f"command timed out after {timeout_sec} s", return_code=124)
        return ExecResult(
            stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"), return_code=proc.returncode
        )

    # ---- files ---------------------------------------------------------------------
    def _host(self, path: str, *, write: bool) -> Path:
        """Where the environment path `path` lies on this machine (inside the trial's root unless bound)."""
        clean = PurePosixPath(os.path.normpath("/" + str(path).lstrip("/")))
        top = clean.parts[1] if len(clean.parts) > 1 else ""
        if top in self.binds:
            if write:
                raise PermissionError(f"{path}: read-only in the furlong-local environment (the host's /{top})")
            return Path(str(clean))
        return self.root / str(clean).lstrip("/")

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self._host(target_path, write=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_path, target)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        shutil.copytree(source_dir, self._host(target_dir, write=True), symlinks=True, dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self._host(source_path, write=False), target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        source = self._host(source_dir, write=False)
        if not source.is_dir():
            raise FileNotFoundError(f"{source_dir}: no such directory in the environment")
        shutil.copytree(source, target_dir, symlinks=True, dirs_exist_ok=True)
