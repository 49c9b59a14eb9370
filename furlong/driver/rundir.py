"""The run directory (DESIGN §3): admin token, checkpoints and the driver's state in them.

    runs/<name>/
      config.yaml               the resolved config (a run resumes from its directory alone)
      admin_token               the control endpoints' bearer token, mode 0600
      checkpoints/step_<n>/     the trainer's files, then driver_state.json, written last

`driver_state.json` is written to a temporary name, fsynced and renamed, last (and the
directory fsynced): its presence is what marks a checkpoint complete, so a driver killed
mid-save, or a machine losing power, leaves a checkpoint that `latest_checkpoint` skips,
never one that resumes half-written.

    metrics.jsonl, samples/step_<i>.jsonl, events.sqlite
                                the run's records; `rewind_files` (with the event store's
                                `rewind`) cuts them back to a checkpoint's step on resume
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


def fsync_file(path: Path) -> None:
    """fsync `path` (a file or a directory) if it exists: its data, or its entries, on disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_driver_state(path: Path, state: dict[str, Any]) -> None:
    """Write `state` as the checkpoint's driver state, last and atomically: it marks the checkpoint complete.

    The trainer fsynced its own files; this one is fsynced before the rename, and the directories
    after it, so the marker is never on disk before what it marks."""
    path = Path(path)
    tmp = path / (DRIVER_STATE + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(state))
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path / DRIVER_STATE)
    fsync_file(path)
    fsync_file(path.parent)


def rewind_files(run_dir: Path, step: int) -> None:
    """Drop the records of steps after `step`: rows of `metrics.jsonl` (steps count from 1) and
    `samples/step_<i>.jsonl` (i counts from 0) that a resumed run writes again.

    `metrics.jsonl` is rewritten in place: its sink appends (O_APPEND), so its later rows follow the kept ones."""
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.exists():
        with open(metrics, "r+", encoding="utf-8") as f:
            lines = f.readlines()
            keep = [line for line in lines if _row_step(line) <= step]
            if len(keep) != len(lines):
                f.seek(0)
                f.writelines(keep)
                f.truncate()
    for path in (Path(run_dir) / "samples").glob("step_*.jsonl"):
        index = path.stem.split("_", 1)[1]
        if index.isdigit() and int(index) >= step:
            path.unlink()


def _row_step(line: str) -> float:
    """A row's step; a torn last line (a driver killed mid-write) has none and goes, or the next row joins it."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def read_driver_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / DRIVER_STATE).read_text())


def rotate_checkpoints(run_dir: Path, keep: int | None) -> None:
    """Keep the newest `keep` complete checkpoints (None: keep all)."""
    if not keep:
        return
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
