"""`QuantizedTensor` and `quantize(t, fmt)`: one quantised 2-D weight, whatever its format.

Non-finite weights are refused, not encoded: `quantize` raises ValueError naming the tensor, the format
and the count of NaN/inf values. Why refuse: a NaN weight at sync time means training has already
diverged, and encoding it would silently spread it (in MX and NVFP4 a NaN makes the whole block's amax,
hence the scale, NaN: OCP MX spec v1.0 §6.3), so every rollout would produce garbage with no error.
Large *finite* values are fine: block scales follow the data, and elements that land past the element
format's max after scaling saturate to ±max (never inf or NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from furlong.weights.quant import formats as f

FORMATS = ("fp8", "mxfp8", "nvfp4", "int4")


@dataclass(eq=False)
class QuantizedTensor:
    """A quantised [out_features, in_features] weight: codes, scales and what is needed to rebuild it.

    fmt           "fp8" | "mxfp8" | "nvfp4" | "int4"
    data          codes: float8_e4m3fn [out, in] (fp8, mxfp8) or packed uint8 [out, padded_in / 2] (nvfp4, int4)
    scales        fp32 [ceil(out/128), ceil(in/128)] (fp8), float8_e8m0fnu (mxfp8), float8_e4m3fn (nvfp4),
                  fp32 or bf16 (int4); one per block, blocks along the input dim except fp8's 2-D tiles
    shape, dtype  the original weight's shape and dtype (what dequantize() returns by default)
    block         elements per scale as (rows, cols): (128, 128), (1, 32), (1, 16), (1, group)
    tensor_scale  nvfp4 only: the fp32 per-tensor scale (0-d)
    """

    fmt: str
    data: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    dtype: torch.dtype
    block: tuple[int, int]
    tensor_scale: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that carry the weight (what a transport moves), by role."""
        out = {"data": self.data, "scales": self.scales}
        if self.tensor_scale is not None:
            out["tensor_scale"] = self.tensor_scale
        return out

    def nbytes(self) -> int:
        """Bytes of codes plus scales (plus the tensor scale): what moving this weight costs."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """The same weight on another device (codes and scales moved bit for bit)."""
        moved = {k: v.to(device) for k, v in self.tensors().items()}
        return replace(self, **moved)

    def dequantize(self, dtype: torch.dtype | None = None, rows: slice | None = None) -> torch.Tensor:
        """Rebuild the weight (or the output-feature rows `rows` of it) as `dtype` (default: the original).

        Each block's codes are decoded and multiplied by that block's scale in fp32, then cast once to
        `dtype`; with rows given only those rows are decoded, which bounds the temporary a linear needs.
        """
        rows = slice(None) if rows is None else rows
        if self.fmt == "fp8":
            w = f.fp8_dequantize(self.data, self.scales, self.shape, rows)
        elif self.fmt == "mxfp8":
            w = f.mxfp8_dequantize(self.data, self.scales, self.shape, rows)
        elif self.fmt == "nvfp4":
            w = f.nvfp4_dequantize(self.data, self.scales, self.tensor_scale, self.shape, rows)
        else:
            w = f.int4_dequantize(self.data, self.scales, self.block[1], self.shape, rows)
        return w.to(dtype or self.dtype)


def quantize(
    t: torch.Tensor,
    fmt: str,
    *,
    name: str = "tensor",
    group_size: int = f.INT4_GROUP,
    scale_dtype: torch.dtype = torch.float32,
) -> QuantizedTensor:
    """Quantise a 2-D floating weight [out_features, in_features] to `fmt` (see FORMATS).

    `group_size` and `scale_dtype` apply to int4 only (group along the input dim; fp32 or bf16 scales).
    Raises ValueError, naming `name`, the format and the shape, for: an unknown format, a tensor that is
    not 2-D, empty or not floating point, NaN/inf values, or an int4 group size that is not a positive
    even number. Ragged input dims are zero-padded per block (see `formats`), never refused.
    """
    _check(t, fmt, name, group_size, scale_dtype)
    w = t.detach().float()
    if fmt == "fp8":
        enc = f.fp8_quantize(w)
    elif fmt == "mxfp8":
        enc = f.mxfp8_quantize(w)
    elif fmt == "nvfp4":
        enc = f.nvfp4_quantize(w)
    else:
        enc = f.int4_quantize(w, group_size, scale_dtype)
    return QuantizedTensor(fmt, enc.data, enc.scales, tuple(t.shape), t.dtype, enc.block, enc.tensor_scale)


def _check(t: torch.Tensor, fmt: str, name: str, group_size: int, scale_dtype: torch.dtype) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantisation format {fmt!r} for {name}; expected one of {', '.join(FORMATS)}")
    where = f"{fmt}: {name} (shape {tuple(t.shape)}, {t.dtype})"
    if not t.is_floating_point():
        raise ValueError(f"{where}: only floating-point weights can be quantised")
    if t.dim() != 2:
        raise ValueError(f"{where}: quantisation takes a 2-D weight [out_features, in_features], got {t.dim()}-D")
    if t.numel() == 0:
        raise ValueError(f"{where}: the weight is empty")
    if fmt == "int4":
        if group_size <= 0 or group_size % 2:
            raise ValueError(f"{where}: int4 group_size must be a positive even number, got {group_size}")
        if scale_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{where}: int4 scales are float32 or bfloat16, got {scale_dtype}")
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        first = tuple(int(i) for i in (~finite).nonzero()[0])
        raise ValueError(
            f"{where}: {bad} NaN/inf value(s), first at index {first}; refusing to quantise "
            "a non-finite weight (it would poison its whole block)"
        )
