"""The run directory (DESIGN §3): admin token, checkpoints and the driver's state in them.

    runs/<name>/
      config.yaml               the resolved config (a run resumes from its directory alone)
      admin_token               the control endpoints' bearer token, mode 0600
      checkpoints/step_<n>/     the trainer's files, then driver_state.json, written last

`driver_state.json` is written to a temporary name and renamed, last: its presence is
what marks a checkpoint complete, so a driver killed mid-save leaves a checkpoint that
`latest_checkpoint` skips, never one that resumes half-written.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

DRIVER_STATE = "driver_state.json"


def admin_token(run_dir: Path) -> str:
    """The run's admin token for control endpoints: generated once, file mode 0600."""
    path = Path(run_dir) / "admin_token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint (its driver state written), oldest first."""
    done = [p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / DRIVER_STATE).exists()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def write_driver_state(path: Path, state: dict[str, Any]) -> None:
    """Write `state` as the checkpoint's driver state, last and atomically: it marks the checkpoint complete."""
    tmp = Path(path) / (DRIVER_STATE + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.rename(Path(path) / DRIVER_STATE)


def read_driver_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / DRIVER_STATE).read_text())


def rotate_checkpoints(run_dir: Path, keep: int | None) -> None:
    """Keep the newest `keep` complete checkpoints (None: keep all)."""
    if not keep:
        return
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
