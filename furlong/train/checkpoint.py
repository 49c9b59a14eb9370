"""Full-state checkpoints with torch.distributed.checkpoint (DCP).

Layout of `runs/<name>/checkpoints/step_<n>/`:

    dcp/            model(s) and optimiser(s), sharded as trained; DCP reshards on load,
                    so a checkpoint from N ranks loads on M ranks (and in `furlong export`)
    rank_<r>.pt     what differs per rank or is not a tensor: scheduler(s), step, RNG
                    states (torch, CUDA, python, numpy)
    hf/             the base model's config, generation config and tokenizer files, so
                    export and resume need nothing outside this directory
    meta.json       written last by rank 0 after a barrier: its presence marks the
                    checkpoint complete (a crash mid-save leaves no meta.json and
                    `latest()` skips the directory)

Equality after resume is exact: fp32 tensors round-trip bit for bit, the LR
scheduler is rebuilt from config and given back its step, and the RNG streams
continue where they stopped.

Why nothing here unpickles freely: a checkpoint directory is a file a user may have
been handed, and `pickle` runs code. `rank_<r>.pt` holds plain data only (the numpy RNG
state is stored as a list of ints) and is read with `torch.load(weights_only=True)`;
DCP's `.metadata`, a pickle, is read by an unpickler that admits only DCP's own
metadata classes, torch sizes and dtypes (`dcp_reader`). Anything else is refused
with `UnsafeCheckpoint`, naming the file. Every file is fsynced, and the directory,
before `meta.json` marks the checkpoint complete, so a power cut never leaves a
"complete" checkpoint whose data is still in the page cache.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from furlong.train import dist

META = "meta.json"
FORMAT = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")

Stateful = dict[str, tuple[nn.Module, torch.optim.Optimizer | None]]


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holds more than plain data (objects `weights_only` or the DCP allowlist refuse)."""


def rng_state() -> dict[str, Any]:
    """Every RNG stream as plain data (`weights_only` loads it): numpy's key array becomes a list of ints."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dcp_state(parts: Stateful) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    out: dict[str, Any] = {}
    for name, (module, optim) in parts.items():
        if optim is None:
            out[name] = get_model_state_dict(module)
        else:
            out[name], out[f"{name}_optim"] = get_state_dict(module, optim)
    return out


def fsync_tree(path: str | Path) -> None:
    """fsync every file under `path`, then every directory (deepest first): their entries are data too."""
    dirs = []
    for root, _, files in os.walk(path):
        dirs.append(root)
        for name in files:
            fsync_path(Path(root) / name)
    for d in reversed(dirs):
        fsync_path(d)


def fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# DCP's `.metadata` pickle may name these and nothing else: its own dataclasses, sizes, dtypes, a path.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
_DCP_GLOBALS |= {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: Path):
        super().__init__(io.BytesIO(data))
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        obj = None
        if module in _DCP_MODULES or (module, name) in _DCP_GLOBALS:
            obj = super().find_class(module, name)
            if module in _DCP_MODULES and not isinstance(obj, type):
                obj = None  # classes only: no function of those modules is callable from a pickle
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)
        if obj is None:
            raise UnsafeCheckpoint(
                f"{self.source}: refusing to load: it names {module}.{name}, which a furlong checkpoint's "
                "DCP metadata never holds (only DCP metadata classes, torch sizes and dtypes are allowed)"
            )
        return obj


def dcp_reader(dcp_dir: str | Path) -> Any:
    """A DCP `FileSystemReader` whose `.metadata` is read by the allowlisting unpickler (see the module docstring).

    The metadata is read once here first: DCP itself would swallow a refusal into a fallback and a
    `CheckpointException`; read here, a refusal is an `UnsafeCheckpoint` naming the file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    first = Path(dcp_dir) / ".metadata"
    if not first.is_file():
        raise FileNotFoundError(f"{first}: not found; not a complete DCP checkpoint")
    _MetadataUnpickler(first.read_bytes(), first).load()

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f.read(), Path(path)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(dcp_dir))


def load_plain(path: str | Path) -> Any:
    """`torch.load(weights_only=True)`; anything that is not plain data is refused, naming the file."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise  # a damaged file, not a refused one
        raise UnsafeCheckpoint(
            f"{path}: refusing to load: it holds objects other than tensors and plain data (not written by "
            f"this furlong, or tampered with); torch.load(weights_only=True) said: {str(e).splitlines()[0]}"
        ) from e


def save(path: str | Path, parts: Stateful, rank_state: dict[str, Any], meta: dict[str, Any], model_dir: str) -> Path:
    """Save every part collectively (all ranks call this), then mark the checkpoint complete."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    rank, _ = dist.world()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(_dcp_state(parts), checkpoint_id=str(path / "dcp"), no_dist=dist.world()[1] == 1)
    torch.save({**rank_state, "rng": rng_state()}, path / f"rank_{rank}.pt")
    if rank == 0:
        hf = path / "hf"
        hf.mkdir(exist_ok=True)
        for f in Path(model_dir).iterdir():
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(f, hf / f.name)
    dist.barrier()
    if rank == 0:
        fsync_tree(path)  # every rank's files are written (the barrier): durable before the marker
        tmp = path / (META + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, **meta}, indent=2))
        fsync_path(tmp)
        tmp.rename(path / META)
        fsync_path(path)
    dist.barrier()
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    meta = Path(path) / META
    if not meta.exists():
        raise FileNotFoundError(f"{meta}: not found; {path} is not a complete furlong checkpoint")
    return json.loads(meta.read_text())


def load(path: str | Path, parts: Stateful) -> dict[str, Any]:
    """Load every part in place (all ranks call this) and return this rank's extra state.

    RNG states are restored here. A checkpoint from a different world size loads
    its tensors resharded; ranks without their own file take rank 0's scheduler
    and step (RNG streams are then not those of an uninterrupted run).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = Path(path)
    read_meta(path)
    state = _dcp_state(parts)
    try:
        dcp.load(state, storage_reader=dcp_reader(path / "dcp"), no_dist=dist.world()[1] == 1)
    except CheckpointException as e:  # a BaseException: as an Exception, so a resume can fall back
        raise RuntimeError(f"{path / 'dcp'}: DCP could not load it: {e}") from None
    for name, (module, optim) in parts.items():
        if optim is None:
            set_model_state_dict(module, state[name])
        else:
            set_state_dict(module, optim, model_state_dict=state[name], optim_state_dict=state[f"{name}_optim"])
    rank, _ = dist.world()
    own = path / f"rank_{rank}.pt"
    extra = load_plain(own if own.exists() else path / "rank_0.pt")
    set_rng_state(extra.pop("rng"))
    return extra


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete `checkpoints/step_<n>/` of a run directory, or None."""
    root = Path(run_dir) / "checkpoints"
    steps = []
    for d in root.glob("step_*") if root.is_dir() else []:
        m = re.fullmatch(r"step_(\d+)", d.name)
        if m and (d / META).exists():
            steps.append((int(m.group(1)), d))
    return max(steps)[1] if steps else None
