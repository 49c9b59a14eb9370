"""The four weight formats, as pairs of pure functions on a 2-D fp32 weight [out_features, in_features].

Each `*_quantize(w)` returns an `Encoded` (codes, scales, optional tensor scale, block shape); each
`*_dequantize(...)` rebuilds fp32 rows `rows` of the weight from them. Blocks run along the input dim
(the reduction dim of `x @ w.T`), so one scale multiplies one contiguous run of a dot product.

Ragged edges: an input dim (or, for FP8, either dim) that is not a whole number of blocks is handled by
zero-padding the last block while computing its scale; zeros change no block's amax, so the scale is the
one the real elements alone would give. FP8 and MXFP8 codes are stored at the original shape; the packed
4-bit formats store each row padded to whole blocks (at most block-1 extra codes per row), and
dequantisation crops back to the original shape. Nothing is refused for being ragged.

Scales are never 0 or NaN: every format clamps its scale below (stated per format), so all-zero blocks
decode to exact zeros and no division by zero occurs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from furlong.weights.quant.codecs import (
    E2M1_MAX,
    E4M3_EMAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E8M0_MIN_EXP,
    blocks,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    floor_log2,
    pack_nibbles,
    to_e4m3,
    unpack_nibbles,
)

FP8_BLOCK = 128  # DeepSeek-V3 tech report §3.3.2: 128x128 weight tiles
MX_BLOCK = 32  # OCP MX spec v1.0 §5.2: k = 32 for every concrete MX format
NVFP4_BLOCK = 16  # NVIDIA NVFP4: 16 e2m1 values share one e4m3 scale
INT4_GROUP = 128
INT4_MAX = 7  # symmetric: scale = amax / 7, codes -8..7 stored as offset binary (q + 8)
FP32_TINY = torch.finfo(torch.float32).tiny  # 2^-126, the smallest normal fp32
# NVFP4's tensor scale is clamped here so every decoded per-block factor (>= 2^-9 * tensor scale) is a
# normal fp32 number: 2^-9 * 2^-117 = 2^-126.
NVFP4_MIN_TENSOR_SCALE = 2.0**-117


@dataclass(frozen=True)
class Encoded:
    data: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]
    tensor_scale: torch.Tensor | None = None


def _row_range(rows: slice, n: int) -> tuple[int, int]:
    start, stop, step = rows.indices(n)
    if step != 1:
        raise ValueError(f"dequantize takes a contiguous row slice, got step {step}")
    return start, max(start, stop)


def _from_blocks(x: torch.Tensor, cols: int) -> torch.Tensor:
    """[rows, nblocks, block] -> [rows, cols], dropping the zero padding of the ragged last block."""
    return x.reshape(x.shape[0], -1)[:, :cols]


# ---------------------------------------------------------------------------------- FP8, 128x128 tiles
def fp8_quantize(w: torch.Tensor) -> Encoded:
    """FP8 e4m3 with one fp32 scale per 128x128 tile (DeepSeek-V3 tech report §3.3.2, "block-wise").

    scale = amax(tile) / 448, so the tile's largest magnitude maps onto e4m3's max normal; codes are
    e4m3(w / scale), rounded to nearest even. The stored scale is the *dequantisation* multiplier (what
    DeepSeek-V3 checkpoints call `weight_scale_inv`), shape [ceil(out/128), ceil(in/128)]. Scales are
    clamped below at 2^-126 (the smallest normal fp32), so an all-zero tile gets a positive scale.
    """
    rows, cols = w.shape
    b = FP8_BLOCK
    padded = F.pad(w, (0, -cols % b, 0, -rows % b))
    tiles = padded.reshape(padded.shape[0] // b, b, padded.shape[1] // b, b)
    scales = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=FP32_TINY)
    codes = to_e4m3(tiles / scales[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return Encoded(codes.contiguous(), scales, (b, b))


def fp8_dequantize(data: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], rows: slice) -> torch.Tensor:
    start, stop = _row_range(rows, shape[0])
    tile_rows = torch.arange(start, stop, device=data.device) // FP8_BLOCK
    row_scales = scales[tile_rows].repeat_interleave(FP8_BLOCK, dim=1)[:, : shape[1]]
    return data[start:stop].float() * row_scales


# ------------------------------------------------------------------------- MXFP8, 32-element E8M0 blocks
def mxfp8_quantize(w: torch.Tensor) -> Encoded:
    """MXFP8 (OCP MX spec v1.0): 32 e4m3 elements along the input dim share one E8M0 scale.

    §6.3: shared exponent = floor(log2(amax)) - emax_elem with emax_elem = 8 for e4m3, scale X = 2^that,
    elements = e4m3(V / X) with round-to-nearest-even and values beyond ±448 clamped to ±448 (amax / X
    lies in [256, 512), so the top of a block can saturate: that is the spec's choice, not a bug).
    The exponent is clamped to E8M0's range [-127, 127]; an all-zero block gets the smallest, 2^-127
    (code 0), as the OCP reference library does. Scales are stored as torch.float8_e8m0fnu, shape
    [out, ceil(in/32)].
    """
    rows, cols = w.shape
    wb = blocks(w, MX_BLOCK)
    amax = wb.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, floor_log2(amax) - E4M3_EMAX, E8M0_MIN_EXP)
    scales = e8m0_encode(exponent)
    codes = _from_blocks(to_e4m3(wb / e8m0_decode(scales)[..., None]), cols)
    return Encoded(codes.contiguous(), scales, (1, MX_BLOCK))


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], rows: slice) -> torch.Tensor:
    start, stop = _row_range(rows, shape[0])
    elements = blocks(data[start:stop].float(), MX_BLOCK)
    return _from_blocks(elements * e8m0_decode(scales[start:stop])[..., None], shape[1])


# ------------------------------------------------------------------ NVFP4, 16 e2m1 + e4m3 + fp32 tensor
def nvfp4_quantize(w: torch.Tensor) -> Encoded:
    """NVFP4: 16 e2m1 elements share one e4m3 block scale, and the tensor has one fp32 scale.

    Two-level scale (NVIDIA, "NVFP4" in the Blackwell/Transformer Engine docs): tensor scale
    s_t = amax(tensor) / (6 * 448), so block scales amax(block) / 6 / s_t land in e4m3's range (<= 448);
    block scale s_b = e4m3(amax(block) / 6 / s_t), clamped below at e4m3's smallest subnormal 2^-9 (so an
    all-zero block never gets a zero scale); elements q = e2m1(w / (s_b * s_t)), nearest-even, clamped to
    ±6 (rounding s_b down can push a block's top just past 6). s_t is clamped below at 2^-117.
    Codes are packed two per byte, shape [out, ceil(in/16)*16/2]; block scales [out, ceil(in/16)].
    """
    rows, cols = w.shape
    tensor_scale = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp(min=NVFP4_MIN_TENSOR_SCALE)
    wb = blocks(w, NVFP4_BLOCK)
    block_scales = to_e4m3((wb.abs().amax(dim=-1) / E2M1_MAX / tensor_scale).clamp(min=E4M3_MIN_SUBNORMAL))
    factor = block_scales.float() * tensor_scale
    codes = e2m1_encode(wb / factor[..., None]).reshape(rows, -1)
    return Encoded(pack_nibbles(codes), block_scales, (1, NVFP4_BLOCK), tensor_scale)


def nvfp4_dequantize(
    data: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, shape: tuple[int, int], rows: slice
) -> torch.Tensor:
    start, stop = _row_range(rows, shape[0])
    elements = e2m1_decode(unpack_nibbles(data[start:stop])).reshape(stop - start, -1, NVFP4_BLOCK)
    factor = scales[start:stop].float() * tensor_scale
    return _from_blocks(elements * factor[..., None], shape[1])


# -------------------------------------------------------------------- INT4 weight-only, symmetric groups
def int4_quantize(w: torch.Tensor, group: int = INT4_GROUP, scale_dtype: torch.dtype = torch.float32) -> Encoded:
    """INT4 weight-only, *symmetric* (no zero point), one scale per `group` elements along the input dim.

    scale = amax(group) / 7 (clamped below at 2^-126, then stored in `scale_dtype`, fp32 or bf16);
    q = clamp(round_half_even(w / scale), -8, 7) with the *stored* scale, so codes and dequantisation
    agree exactly; q = -8 is representable but only reached if a rounded bf16 scale pushes a value past
    -7.5. Codes are stored offset-binary (q + 8, 0..15), packed two per byte, shape
    [out, ceil(in/group)*group/2]; scales [out, ceil(in/group)]. Symmetric is GPTQ/Marlin's sym=True
    layout and what int4 QAT fake-quantises; it spends no bits on a zero point.
    """
    rows, cols = w.shape
    wb = blocks(w, group)
    scales = (wb.abs().amax(dim=-1) / INT4_MAX).clamp(min=FP32_TINY).to(scale_dtype)
    q = torch.round(wb / scales.float()[..., None]).clamp(-8, INT4_MAX)
    codes = (q + 8).to(torch.uint8).reshape(rows, -1)
    return Encoded(pack_nibbles(codes), scales, (1, group))


def int4_dequantize(
    data: torch.Tensor, scales: torch.Tensor, group: int, shape: tuple[int, int], rows: slice
) -> torch.Tensor:
    start, stop = _row_range(rows, shape[0])
    q = unpack_nibbles(data[start:stop]).float().sub_(8).reshape(stop - start, -1, group)
    return _from_blocks(q * scales[start:stop].float()[..., None], shape[1])
