"""The engine's receive side of weight updates: validate everything, then copy everything.

Atomicity is two-phase: `check_named_tensors` rejects an unknown name or a
wrong shape (naming the tensor) before a single parameter is touched; only
then does `apply_named_tensors` copy, on the scheduler thread between two
forwards. Names are the HF model's own `state_dict` names — the native
forward reads those very parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


class WeightUpdateError(ValueError):
    """A weight update the engine refused; the message names the tensor or file."""


def check_named_tensors(model, named: dict[str, torch.Tensor], quant=None) -> dict[str, torch.Tensor]:
    """`quant`: the engine's `QuantizedWeights` (engine.quantization), which checks the codes + scales it owns."""
    if not named:
        raise WeightUpdateError("named_tensors: no tensors given")
    params = model.state_dict(keep_vars=True)
    for name, t in named.items():
        if "@" in name and quant is None:
            raise WeightUpdateError(
                f"tensor {name!r}: quantised codes, but this engine serves unquantised weights (engine.quantization=none)"
            )
        if "@" in name:
            continue  # codes + scales: checked by quant.plan
        if name not in params:
            raise WeightUpdateError(f"tensor {name!r}: no such parameter in the model")
        if tuple(t.shape) != tuple(params[name].shape):
            raise WeightUpdateError(f"tensor {name!r}: shape {list(t.shape)} != model shape {list(params[name].shape)}")
        if not (t.dtype.is_floating_point or t.dtype == params[name].dtype):
            raise WeightUpdateError(f"tensor {name!r}: dtype {t.dtype} cannot load into {params[name].dtype}")
    return params


@torch.no_grad()
def apply_named_tensors(model, named: dict[str, torch.Tensor], quant=None) -> None:
    """Check everything (quantising dense weights that `quant` holds), then copy everything.

    A parameter held in oneDNN's packed layout (a meta placeholder naming its rows, `engine/packed.py`)
    is written straight into the packed weight: that one pass is the whole update, no re-pack follows."""
    from furlong.engine.packed import rows_of

    params = check_named_tensors(model, named, quant)
    copies = quant.plan(named) if quant is not None else []
    for name, t in named.items():
        if quant is not None and quant.owns(name):
            continue
        rows = rows_of(params[name])
        if rows is not None:
            rows.write(t)
        else:
            params[name].copy_(t)
    if copies:
        quant.commit(copies)


def load_disk(model, path: str | Path) -> dict[str, torch.Tensor]:
    """Read a checkpoint directory (or one .safetensors file) into model-named tensors.

    Files whose names are already the model's are taken as they are (strict);
    a HF checkpoint in another on-disk layout (e.g. per-expert MoE weights) is
    loaded through `from_pretrained`, which converts it, after checking its
    architecture matches.
    """
    from safetensors.torch import load_file

    p = Path(path)
    if not p.exists():
        raise WeightUpdateError(f"model_path: {str(p)!r} does not exist")
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"model_path: no .safetensors files in {str(p)!r}")
    named: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            named.update(load_file(str(f)))
        except Exception as e:
            raise WeightUpdateError(f"model_path: cannot read {f.name}: {e}") from None
    known = model.state_dict().keys()
    unknown = [n for n in named if n not in known]
    if unknown and p.is_dir() and (p / "config.json").exists():
        cfg = json.loads((p / "config.json").read_text())
        if cfg.get("model_type") != model.config.model_type:
            raise WeightUpdateError(
                f"model_path: checkpoint is {cfg.get('model_type')!r}, engine runs {model.config.model_type!r}"
            )
        from transformers import AutoModelForCausalLM

        other = AutoModelForCausalLM.from_pretrained(str(p), dtype=next(model.parameters()).dtype)
        return dict(other.state_dict())
    return named


def receive_device(group, engine_device: torch.device | str) -> torch.device:
    """Where broadcast buffers must live: NCCL moves only GPU memory, gloo only host memory.

    With NCCL the buffers are allocated on the engine's own device, so a
    tensor goes from the trainer's GPU to the engine's GPU with no host copy
    and `apply_named_tensors` copies device to device. Every other backend
    (gloo on CPU) keeps host buffers, exactly as before. (The NCCL branch
    needs a GPU and is not exercised by the CPU test suite.)
    """
    name = group.name() if callable(getattr(group, "name", None)) else ""
    return torch.device(engine_device) if name.lower() == "nccl" else torch.device("cpu")


def receive_distributed(
    group,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    src: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Receive tensors broadcast by `src`, one per name, in order, into fresh buffers.

    `device` is the engine's device; buffers go there when the group is NCCL
    (`receive_device`), to host memory otherwise. Every announced tensor is
    received even if it will be rejected, so the sender never hangs on a
    half-finished broadcast.
    """
    from furlong.weights.dist import broadcast
    from furlong.weights.tensors import parse_dtype

    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError(f"names/dtypes/shapes: lengths differ ({len(names)}, {len(dtypes)}, {len(shapes)})")
    where = receive_device(group, device)
    try:
        bufs = {
            n: torch.empty([int(x) for x in s], dtype=parse_dtype(d, f"dtypes[{n}]"), device=where)
            for n, d, s in zip(names, dtypes, shapes)
        }
    except (ValueError, RuntimeError) as e:
        raise WeightUpdateError(f"names/dtypes/shapes: {e}") from None
    return {n: broadcast(group, t, src) for n, t in bufs.items()}
