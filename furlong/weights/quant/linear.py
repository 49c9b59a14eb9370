"""`QuantLinear`: an nn.Linear whose weight is a QuantizedTensor, and `quantize_model_linears` to swap them in.

On CPU (and on CUDA for every format but fp8) the forward dequantises the weight per block, in chunks of
output rows, and runs a dense matmul in the input's dtype: the numerics are exactly those of the
dequantised weight (`qweight.dequantize()`), which is what engine tests compare against. Nothing is cached:
each forward decodes the current codes, so `load_(qt)` (an in-place copy into the same buffers, as a weight
sync wants) takes effect on the next call with no invalidation step.

The codes and scales live in integer-typed buffers (bit-for-bit views of the real dtypes): `.to(device)`
moves them, `state_dict()` saves them exactly, and `model.to(torch.bfloat16)` leaves them alone (a
floating float8/fp32 buffer would be cast by Module.to).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from furlong.weights.quant.codecs import E4M3_MAX, to_e4m3
from furlong.weights.quant.formats import FP8_BLOCK, FP32_TINY
from furlong.weights.quant.tensor import QuantizedTensor, quantize

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_ROLES = ("data", "scales", "tensor_scale")


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(_RAW[t.element_size()])


class QuantLinear(nn.Module):
    """y = x @ dequantize(qweight).T + bias, with the weight stored quantised (see module docstring)."""

    def __init__(self, qweight: QuantizedTensor, bias: torch.Tensor | None = None, chunk_rows: int = 2048):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.chunk_rows = chunk_rows
        self._set_meta(qweight)
        for role, t in qweight.tensors().items():
            self.register_buffer(f"q_{role}", _raw(t).clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, fmt: str, name: str = "weight", chunk_rows: int = 2048, **quant_kwargs
    ) -> QuantLinear:
        """Quantise `linear`'s weight (quant_kwargs go to `quantize`); the bias is kept as it is."""
        return cls(quantize(linear.weight, fmt, name=name, **quant_kwargs), linear.bias, chunk_rows)

    def _set_meta(self, qt: QuantizedTensor) -> None:
        self.fmt, self.block, self.weight_dtype = qt.fmt, qt.block, qt.dtype
        self._dtypes = {role: t.dtype for role, t in qt.tensors().items()}

    @property
    def qweight(self) -> QuantizedTensor:
        """The stored weight as a QuantizedTensor (zero-copy views of the buffers)."""
        views = {role: getattr(self, f"q_{role}").view(dtype) for role, dtype in self._dtypes.items()}
        return QuantizedTensor(
            self.fmt,
            views["data"],
            views["scales"],
            (self.out_features, self.in_features),
            self.weight_dtype,
            self.block,
            views.get("tensor_scale"),
        )

    @torch.no_grad()
    def load_(self, qt: QuantizedTensor, bias: torch.Tensor | None = None) -> None:
        """Replace the weight in place (same buffers, same storage) with another of the same layout."""
        mine = self.qweight
        if (qt.fmt, tuple(qt.shape), qt.block) != (mine.fmt, mine.shape, mine.block):
            raise ValueError(
                f"load_: got {qt.fmt} {tuple(qt.shape)} block {qt.block}, this layer holds "
                f"{mine.fmt} {mine.shape} block {mine.block}"
            )
        new, old = qt.tensors(), mine.tensors()
        for role in _ROLES:
            if role not in old:
                continue
            if new[role].shape != old[role].shape or new[role].dtype != old[role].dtype:
                raise ValueError(
                    f"load_: {role} is {new[role].dtype} {tuple(new[role].shape)}, "
                    f"expected {old[role].dtype} {tuple(old[role].shape)}"
                )
            getattr(self, f"q_{role}").copy_(_raw(new[role]))
        self.weight_dtype = qt.dtype
        if bias is not None:
            if self.bias is None:
                raise ValueError("load_: got a bias for a layer built without one")
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qt = self.qweight
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.is_cuda and qt.fmt == "fp8":
            y = _fp8_scaled_mm_linear(x, qt, bias)
            if y is not None:
                return y
        if self.out_features <= self.chunk_rows:
            return F.linear(x, qt.dequantize(x.dtype), bias)
        parts = [
            F.linear(x, qt.dequantize(x.dtype, rows=slice(r, r + self.chunk_rows)))
            for r in range(0, self.out_features, self.chunk_rows)
        ]
        y = torch.cat(parts, dim=-1)
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
            f"block={self.block}, bias={self.bias is not None}"
        )


_SCALED_MM_BROKEN = False


def _fp8_scaled_mm_linear(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """FP8 GEMM with torch._scaled_mm, or None to fall back to the dequantising path. Used only for CUDA inputs.

    The scheme is DeepSeek-V3's (§3.3.2): per 128-wide slice of the input dim, activations get one e4m3
    scale per row (1x128 tiles) and the weight slice's 128x128 tile scales broadcast over their rows, so
    each slice is one row-wise-scaled _scaled_mm (bf16 out, the dtype row-wise scaling supports) and the
    partial products add up in fp32. The arithmetic is checked on CPU, whose _scaled_mm takes row-wise
    scales too (tests/unit/test_quant_linear.py); on CUDA it is NOT TESTED (written on a CPU-only machine):
    nothing here claims it runs, or runs fast, on any GPU. Any exception (GPU without fp8, a torch without
    row-wise scaling, a shape it rejects) disables this path for the process with a warning; shapes it
    cannot take (in % 128, out % 16) skip it silently.
    """
    global _SCALED_MM_BROKEN
    n, k = qt.shape
    if _SCALED_MM_BROKEN or not hasattr(torch, "_scaled_mm") or k % FP8_BLOCK or n % 16:
        return None
    try:
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        x2 = F.pad(x2, (0, 0, 0, -m % 16)).float()
        out = torch.zeros(x2.shape[0], n, dtype=torch.float32, device=x.device)
        for j in range(k // FP8_BLOCK):
            cols = slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
            xs = x2[:, cols]
            scale_a = (xs.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=FP32_TINY)
            scale_b = qt.scales[:, j].repeat_interleave(FP8_BLOCK)[:n].reshape(1, n).contiguous()
            b = qt.data[:, cols].contiguous().t()  # [128, n], column-major as _scaled_mm wants
            out += torch._scaled_mm(
                to_e4m3(xs / scale_a), b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16
            ).float()
        y = out[:m].to(x.dtype).reshape(*x.shape[:-1], n)
        return y if bias is None else y + bias
    except (RuntimeError, TypeError) as e:  # a backend that rejects the call: dequantise from now on
        _SCALED_MM_BROKEN = True
        warnings.warn(f"fp8 _scaled_mm path disabled, dequantising instead: {e}", stacklevel=2)
        return None


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """`skip` entries match whole dotted components: "lm_head" skips "lm_head", not "lm_head_norm"."""
    return any(f".{s}." in f".{name}." for s in skip)


def quantize_model_linears(
    model: nn.Module, fmt: str, skip: tuple[str, ...] = ("lm_head",), **quant_kwargs
) -> list[str]:
    """Replace every nn.Linear of `model` (bar those `skip` names) by a QuantLinear; return their names.

    The default keeps lm_head in full precision: it is the layer whose error reaches the log-probs
    undamped, and weight-only recipes (DeepSeek-V3's FP8 checkpoints, NVFP4 checkpoints) leave it out too.
    `quant_kwargs` go to `quantize` (e.g. group_size, scale_dtype for int4).
    """
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not _skipped(n, skip)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(linear, fmt, name=name, **quant_kwargs))
    return [name for name, _ in targets]
