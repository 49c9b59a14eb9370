"""Quantised weights on the wire: which HF parameters are quantised, and how codes + scales are named.

One rule for both sides. The trainer's sender (`Sender(quantization=...)`) and the engine
(`engine.quantization`, `furlong/engine/quantized.py`) must agree, tensor by tensor, on what is quantised,
so both ask `quantizable(name, shape)`: the 2-D weight of a decoder layer's dense projection
(`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`). Left in full precision, on both sides:
`lm_head` (its error reaches the log-probs undamped; `train.qat` skips it too), embeddings, norms, biases,
MoE routers and MoE expert tensors (3-D `[E, ...]` stacks that the native forward multiplies expert by
expert; `train/qat.py` leaves them out as well).

Names. A quantised weight `W` named `name` travels as up to three tensors, each named
`f"{name}@{fmt}.{role}"` with role `data` (codes), `scales` and, for nvfp4, `tensor_scale`
(`QuantizedTensor.tensors()`), in their real dtypes (float8_e4m3fn, float8_e8m0fnu, uint8, float32,
bfloat16). Why the format in the name: an engine serving another format refuses the tensor by name
("...@nvfp4.data: this engine holds fp8"), instead of failing later on an unexplained shape. `@` appears
in no HF parameter name, so a payload name is never mistaken for a parameter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from furlong.weights.quant.tensor import FORMATS, QuantizedTensor, quantize

ROLES = ("data", "scales", "tensor_scale")
_PROJECTION = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
_PAYLOAD = re.compile(r"^(?P<base>[^@]+)@(?P<fmt>[a-z0-9]+)\.(?P<role>[a-z_]+)$")


def quantizable(name: str, shape: Iterable[int]) -> bool:
    """Whether the parameter `name` of this shape is stored quantised (see the module docstring)."""
    return len(tuple(shape)) == 2 and _PROJECTION.search(name) is not None


def payload_name(name: str, fmt: str, role: str) -> str:
    return f"{name}@{fmt}.{role}"


def parse_payload_name(name: str) -> tuple[str, str, str] | None:
    """`"x.weight@fp8.scales"` -> ("x.weight", "fp8", "scales"); None for a plain parameter name."""
    m = _PAYLOAD.match(name)
    return None if m is None else (m["base"], m["fmt"], m["role"])


def to_payload(name: str, qt: QuantizedTensor) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs that carry `qt`, in role order."""
    return [(payload_name(name, qt.fmt, role), t) for role, t in qt.tensors().items()]


def quantize_for_sync(items: list[tuple[str, torch.Tensor]], fmt: str) -> list[tuple[str, torch.Tensor]]:
    """Replace every quantizable tensor of a sync by its codes + scales (others pass unchanged, in order).

    This is the "quantise once per sync" step on the sending side: each weight is quantised here, once,
    and the engine copies the codes into its store as they are. A non-finite weight raises ValueError
    naming it (`quantize`), before anything is sent.
    """
    if fmt not in FORMATS:
        raise ValueError(f"engine.quantization: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in items:
        if quantizable(name, t.shape) and t.is_floating_point():
            out.extend(to_payload(name, quantize(t, fmt, name=name)))
        else:
            out.append((name, t))
    return out
