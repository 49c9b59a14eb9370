"""The engine's parameter schema (name → shape, dtype), so a whole sync is checked before it starts.

Why: the engine refuses a bad name or shape atomically, but per request; a
bucketed sync is many requests, and a refusal in bucket 3 would leave buckets
1–2 applied. Knowing the schema up front turns that into an error before the
first byte moves.

Where it comes from, cheapest first: the engine's `model_path` (from
`/get_model_info`) when this machine can read it — the model is built on the
meta device, which costs no memory — else the engine's per-tensor checksum
endpoint (`/get_weights_checksum`, see `verify`), which also lists shapes.
With neither, the check is skipped and only the engine's per-request check
remains (said in the error message of a failed sync).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import torch

from furlong.core.api import LORA_TENSOR_PREFIX
from furlong.core.client import EngineControl, EngineError
from furlong.weights.report import WeightSyncError

Schema = dict[str, tuple[tuple[int, ...], str]]


@lru_cache(maxsize=8)  # M engines of one model: build it once
def model_schema(model_path: str, dtype: str) -> Schema:
    """Names and shapes of the HF model at `model_path`, built on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {n: (tuple(t.shape), dtype) for n, t in model.state_dict().items()}


def engine_schema(engine: EngineControl) -> Schema | None:
    """The schema of the model `engine` serves; None when neither source is available (see the module docstring)."""
    info = engine.model_info()
    path = info.get("model_path")
    if path and (Path(path) / "config.json").exists():
        return model_schema(path, str(info.get("dtype", "float32")))
    try:
        sums = engine.weights_checksum()
    except EngineError as e:
        if e.status is None:  # unreachable, not merely without the endpoint
            raise
        return None
    return {n: (tuple(s["shape"]), s["dtype"]) for n, s in sums["tensors"].items()}


def check_against(schema: Schema | None, items: Iterable[tuple[str, tuple[int, ...], torch.dtype]], url: str) -> None:
    """Raise `WeightSyncError` naming the first tensor the engine at `url` would refuse."""
    if schema is None:
        return
    for name, shape, dtype in items:
        if name.startswith(LORA_TENSOR_PREFIX):
            continue  # adapter-only sync: the engine checks adapter tensors against its modules on arrival
        if name not in schema:
            raise WeightSyncError(f"tensor {name!r}: no such parameter in the engine model at {url}; nothing was sent")
        want, want_dtype = schema[name]
        if tuple(shape) != want:
            raise WeightSyncError(
                f"tensor {name!r}: shape {list(shape)} != engine shape {list(want)} at {url}; nothing was sent"
            )
        if not dtype.is_floating_point and str(dtype).removeprefix("torch.") != want_dtype:
            raise WeightSyncError(
                f"tensor {name!r}: dtype {dtype} cannot load into {want_dtype} at {url}; nothing was sent"
            )
