"""QuantLinear computes with the quantised weight, and a quantised tiny Qwen3 stays close to fp32.

On CPU every format runs as "dequantise per block, then a dense matmul", so the layer must equal
F.linear with the dequantised weight. The fp8 `torch._scaled_mm` path is CUDA-only and is not exercised here.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from furlong.weights.quant import FORMATS, QuantLinear, quantize, quantize_model_linears


def _linear(out_f: int = 96, in_f: int = 80, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_equals_the_dequantised_weight_and_chunking_changes_nothing(fmt):
    lin = _linear()
    layer = QuantLinear.from_linear(lin, fmt)
    x = torch.randn(3, 5, 80)
    expected = F.linear(x, layer.qweight.dequantize(torch.float32), lin.bias)
    assert torch.equal(layer(x), expected)
    chunked = QuantLinear(layer.qweight, lin.bias, chunk_rows=32)  # 96 rows in 3 chunks
    assert torch.allclose(chunked(x), expected, atol=1e-6, rtol=0)
    no_bias = QuantLinear.from_linear(_linear(bias=False), fmt, chunk_rows=40)
    assert no_bias(x).shape == (3, 5, 96)


def test_load_replaces_the_weight_in_place_and_nothing_is_cached():
    layer = QuantLinear.from_linear(_linear(seed=0), "fp8")
    x = torch.randn(4, 80)
    before, ptr = layer(x), layer.q_data.data_ptr()
    other = _linear(seed=1)
    layer.load_(quantize(other.weight, "fp8"), bias=other.bias)
    assert layer.q_data.data_ptr() == ptr  # same storage: a weight sync writes into the live buffers
    after = layer(x)
    assert not torch.allclose(before, after)
    assert torch.equal(after, QuantLinear.from_linear(other, "fp8")(x))
    with pytest.raises(ValueError, match=r"load_: got fp8 \(96, 64\)"):
        layer.load_(quantize(torch.randn(96, 64), "fp8"))
    with pytest.raises(ValueError, match="load_: got int4"):
        layer.load_(quantize(other.weight, "int4"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_module_to_dtype_leaves_codes_alone_and_state_dict_round_trips(fmt):
    layer = QuantLinear.from_linear(_linear(), fmt)
    x = torch.randn(2, 80)
    ref = layer(x)
    raw = {k: v.clone() for k, v in layer.state_dict().items() if k.startswith("q_")}
    assert all(not v.is_floating_point() for v in raw.values())  # integer views: Module.to(dtype) skips them
    moved = copy.deepcopy(layer).to(torch.float64)
    assert all(torch.equal(getattr(moved, k), v) for k, v in raw.items())
    assert torch.allclose(moved(x.double()), ref.double(), atol=1e-5)
    fresh = QuantLinear.from_linear(_linear(seed=3), fmt)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x), ref)


def test_quantize_model_linears_skips_whole_name_components():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(32, 32))
    model.add_module("lm_head", nn.Linear(32, 8))
    model.add_module("lm_head_norm", nn.Linear(32, 32))
    names = quantize_model_linears(model, "mxfp8")
    assert names == ["proj", "lm_head_norm"]
    assert isinstance(model.proj, QuantLinear) and isinstance(model.lm_head, nn.Linear)


@pytest.fixture(scope="module")
def qwen3_tiny():
    from transformers import AutoModelForCausalLM

    from furlong.models import create_model

    path = create_model("qwen3", "tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model


def test_quantised_tiny_qwen3_log_probs_stay_close_to_fp32(qwen3_tiny, capsys):
    """Every linear but lm_head quantised; mean |delta log-prob| of the next tokens of random sequences.

    Bounds are loose (a tiny random-init model); the reliable ordering is 8-bit < 4-bit. Between fp8 and
    mxfp8 (both 3 mantissa bits) and between nvfp4 and int4 the order depends on the weights, so it is
    printed, not asserted.
    """
    torch.manual_seed(0)
    ids = torch.randint(1, qwen3_tiny.config.vocab_size, (4, 48))
    with torch.no_grad():
        ref = torch.log_softmax(qwen3_tiny(ids).logits[:, :-1], dim=-1)
    ref_tok = ref.gather(-1, ids[:, 1:, None])
    gaps, n_linears = {}, 2 * 7  # q, k, v, o, gate, up, down per layer, 2 layers
    for fmt in FORMATS:
        model = copy.deepcopy(qwen3_tiny)
        names = quantize_model_linears(model, fmt)
        assert len(names) == n_linears and "lm_head" not in names
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[:, :-1], dim=-1)
        gaps[fmt] = (
            (lp.gather(-1, ids[:, 1:, None]) - ref_tok).abs().mean().item(),
            (lp.exp() * (lp - ref)).sum(-1).mean().item(),
        )
    with capsys.disabled():
        for fmt, (gap, kl) in gaps.items():
            print(f"\n{fmt:6s} mean|dlogp| {gap:.2e}  KL(q||fp32) {kl:.2e}", end="")
    assert gaps["fp8"][0] < 0.01 and gaps["mxfp8"][0] < 0.01, gaps  # measured ~4e-3
    assert gaps["nvfp4"][0] < 0.05 and gaps["int4"][0] < 0.05, gaps  # measured ~1.5e-2
    assert max(gaps["fp8"][0], gaps["mxfp8"][0]) < min(gaps["nvfp4"][0], gaps["int4"][0]), gaps


def test_the_fp8_scaled_mm_scheme_computes_the_block_scaled_product_on_cpu():
    """The CUDA fp8 path's arithmetic, run through torch's CPU _scaled_mm (which takes row-wise scales):
    it must equal "quantise x per 1x128 tile to e4m3, multiply by the dequantised weight", up to the bf16
    rounding of each tile's partial product. Whether it runs on a GPU is not tested anywhere here."""
    from furlong.weights.quant.codecs import to_e4m3
    from furlong.weights.quant.linear import _fp8_scaled_mm_linear

    torch.manual_seed(0)
    qt = quantize(torch.randn(256, 384) * 0.02, "fp8")
    x = torch.randn(2, 5, 384)
    y = _fp8_scaled_mm_linear(x, qt, None)
    w = qt.dequantize()
    ref = torch.zeros(2, 5, 256)
    for j in range(3):
        xs = x[..., j * 128 : (j + 1) * 128]
        sa = (xs.abs().amax(-1, keepdim=True) / 448).clamp(min=2.0**-126)
        ref += (to_e4m3(xs / sa).float() * sa) @ w[:, j * 128 : (j + 1) * 128].T
    assert y.shape == ref.shape and ((y - ref).norm() / ref.norm()).item() < 4e-3
    assert _fp8_scaled_mm_linear(x[..., :200], quantize(torch.randn(256, 200), "fp8"), None) is None  # in % 128
