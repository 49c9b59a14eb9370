"""The four weight formats of furlong.weights.quant, each checked against a reference written from its spec.

The reference quantisers below share no code with the implementation: they enumerate every representable
e4m3 / e2m1 value from the bit-layout formulas of the specs, round to nearest with ties to the even code
by table look-up, and walk the blocks in plain loops (numpy float32 for the few arithmetic steps a
format defines in fp32, so the bits must agree exactly).

Specs: OCP 8-bit Floating Point v1.0 (E4M3), OCP Microscaling Formats (MX) v1.0 (§5.3.3 E2M1, §5.4.1
E8M0, §6.3 conversion), DeepSeek-V3 tech report §3.3.2 (128x128 FP8 tiles), NVIDIA NVFP4 (16-element
e2m1 blocks, e4m3 block scale, fp32 tensor scale).
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch

from furlong.weights.quant import FORMATS, quantize
from furlong.weights.quant.codecs import (
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    pack_nibbles,
    to_e4m3,
    unpack_nibbles,
)

F32 = np.float32
TINY = F32(2.0**-126)


# ------------------------------------------------------------------------------- reference element codecs
def e4m3_value(code: int) -> float:
    """OCP FP8 E4M3: S.EEEE.MMM, bias 7, subnormals at E=0, S.1111.111 is NaN, no infinities."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def e2m1_value(code: int) -> float:
    """OCP MX §5.3.3 FP4 E2M1: S.EE.M, bias 1, subnormal at E=0 (value M * 0.5), no inf/NaN."""
    sign = -1.0 if code & 0x8 else 1.0
    e, m = (code >> 1) & 0x3, code & 0x1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


E4M3_TABLE = [(e4m3_value(c), c) for c in range(0x7F)]  # non-negative finite codes, value increasing
E2M1_TABLE = [(e2m1_value(c), c) for c in range(0x8)]


def rne(table: list[tuple[float, int]], sign_bit: int, x: float) -> int:
    """Round x to the nearest table value (saturating at the largest), ties to the even code."""
    values = [v for v, _ in table]
    a = min(abs(x), values[-1])
    i = bisect.bisect_left(values, a)
    if values[i] == a:
        code = table[i][1]
    else:
        (lo, clo), (hi, chi) = table[i - 1], table[i]
        code = clo if a - lo < hi - a else chi if hi - a < a - lo else (clo if clo % 2 == 0 else chi)
    return code | (sign_bit if math.copysign(1.0, x) < 0 else 0)


def ref_e4m3(x: float) -> int:
    return rne(E4M3_TABLE, 0x80, x)


def ref_e2m1(x: float) -> int:
    return rne(E2M1_TABLE, 0x8, x)


def ref_pack(codes: np.ndarray) -> np.ndarray:
    out = np.zeros((codes.shape[0], codes.shape[1] // 2), dtype=np.uint8)
    for r in range(codes.shape[0]):
        for j in range(0, codes.shape[1], 2):
            out[r, j // 2] = codes[r, j] | (codes[r, j + 1] << 4)
    return out


def ref_bf16(x: F32) -> F32:
    """fp32 -> bf16 (round to nearest even on the dropped 16 bits), returned as fp32."""
    bits = int(np.array(x, dtype=F32).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return np.array(bits, dtype=np.uint32).view(F32)[()]


# ------------------------------------------------------------------------------- reference quantisers
def padded_row_blocks(w: np.ndarray, block: int) -> np.ndarray:
    cols = -(-w.shape[1] // block) * block
    out = np.zeros((w.shape[0], cols), dtype=F32)
    out[:, : w.shape[1]] = w
    return out


def ref_fp8(w: np.ndarray):
    """DeepSeek-V3 128x128 tiles: scale = amax / 448 (fp32, >= 2^-126), code = e4m3(x / scale)."""
    rows, cols = w.shape
    scales = np.zeros((-(-rows // 128), -(-cols // 128)), dtype=F32)
    codes = np.zeros(w.shape, dtype=np.uint8)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            scales[i, j] = s = max(F32(F32(np.abs(tile).max()) / F32(448)), TINY)
            scaled = tile / s
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = [[ref_e4m3(float(v)) for v in r] for r in scaled]
    return codes, scales


def ref_mxfp8(w: np.ndarray):
    """OCP MX §6.3: X = 2^(floor(log2 amax) - 8) clamped to [2^-127, 2^127], P_i = e4m3(V_i / X)."""
    wp = padded_row_blocks(w, 32)
    codes = np.zeros(wp.shape, dtype=np.uint8)
    scale_codes = np.zeros((wp.shape[0], wp.shape[1] // 32), dtype=np.uint8)
    for r in range(wp.shape[0]):
        for b in range(scale_codes.shape[1]):
            block = wp[r, b * 32 : (b + 1) * 32]
            amax = float(np.abs(block).max())
            exp = math.frexp(amax)[1] - 1 - 8 if amax > 0 else -127
            exp = min(max(exp, -127), 127)
            scale_codes[r, b] = exp + 127
            codes[r, b * 32 : (b + 1) * 32] = [ref_e4m3(float(v) / 2.0**exp) for v in block]
    return codes[:, : w.shape[1]], scale_codes


def ref_nvfp4(w: np.ndarray):
    """NVFP4: s_t = amax/(6*448) (>= 2^-117); s_b = e4m3(amax_b/6/s_t) (>= 2^-9); q = e2m1(x / (s_b*s_t))."""
    s_t = max(F32(F32(np.abs(w).max()) / F32(6 * 448)), F32(2.0**-117))
    wp = padded_row_blocks(w, 16)
    codes = np.zeros(wp.shape, dtype=np.uint8)
    scale_codes = np.zeros((wp.shape[0], wp.shape[1] // 16), dtype=np.uint8)
    for r in range(wp.shape[0]):
        for b in range(scale_codes.shape[1]):
            block = wp[r, b * 16 : (b + 1) * 16]
            s_b = max(F32(F32(F32(np.abs(block).max()) / F32(6)) / s_t), F32(2.0**-9))
            scale_codes[r, b] = c = ref_e4m3(float(s_b))
            factor = F32(F32(e4m3_value(c)) * s_t)
            codes[r, b * 16 : (b + 1) * 16] = [ref_e2m1(float(v)) for v in block / factor]
    return ref_pack(codes), scale_codes, s_t


def ref_int4(w: np.ndarray, group: int = 128, bf16: bool = False):
    """Symmetric INT4: s = amax/7 (>= 2^-126, then bf16 if asked), q = clamp(round_half_even(x/s), -8, 7) + 8."""
    wp = padded_row_blocks(w, group)
    codes = np.zeros(wp.shape, dtype=np.uint8)
    scales = np.zeros((wp.shape[0], wp.shape[1] // group), dtype=F32)
    for r in range(wp.shape[0]):
        for g in range(scales.shape[1]):
            block = wp[r, g * group : (g + 1) * group]
            s = max(F32(F32(np.abs(block).max()) / F32(7)), TINY)
            scales[r, g] = s = ref_bf16(s) if bf16 else s
            codes[r, g * group : (g + 1) * group] = [min(max(round(float(v)), -8), 7) + 8 for v in block / s]
    return ref_pack(codes), scales


def wide_range(rows: int = 150, cols: int = 200, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with magnitudes spread over 10^-4..10^2 (exercises subnormal codes), ragged blocks."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 10 ** torch.empty(rows, 1).uniform_(-4, 2, generator=g)
    w[3, :40] = 0.0  # a zero run: whole zero blocks for every row-block format
    return w


def as_u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


# ------------------------------------------------------------------------------- element codecs
def test_e4m3_cast_is_round_to_nearest_even_at_every_midpoint_and_saturates():
    values = [v for v, _ in E4M3_TABLE]
    probes = values + [(a + b) / 2 for a, b in zip(values, values[1:])]  # every tie
    probes += [(a + b) / 2 + d for a, b in zip(values, values[1:]) for d in ((b - a) / 8, -(b - a) / 8)]
    probes += [448.0, 449.0, 464.0, 480.0, 1e6, math.inf, 2.0**-10, 2.0**-11, 0.0]
    x = torch.tensor(probes + [-p for p in probes], dtype=torch.float32)
    got = as_u8(to_e4m3(x)).tolist()
    assert got == [ref_e4m3(float(v)) for v in x]
    assert to_e4m3(torch.tensor([math.inf, -1e30])).float().tolist() == [448.0, -448.0]  # saturation, not NaN


def test_e2m1_encode_rounds_to_nearest_even_saturates_and_decodes_by_the_spec_table():
    values = [v for v, _ in E2M1_TABLE]
    probes = values + [(a + b) / 2 for a, b in zip(values, values[1:])] + [0.3, 0.7, 2.6, 4.9, 5.1, 6.5, 1e9, math.inf]
    x = torch.tensor(probes + [-p for p in probes], dtype=torch.float32)
    assert e2m1_encode(x).tolist() == [ref_e2m1(float(v)) for v in x]
    assert e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist() == [e2m1_value(c) for c in range(16)]
    assert e2m1_decode(e2m1_encode(torch.tensor([7.0, -math.inf]))).tolist() == [6.0, -6.0]


def test_e8m0_is_an_exact_power_of_two_and_agrees_with_torch_float8_e8m0fnu():
    exps = torch.arange(-127, 128)
    scales = e8m0_encode(exps)
    assert scales.dtype == torch.float8_e8m0fnu
    assert as_u8(scales).tolist() == list(range(255))  # biased by 127
    decoded = e8m0_decode(scales)
    assert decoded.tolist() == [2.0**e for e in range(-127, 128)]
    assert torch.equal(decoded, scales.float())  # torch's own e8m0 -> fp32 cast agrees
    assert math.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8)).item())  # 0xFF is NaN (§5.4.1)


def test_nibbles_pack_element_0_in_the_low_nibble_and_round_trip():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x0F]]
    rand = torch.randint(0, 16, (7, 32), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(rand)), rand)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))


# ------------------------------------------------------------------------------- bit-exact vs reference
def test_fp8_codes_and_scales_match_the_reference():
    w = wide_range()
    qt = quantize(w, "fp8")
    codes, scales = ref_fp8(w.numpy())
    assert qt.data.dtype == torch.float8_e4m3fn and qt.data.shape == w.shape and qt.block == (128, 128)
    assert np.array_equal(as_u8(qt.data), codes)
    assert np.array_equal(qt.scales.numpy(), scales) and qt.scales.shape == (2, 2)


def test_mxfp8_codes_and_e8m0_scales_match_the_reference():
    w = wide_range()
    qt = quantize(w, "mxfp8")
    codes, scale_codes = ref_mxfp8(w.numpy())
    assert qt.data.dtype == torch.float8_e4m3fn and qt.scales.dtype == torch.float8_e8m0fnu
    assert np.array_equal(as_u8(qt.data), codes)
    assert np.array_equal(as_u8(qt.scales), scale_codes)


def test_nvfp4_packed_codes_and_both_scale_levels_match_the_reference():
    w = wide_range()
    qt = quantize(w, "nvfp4")
    packed, scale_codes, s_t = ref_nvfp4(w.numpy())
    assert qt.data.dtype == torch.uint8 and qt.scales.dtype == torch.float8_e4m3fn
    assert np.array_equal(qt.data.numpy(), packed)
    assert np.array_equal(as_u8(qt.scales), scale_codes)
    assert qt.tensor_scale.dtype == torch.float32 and qt.tensor_scale.item() == float(s_t)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int4_packed_codes_and_scales_match_the_reference(scale_dtype):
    w = wide_range()
    qt = quantize(w, "int4", scale_dtype=scale_dtype)
    packed, scales = ref_int4(w.numpy(), bf16=scale_dtype == torch.bfloat16)
    assert qt.scales.dtype == scale_dtype
    assert np.array_equal(qt.data.numpy(), packed)
    assert np.array_equal(qt.scales.float().numpy(), scales)
    qt64 = quantize(w, "int4", group_size=64)
    assert np.array_equal(qt64.data.numpy(), ref_int4(w.numpy(), group=64)[0])


# ------------------------------------------------------------------------------- round-trip error bounds
def per_element(grid: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Expand a per-block grid to one value per weight element (the ragged last block cropped)."""
    return grid.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


SLACK = 1 + 2.0**-20  # the fp32 roundings of x / scale and code * scale


def test_fp8_round_trip_error_is_within_half_an_e4m3_ulp():
    """e4m3 has 3 mantissa bits: in the normal range |v| >= 2^-6 the error is <= 2^-4 |v| (half an ulp);
    below it the subnormal step is 2^-9, so <= 2^-10. In weight units: max(2^-4 |x|, 2^-10 scale)."""
    w = wide_range()
    qt = quantize(w, "fp8")
    s = per_element(qt.scales, qt.block, qt.shape)
    err = (qt.dequantize() - w).abs()
    assert (err <= torch.maximum(2.0**-4 * w.abs(), 2.0**-10 * s) * SLACK).all()


def test_mxfp8_round_trip_error_bound_and_the_specs_saturating_top():
    """As fp8 for |x / X| <= 448. The E8M0 floor puts amax / X in [256, 512), so elements with
    |x / X| > 448 clamp to 448 X: error |x| - 448 X < |x| / 8 (OCP MX §6.3)."""
    w = wide_range()
    qt = quantize(w, "mxfp8")
    x_scale = per_element(e8m0_decode(qt.scales), qt.block, qt.shape)
    v, err = w / x_scale, (qt.dequantize() - w).abs()
    inside = v.abs() <= 448
    assert (err[inside] <= torch.maximum(2.0**-4 * w.abs(), 2.0**-10 * x_scale)[inside] * SLACK).all()
    assert (err[~inside] < w.abs()[~inside] / 8).all() and (~inside).any()
    assert torch.equal(qt.dequantize()[~inside].abs(), 448 * x_scale[~inside])


def test_nvfp4_round_trip_error_is_within_half_an_e2m1_ulp():
    """e2m1 has 1 mantissa bit: error <= 2^-2 |v| for |v| >= 1, <= 0.25 below (step 0.5), with
    D = s_b * s_t: max(|x| / 4, D / 4). When the e4m3 block scale is normal (>= 2^-6) it is within
    2^-4 of amax_b / 6 / s_t, so a clamped top element (|v| <= 6.4) stays within that bound; a block whose
    scale is e4m3-subnormal can lose up to |x| - 6 D to the clamp."""
    w = wide_range()
    qt = quantize(w, "nvfp4")
    d = per_element(qt.scales.float() * qt.tensor_scale, qt.block, qt.shape)
    normal = per_element(qt.scales.float() >= 2.0**-6, qt.block, qt.shape)
    err = (qt.dequantize() - w).abs()
    bound = torch.maximum(w.abs() / 4, d / 4) * SLACK
    assert (err[normal] <= bound[normal]).all()
    assert (err[~normal] <= torch.maximum(bound, w.abs() - 6 * d)[~normal]).all()


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int4_round_trip_error_is_within_half_a_step(scale_dtype):
    """Symmetric int4: |x / s| <= 7 (fp32 scale) or <= 7 (1 + 2^-8) < 7.5 (bf16 scale), so nothing clamps
    and rounding costs at most half a step: |err| <= s / 2."""
    w = wide_range()
    qt = quantize(w, "int4", scale_dtype=scale_dtype)
    s = per_element(qt.scales.float(), qt.block, qt.shape)
    assert ((qt.dequantize() - w).abs() <= s / 2 * SLACK).all()


def test_measured_round_trip_errors_and_byte_ratios(capsys):
    """On N(0, 0.02^2) weights (a typical init), 1024 x 1024: relative RMS error and bytes vs fp32."""
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1)) * 0.02
    rows = {}
    for fmt in FORMATS:
        qt = quantize(w, fmt)
        rows[fmt] = (((qt.dequantize() - w).norm() / w.norm()).item(), qt.nbytes() / (w.numel() * 4))
    with capsys.disabled():
        for fmt, (rel, ratio) in rows.items():
            print(f"\n{fmt:6s} rel-RMS error {rel:.4f}  bytes/fp32 {ratio:.4f}", end="")
    assert rows["fp8"][0] < 0.04 and rows["mxfp8"][0] < 0.04  # 3 mantissa bits: ~2^-3 / sqrt(12) scale
    assert rows["nvfp4"][0] < 0.15 and rows["int4"][0] < 0.15  # 4-bit: several times coarser
    assert max(rows["fp8"][0], rows["mxfp8"][0]) < min(rows["nvfp4"][0], rows["int4"][0])


# ------------------------------------------------------------------------------- scale encodings
def test_fp8_scale_is_tile_amax_over_448_and_the_amax_maps_to_448():
    w = wide_range()
    qt = quantize(w, "fp8")
    tile = w[:128, :128]
    assert qt.scales[0, 0].item() == (tile.abs().amax() / 448).item()
    i, j = divmod(int(tile.abs().argmax()), 128)
    assert abs(qt.data[i, j].float().item()) == 448.0


def test_mxfp8_scales_are_powers_of_two_with_amax_over_scale_in_256_512():
    w = wide_range()
    qt = quantize(w, "mxfp8")
    x_scale = e8m0_decode(qt.scales)
    mantissa, _ = torch.frexp(x_scale)
    assert (mantissa == 0.5).all()  # exact powers of two
    amax = torch.nn.functional.pad(w.abs(), (0, -w.shape[1] % 32)).reshape(w.shape[0], -1, 32).amax(-1)
    ratio = amax[amax > 0] / x_scale[amax > 0]
    assert ((ratio >= 256) & (ratio < 512)).all()
    assert (as_u8(qt.scales)[amax.numpy() == 0] == 0).all()  # zero block: smallest scale 2^-127, not 0/NaN


def test_nvfp4_two_level_scale():
    w = wide_range()
    qt = quantize(w, "nvfp4")
    assert qt.tensor_scale.item() == (w.abs().amax() / (6 * 448)).item()
    block_scales = qt.scales.float()
    assert block_scales.max().item() == 448.0  # the block holding the tensor amax uses e4m3's whole range
    assert (block_scales >= 2.0**-9).all()  # never zero, even for the zero blocks of row 3
    assert block_scales[3, 0].item() == 2.0**-9


# ------------------------------------------------------------------------------- saturation, NaN, zeros
def test_saturation_clamps_to_the_element_max_not_inf():
    mx = torch.zeros(1, 32)
    mx[0, :3] = torch.tensor([480.0, 1.0, -0.5])  # X = 2^(8 - 8) = 1, so 480 / X is past e4m3's 448
    qt = quantize(mx, "mxfp8")
    assert e8m0_decode(qt.scales).item() == 1.0 and qt.dequantize()[0, 0].item() == 448.0
    nv = torch.zeros(1, 32)
    nv[0, 0], nv[0, 16] = 2688.0, 6.36  # s_t = 1; block 2: s_b = e4m3(1.06) = 1.0, so 6.36 clamps to 6
    qt = quantize(nv, "nvfp4")
    assert qt.scales.float().tolist() == [[448.0, 1.0]]
    assert qt.dequantize()[0, 16].item() == 6.0
    huge = torch.tensor([[3.0e38, -3.0e38, 1.0, 0.0] * 32])
    for fmt in FORMATS:
        out = quantize(huge, fmt).dequantize()
        assert torch.isfinite(out).all(), fmt
        assert torch.allclose(out[0, :2], huge[0, :2], rtol=0.07), (fmt, out[0, :2])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(fmt, bad):
    """Documented behaviour: NaN/inf weights raise (a NaN would poison its whole block's scale)."""
    w = torch.randn(4, 64)
    w[2, 5] = bad
    with pytest.raises(ValueError, match=rf"{fmt}: layers\.0\.q_proj .*1 NaN/inf value\(s\), first at index \(2, 5\)"):
        quantize(w, fmt, name="layers.0.q_proj")


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_weights_and_blocks_get_positive_scales_and_decode_to_zero(fmt):
    for w in (torch.zeros(130, 70), torch.cat([torch.zeros(130, 64), torch.randn(130, 64)], dim=1)):
        qt = quantize(w, fmt)
        scales = e8m0_decode(qt.scales) if fmt == "mxfp8" else qt.scales.float()
        assert torch.isfinite(scales).all() and (scales > 0).all()
        if qt.tensor_scale is not None:
            assert qt.tensor_scale.item() > 0
        out = qt.dequantize()
        assert torch.isfinite(out).all()
        assert (out[w == 0] == 0).all()


# ------------------------------------------------------------------------------- sizes, API, errors
def test_nbytes_shrink_against_fp32():
    w = torch.randn(1024, 1024)
    n = w.numel()
    expected = {
        "fp8": n + 4 * 64,  # e4m3 codes + 8x8 fp32 tile scales: ~1/4
        "mxfp8": n + n // 32,  # + one e8m0 byte per 32: 1.03125 / 4
        "nvfp4": n // 2 + n // 16 + 4,  # nibbles + one e4m3 per 16 + the fp32 tensor scale: ~0.5625 / 4
        "int4": n // 2 + 4 * n // 128,  # nibbles + fp32 per 128: 0.53125 / 4
    }
    for fmt, nbytes in expected.items():
        assert quantize(w, fmt).nbytes() == nbytes, fmt
    assert quantize(w, "int4", scale_dtype=torch.bfloat16).nbytes() == n // 2 + 2 * n // 128
    ratio = {fmt: quantize(w, fmt).nbytes() / (4 * n) for fmt in FORMATS}
    assert ratio["fp8"] < 0.2501 and ratio["mxfp8"] < 0.26 and ratio["nvfp4"] < 0.141 and ratio["int4"] < 0.133


@pytest.mark.parametrize("fmt", FORMATS)
def test_dtype_shape_rows_and_device_round_trip(fmt):
    w = wide_range(70, 200).to(torch.bfloat16)
    qt = quantize(w, fmt)
    full = qt.dequantize()
    assert full.dtype == torch.bfloat16 and full.shape == w.shape
    assert qt.dequantize(torch.float32).dtype == torch.float32
    assert torch.equal(qt.dequantize(torch.float32, rows=slice(5, 40)), qt.dequantize(torch.float32)[5:40])
    assert torch.equal(qt.to("cpu").dequantize(), full)
    with pytest.raises(ValueError, match="contiguous"):
        qt.dequantize(rows=slice(0, 10, 2))


def test_bad_inputs_raise_naming_format_tensor_and_shape():
    with pytest.raises(ValueError, match=r"unknown quantisation format 'fp6' for w; expected one of fp8, mxfp8"):
        quantize(torch.zeros(4, 4), "fp6", name="w")
    with pytest.raises(ValueError, match=r"nvfp4: bias \(shape \(64,\).*2-D weight"):
        quantize(torch.zeros(64), "nvfp4", name="bias")
    with pytest.raises(ValueError, match=r"fp8: t \(shape \(2, 3, 4\).*got 3-D"):
        quantize(torch.zeros(2, 3, 4), "fp8", name="t")
    with pytest.raises(ValueError, match=r"mxfp8: tensor \(shape \(0, 32\).*empty"):
        quantize(torch.zeros(0, 32), "mxfp8")
    with pytest.raises(ValueError, match=r"int4: tensor \(shape \(4, 4\), torch.int64\).*floating-point"):
        quantize(torch.zeros(4, 4, dtype=torch.long), "int4")
    with pytest.raises(ValueError, match="group_size must be a positive even number, got 3"):
        quantize(torch.zeros(4, 4), "int4", group_size=3)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantize(torch.zeros(4, 4), "int4", scale_dtype=torch.float16)


def test_exact_ties_round_to_even_through_every_format():
    """Random data almost never lands on a tie, so build blocks whose scale is exactly 1 and whose elements
    sit on midpoints; every format's codes must still equal the reference (ties to the even code)."""
    e4m3_mids = [(a + b) / 2 for (a, _), (b, _) in zip(E4M3_TABLE, E4M3_TABLE[1:])][-31:]
    fp8 = torch.tensor([[448.0] + e4m3_mids + [-m for m in e4m3_mids]])  # tile amax 448: scale 1
    assert np.array_equal(as_u8(quantize(fp8, "fp8").data), ref_fp8(fp8.numpy())[0])
    mx = torch.tensor([[448.0] + e4m3_mids])  # amax 448: X = 2^(8 - 8) = 1
    assert np.array_equal(as_u8(quantize(mx, "mxfp8").data), ref_mxfp8(mx.numpy())[0])
    e2m1_mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    nv = torch.zeros(1, 32)
    nv[0, 0], nv[0, 16], nv[0, 17:24], nv[0, 24:31] = 2688.0, 6.0, torch.tensor(e2m1_mids), -torch.tensor(e2m1_mids)
    qt = quantize(nv, "nvfp4")
    assert qt.scales.float().tolist() == [[448.0, 1.0]] and qt.tensor_scale.item() == 1.0
    assert np.array_equal(qt.data.numpy(), ref_nvfp4(nv.numpy())[0])
    assert e2m1_decode(unpack_nibbles(qt.data))[0, 17:24].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    i4 = torch.tensor([[7.0, 0.5, 1.5, 2.5, -2.5, -3.5, 6.5, -0.5]])  # amax 7: scale 1
    qt = quantize(i4, "int4", group_size=8)
    assert qt.dequantize()[0].tolist() == [7.0, 0.0, 2.0, 2.0, -2.0, -4.0, 6.0, -0.0]
    assert np.array_equal(qt.data.numpy(), ref_int4(i4.numpy(), group=8)[0])
