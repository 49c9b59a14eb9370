"""Element and scale codecs shared by the block formats in `formats`.

Every function here is elementwise on fp32 tensors and device-agnostic, and none relies on a float8
*arithmetic* kernel or a float4 cast (torch 2.13 on CPU has neither; FACTS.md "Low precision on CPU"):

- FP8 E4M3 ("e4m3fn": no infinities, one NaN pattern, max normal 448; OCP 8-bit FP spec v1.0 §5.3): we
  clamp to ±448 and then use torch's fp32 -> float8_e4m3fn cast, which rounds to nearest, ties to even.
  Clamping first makes saturation explicit instead of relying on the cast's own overflow behaviour.
- FP4 E2M1 (OCP MX spec v1.0 §5.3.3: 1 sign, 2 exponent bits with bias 1, 1 mantissa bit, no inf/NaN,
  values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}): torch has no float4 cast, so encoding counts how many rounding
  boundaries |x| has crossed (integer arithmetic on comparison masks) and decoding is a 16-entry lookup.
- E8M0 (OCP MX spec v1.0 §5.4.1: an 8-bit biased exponent, bias 127, value 2^(e-127), 0xFF = NaN, no
  zero): built from integers and decoded by writing the fp32 exponent field directly, so the
  power of two is exact by construction (2^-127, code 0, is the one fp32 subnormal, built by hand).
- Nibble packing: two 4-bit codes per uint8, element 2i in the low nibble and 2i+1 in the high nibble
  (the order of torch.float4_e2m1fn_x2 and of NVIDIA's packed FP4 layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0  # max normal of e4m3fn: 1.75 * 2^8
E4M3_EMAX = 8  # exponent of the largest normal power of two in e4m3 (OCP MX spec §6.3 "emax_elem")
E4M3_MIN_SUBNORMAL = 2.0**-9
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # 0xFF is NaN, so the largest finite scale is 2^127

# Magnitudes of the 8 non-negative e2m1 codes, in code order (monotone).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoint between code i and code i+1. At an exact midpoint round-to-nearest-even keeps the code whose
# mantissa bit is 0, i.e. the even code: crossing from an even code needs |x| > b, from an odd code |x| >= b.
_E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, saturating at ±448 (never NaN for finite or inf input)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit e2m1 codes in a uint8 tensor (bit 3 = sign), round to nearest even, saturating at ±6.

    The sign bit follows torch.signbit, so -0.0 and negative values that round to zero encode as 0b1000
    (negative zero), as an IEEE-style cast would. NaN has no e2m1 code; callers reject it beforehand.
    """
    a = x.float().abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        code += (a > mid) if i % 2 == 0 else (a >= mid)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8, values 0..15) -> fp32 by table lookup."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Unbiased integer exponents in [-127, 127] -> torch.float8_e8m0fnu (biased uint8 code, value 2^e)."""
    biased = (exponent.to(torch.int32).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP) + E8M0_BIAS).to(torch.uint8)
    return biased.view(torch.float8_e8m0fnu)


def e8m0_decode(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (float8_e8m0fnu or uint8) -> the exact fp32 power of two; code 0xFF decodes to NaN."""
    biased = scales.view(torch.uint8).to(torch.int32)
    bits = torch.where(biased == 0, torch.full_like(biased, 1 << 22), biased << 23)  # 2^-127 is subnormal
    value = bits.view(torch.float32)
    return torch.where(biased == 255, torch.full_like(value, float("nan")), value)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) for x > 0 as int32, exact for subnormal fp32 too (frexp: x = m * 2^e, m in [0.5, 1))."""
    _, exponent = torch.frexp(x.float())
    return exponent.to(torch.int32) - 1


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15, last dim even -> uint8 bytes, last dim halved (element 2i in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dim, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: uint8 bytes -> uint8 codes 0..15, last dim doubled."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dim up to a multiple (zeros change no block's amax, so no scale changes)."""
    extra = -x.shape[-1] % multiple
    return F.pad(x, (0, extra)) if extra else x


def blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[rows, cols] -> [rows, ceil(cols / block), block], zero-padding the ragged last block."""
    x = pad_last(x, block)
    return x.reshape(x.shape[0], -1, block)
