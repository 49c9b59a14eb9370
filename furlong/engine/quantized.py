"""`engine.quantization`: the engine's dense projections held as codes + scales, and computed from them.

What is stored. Every parameter `quantizable` names (`furlong/weights/quant/payload.py`: the q/k/v/o and
gate/up/down projections of each decoder layer) lives in a `QuantLinear` (`furlong/weights/quant/linear.py`)
as codes + scales in its format, one per HF parameter (never fused: fp8's 128x128 tiles and nvfp4's
tensor scale are per weight, and per-weight is exactly what `train.qat` fake-quantises and what the
trainer's sender quantises). The HF parameter itself is replaced by a *meta* tensor of the same name,
shape and dtype: it keeps the update schema (names and shapes for the all-or-nothing check) and costs no
memory. Kept dense, and why: embeddings (a lookup, not a matmul), norms and biases (tiny), `lm_head`
(full precision on purpose, as QAT assumes; oneDNN-packed like before), MoE routers and expert stacks
(3-D, computed expert by expert; not quantised on either side).

How it computes. On CPU each call dequantises the weight per block (fp32 decode, one cast to the
activation dtype) and runs a dense matmul: the numerics are exactly those of the dequantised weight,
which is what the engine tests compare with. On CUDA, fp8 goes through `torch._scaled_mm`
(`QuantLinear`'s guarded path; written on a CPU-only machine and NOT TESTED on a GPU), the other formats
dequantise as on CPU. Nothing dense is cached, so the memory saving is real and an update needs no
re-pack.

Updates. A sync delivers either codes + scales (`name@fmt.role`, quantised once by the trainer's sender)
or the dense weight under its own name (disk checkpoints, senders without quantisation), which the engine
quantises here, once. `plan` checks and quantises everything before `commit` copies anything, so a bad
tensor leaves the old weights whole, as for dense updates. Roles of one weight may arrive in different
buckets (each role is copied into its own buffer); a sync stamps its version only with its last bucket.
"""

from __future__ import annotations

import torch
from torch import nn

from furlong.engine.weight_update import WeightUpdateError
from furlong.weights.quant import FORMATS, QuantLinear, quantize
from furlong.weights.quant.payload import parse_payload_name, quantizable, to_payload
from furlong.weights.quant.tensor import QuantizedTensor

ENGINE_FORMATS = ("none", *FORMATS)


class QuantWeightError(WeightUpdateError):
    """A quantised update the engine refuses; the message names the tensor (a 400 like any refused update)."""


class QuantProj:
    """One quantised projection for `NativeModel.proj`: y = x @ dequantize(W).T (+ the HF bias)."""

    def __init__(self, layer: QuantLinear):
        self.layer = layer

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.layer(x)
        return y if bias is None else y + bias.to(y.dtype)


class QuantizedWeights:
    """The engine's quantised projections, by HF parameter name (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"engine.quantization: unknown format {fmt!r}; choose one of {list(ENGINE_FORMATS)}")
        self.fmt = fmt
        self.layers: dict[str, QuantLinear] = {}
        self._by_module: dict[int, str] = {}
        self._used: set[str] = set()
        for mname, m in hf_model.named_modules():
            name = f"{mname}.weight"
            if isinstance(m, nn.Linear) and quantizable(name, m.weight.shape):
                self.layers[name] = QuantLinear.from_linear(m, fmt, name=name)
                self.layers[name].bias = None  # the HF module's bias stays the live one (synced by name)
                self._by_module[id(m)] = name
                w = m.weight
                m.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)

    def holds(self, module: nn.Module) -> bool:
        return id(module) in self._by_module

    def proj(self, module: nn.Module) -> QuantProj | None:
        """The quantised projection for an HF linear, or None when that linear stays dense."""
        name = self._by_module.get(id(module))
        if name is None:
            return None
        self._used.add(name)
        return QuantProj(self.layers[name])

    def check_all_used(self) -> None:
        """Every quantised weight must be read by the forward (else it would compute with a meta tensor)."""
        unused = sorted(set(self.layers) - self._used)
        if unused:
            raise ValueError(
                f"engine.quantization={self.fmt}: {unused[0]} is quantised but the native forward does not "
                "read it through NativeModel.proj; this model cannot be served quantised"
            )

    # ------------------------------------------------------------------ state (checksums, memory)
    def held(self) -> dict[str, torch.Tensor]:
        """What the engine holds for its quantised weights, by payload name (what `weights.verify` hashes)."""
        return {n: t for name, layer in self.layers.items() for n, t in to_payload(name, layer.qweight)}

    def nbytes(self) -> int:
        return sum(layer.qweight.nbytes() for layer in self.layers.values())

    # ------------------------------------------------------------------ updates
    def owns(self, name: str) -> bool:
        """Whether `name` (a quantised parameter or a payload name) is this store's to check and apply."""
        return name in self.layers or parse_payload_name(name) is not None

    def plan(self, named: dict[str, torch.Tensor]) -> list[tuple[QuantLinear, str, torch.Tensor]]:
        """Check (and, for dense weights, quantise) every tensor this store owns; copy nothing.

        Returns (layer, role, tensor) copies for `commit`. Raises QuantWeightError naming the first bad tensor.
        """
        held = {name: layer.qweight.tensors() for name, layer in self.layers.items()}
        out: list[tuple[QuantLinear, str, torch.Tensor]] = []
        for name, t in named.items():
            parsed = parse_payload_name(name)
            if parsed is None:
                if name in self.layers:  # a dense weight: quantised here, once
                    out.extend(self._quantized(name, t))
                continue
            base, fmt, role = parsed
            if base not in self.layers:
                raise QuantWeightError(f"tensor {name!r}: {base!r} is not a quantised weight of this engine")
            if fmt != self.fmt:
                raise QuantWeightError(
                    f"tensor {name!r}: carries {fmt} codes, this engine holds {self.fmt} "
                    "(engine.quantization must match on trainer and engines)"
                )
            want = held[base].get(role)
            if want is None:
                raise QuantWeightError(f"tensor {name!r}: {self.fmt} has no role {role!r}")
            if t.dtype != want.dtype or tuple(t.shape) != tuple(want.shape):
                raise QuantWeightError(
                    f"tensor {name!r}: {t.dtype} {list(t.shape)} != held {want.dtype} {list(want.shape)}"
                )
            out.append((self.layers[base], role, t))
        return out

    def _quantized(self, name: str, t: torch.Tensor) -> list[tuple[QuantLinear, str, torch.Tensor]]:
        layer = self.layers[name]
        if tuple(t.shape) != (layer.out_features, layer.in_features):
            raise QuantWeightError(f"tensor {name!r}: shape {list(t.shape)} != model shape {list(layer.qweight.shape)}")
        if not t.is_floating_point():
            raise QuantWeightError(f"tensor {name!r}: dtype {t.dtype} is not a floating-point weight")
        try:
            qt = quantize(t.to(layer.q_data.device), self.fmt, name=name)
        except ValueError as e:
            raise QuantWeightError(f"tensor {name!r}: {e}") from None
        return [(layer, role, v) for role, v in _layout_of(qt, layer).items()]

    @staticmethod
    @torch.no_grad()
    def commit(copies: list[tuple[QuantLinear, str, torch.Tensor]]) -> None:
        for layer, role, t in copies:
            buf = getattr(layer, f"q_{role}")
            buf.copy_(t.to(buf.device).contiguous().view(buf.dtype))


def _layout_of(qt: QuantizedTensor, layer: QuantLinear) -> dict[str, torch.Tensor]:
    """`qt`'s tensors, checked against the layer's (an int4 weight quantised with other scales would differ)."""
    mine = layer.qweight.tensors()
    got = qt.tensors()
    for role, t in got.items():
        if role not in mine or mine[role].dtype != t.dtype or mine[role].shape != t.shape:
            raise QuantWeightError(f"{layer.fmt} {role}: {t.dtype} {list(t.shape)} does not fit the held layout")
    return got


def held_state_dict(hf_model: nn.Module, model) -> dict[str, torch.Tensor]:
    """What the engine holds, by name: the HF state dict, with each quantised weight's meta placeholder
    replaced by its codes + scales (payload names) and each packed weight's (`engine/packed.py`) by its
    values read back from the packed layout. What `/get_weights_checksum` hashes."""
    from furlong.engine.packed import rows_of

    sd = {
        n: (r.read() if (r := rows_of(p)) is not None else p.detach())
        for n, p in hf_model.state_dict(keep_vars=True).items()
    }
    quant = getattr(model, "quant", None)
    if quant is None:
        return sd
    for name in quant.layers:
        sd.pop(name, None)
    sd.update(quant.held())
    return sd
