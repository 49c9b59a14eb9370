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
"""

from __future__ import annotations

import json
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


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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
        (path / META).write_text(json.dumps({"format": FORMAT, **meta}, indent=2))
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
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = Path(path)
    read_meta(path)
    state = _dcp_state(parts)
    dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=dist.world()[1] == 1)
    for name, (module, optim) in parts.items():
        if optim is None:
            set_model_state_dict(module, state[name])
        else:
            set_state_dict(module, optim, model_state_dict=state[name], optim_state_dict=state[f"{name}_optim"])
    rank, _ = dist.world()
    own = path / f"rank_{rank}.pt"
    extra = torch.load(own if own.exists() else path / "rank_0.pt", weights_only=False)
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
