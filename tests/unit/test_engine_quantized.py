"""`engine.quantization`: the engine holds codes + scales and computes exactly what the dequantised weights give.

Reference for every format: the HF model with each quantised projection's weight replaced by
`quantize(w, fmt).dequantize()` (lm_head, embeddings, norms and MoE experts untouched), decoded greedily
by full HF forwards and scored by one teacher-forced forward. The engine must give the same greedy tokens and log-probs within
2e-4 (fp32 on both sides; the rest is kernel order). Each test also shows the comparison can fail: the
quantised engine differs from the unquantised model by far more than that tolerance.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.engine.engine import Engine
from furlong.engine.quantized import held_state_dict
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams
from furlong.engine.weight_update import WeightUpdateError
from furlong.models import create_model
from furlong.weights.quant import FORMATS, quantize
from furlong.weights.quant.payload import quantizable, quantize_for_sync
from furlong.weights.tensors import checksum

PROMPT = [5, 40, 41, 42, 7, 9, 300, 12, 13]
NEW = 8
TOL = 2e-4


def dequantised_reference(path, fmt: str | None, state: dict | None = None):
    """The HF model (fp32) with `state` loaded and every quantizable weight replaced by its dequantisation."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        if state is not None:
            hf.load_state_dict(state, strict=False)
        for name, p in hf.named_parameters():
            if fmt is not None and quantizable(name, p.shape):
                p.copy_(quantize(p, fmt, name=name).dequantize())
    return hf


@torch.no_grad()
def greedy(hf) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs by full forwards (no `generate`: its min_new_tokens masks EOS,
    which the engine's ignore_eos does not)."""
    seq = list(PROMPT)
    for _ in range(NEW):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
    ids = seq[len(PROMPT) :]
    return ids, [lp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(ids)]


def engine_greedy(eng: Engine) -> tuple[list[int], list[float]]:
    eng.flush_cache().result(10)
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    r = eng.generate([Request(PROMPT, params, return_logprob=True)], timeout=60)[0]
    return r.output_ids, r.output_logprobs


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "arch, fmt",
    [("qwen3", f) for f in FORMATS] + [("qwen3_moe", "nvfp4"), ("qwen2", "int4")],
    ids=[f"qwen3-{f}" for f in FORMATS] + ["qwen3_moe-nvfp4", "qwen2-bias-int4"],
)
def test_quantised_engine_equals_the_dequantised_reference(arch, fmt):
    path = create_model(arch, "tiny")
    eng = Engine(path, kv_cache_mb=2, block_size=4, quantization=fmt).start()
    try:
        ids, lps = engine_greedy(eng)
        quant = eng.model.quant
        held = {n for n in held_state_dict(eng.hf, eng.model)}
        names = list(quant.layers)
    finally:
        eng.stop()
    want_ids, want_lps = greedy(dequantised_reference(path, fmt))
    assert ids == want_ids
    assert gap(lps, want_lps) < TOL
    # It can fail: the dense model is measurably elsewhere (same prefix of tokens compared where they agree).
    dense_ids, dense_lps = greedy(dequantised_reference(path, None))
    n = next((i for i, (a, b) in enumerate(zip(dense_ids, ids)) if a != b), NEW) or 1
    assert dense_ids != ids or gap(lps[:n], dense_lps[:n]) > 10 * TOL
    # What it holds: codes + scales for every attention/MLP projection, nothing dense for them.
    per_layer = 7 if arch != "qwen3_moe" else 4  # q k v o (+ gate up down); MoE experts stay dense
    assert len(names) == per_layer * 2 and not any("lm_head" in n or "experts" in n for n in names)
    assert all(f"{n}@{fmt}.data" in held and n not in held for n in names)
    assert all(eng.hf.get_parameter(n).is_meta for n in names)


@pytest.fixture(scope="module")
def tiny():
    return create_model("qwen3", "tiny")


def trained(path, seed: int = 1) -> dict[str, torch.Tensor]:
    """A 'trainer step': every weight moved by noise, as a sync would bring."""
    g = torch.Generator().manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in hf.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_updates_by_codes_or_dense_weights_hold_the_same_codes(tiny, fmt):
    """Codes + scales from the sender, or the dense weight quantised by the engine: the same held bytes, and
    the output of the reference built from the new weights."""
    new = trained(tiny)
    a = Engine(tiny, kv_cache_mb=2, block_size=4, quantization=fmt).start()
    b = Engine(tiny, kv_cache_mb=2, block_size=4, quantization=fmt).start()
    try:
        a.call(lambda: a.apply_weights(dict(quantize_for_sync(list(new.items()), fmt)), 1)).result(30)
        b.call(lambda: b.apply_weights(new, 1)).result(30)
        ha, hb = held_state_dict(a.hf, a.model), held_state_dict(b.hf, b.model)
        assert ha.keys() == hb.keys()
        assert all(checksum(ha[k]) == checksum(hb[k]) for k in ha)  # bit for bit
        ids, lps = engine_greedy(a)
    finally:
        a.stop()
        b.stop()
    want_ids, want_lps = greedy(dequantised_reference(tiny, fmt, new))
    assert ids == want_ids and gap(lps, want_lps) < TOL


@pytest.mark.timeout(120)
def test_bad_quantised_updates_are_refused_whole(tiny):
    eng = Engine(tiny, kv_cache_mb=2, block_size=4, quantization="fp8").start()
    plain = Engine(tiny, kv_cache_mb=2, block_size=4).start()
    try:
        before = {k: v.clone() for k, v in held_state_dict(eng.hf, eng.model).items()}
        new = trained(tiny)
        name = "model.layers.0.self_attn.q_proj.weight"
        cases = [
            (dict(quantize_for_sync([(name, new[name])], "mxfp8")), "carries mxfp8 codes, this engine holds fp8"),
            ({f"{name}@fp8.scales": torch.ones(3, 3)}, r"torch.float32 \[3, 3\] != held"),
            (
                {
                    "model.norm.weight": new["model.norm.weight"],
                    name: new[name].index_fill(0, torch.tensor([0]), torch.nan),
                },
                "NaN/inf",
            ),
        ]
        for named, match in cases:
            with pytest.raises(WeightUpdateError, match=match):
                eng.call(lambda named=named: eng.apply_weights(named, 1)).result(30)
        after = held_state_dict(eng.hf, eng.model)
        assert all(checksum(before[k]) == checksum(after[k]) for k in before)
        with pytest.raises(WeightUpdateError, match=r"engine.quantization=none"):
            plain.call(lambda: plain.apply_weights(dict(quantize_for_sync([(name, new[name])], "fp8")), 1)).result(30)
    finally:
        eng.stop()
        plain.stop()


def test_the_hf_fallback_refuses_quantisation(tiny):
    with pytest.raises(ValueError, match="engine.quantization=fp8: needs the native forward"):
        Engine(tiny, kv_cache_mb=2, backend="hf", quantization="fp8")


@pytest.mark.parametrize("fmt", FORMATS)
def test_config_takes_every_built_format_and_refuses_sglang(fmt):
    """`engine.quantization` was refused as not built until the engine held codes + scales (this module)."""
    from furlong.config import ConfigError, load_config

    assert load_config(None, [f"engine.quantization={fmt}"]).engine.quantization == fmt
    with pytest.raises(ConfigError, match="not yet for SGLang") as e:
        load_config(None, [f"engine.quantization={fmt}", "engine.backend=sglang"])
    assert {"engine.backend", "engine.quantization"} <= set(e.value.fields)
