"""oneDNN-packed weights written in place (`engine/packed.py`): the bytes a fresh pack gives, one pass per sync.

A weight update writes new rows straight into the packed weight the forward multiplies by. These tests
check the bytes against a fresh `_reorder_linear_weight` of the updated matrix (any row range, fp32 and
bf16), that a sync re-packs nothing, allocates no new packed tensor and keeps no plain HF copy of a held
projection, and that the synced engine's greedy tokens and log-probs equal those of an engine loaded
from the same weights — bit for bit, for a full update, a partial one (k_proj alone: the middle rows
of the fused q|k|v) and a tied lm_head (not held: copied, then re-packed in place).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.core import onednn
from furlong.engine import blockcopy
from furlong.engine import packed as packed_mod
from furlong.engine.engine import Engine
from furlong.engine.packed import Packed, memory, rows_of
from furlong.engine.quantized import held_state_dict
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams
from furlong.models import create_model

ONEDNN = onednn.pick_linear(torch.float32)[1] is onednn.pack
pytestmark = pytest.mark.skipif(not ONEDNN, reason="this torch build packs no oneDNN weights")
PROMPTS = [[5, 40, 41, 42, 7], [9, 300, 12, 13, 14, 15, 16]]


def packed_bytes(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return memory(p, dtype).view(torch.uint8).clone()


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "torch-copy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_written_in_place_are_the_bytes_of_a_fresh_pack(dtype, kernel, monkeypatch):
    """Both ways of writing whole row blocks (the compiled transpose, PyTorch's strided copy) give the same bytes."""
    if kernel and blockcopy.kernel() is None:
        pytest.skip("no C compiler on this machine: syncs use PyTorch's copy (the torch-copy case)")
    if onednn.pick_linear(dtype)[1] is not onednn.pack:
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU (the engine multiplies by plain ones: F.linear)")
    calls = []
    real = packed_mod.transpose_blocks
    monkeypatch.setattr(packed_mod, "transpose_blocks", lambda *a: calls.append(a) is None and kernel and real(*a))
    pack = onednn.pack
    torch.manual_seed(0)
    w = torch.randn(384, 256).to(dtype)
    p = pack(w)
    held = Packed.of(p, w, pack)
    assert held is not None and torch.equal(held.read(0, 384), w)
    new = torch.randn(384, 256).to(dtype)
    # a partial block at either end, whole blocks between, then rows inside one block
    for lo, hi in ((0, 37), (37, 300), (300, 384), (5, 9)):
        held.write(lo, new[lo:hi])
    assert torch.equal(packed_bytes(p, dtype), packed_bytes(pack(new), dtype))
    assert torch.equal(held.read(37, 300), new[37:300]) and torch.equal(held.read(5, 9), new[5:9])
    x = torch.randn(7, 256).to(dtype)
    assert torch.equal(onednn.linear(x, p), onednn.linear(x, pack(new)))
    assert held.packed is p  # the tensor the forward multiplies by is the one written
    assert calls  # whole blocks were offered to the kernel (and, in the torch-copy case, declined)


@pytest.mark.parametrize("dtype", [torch.int16, torch.float32, torch.float64])
@pytest.mark.parametrize("rows,cols", [(64, 768), (32, 48), (16, 16), (5, 7), (64, 20)])
def test_block_transpose_kernel_matches_torch(dtype, rows, cols):
    """The C kernel transposes each [rows, cols] block: AVX-512 tiles where both are multiples of 16
    (streaming stores into an aligned destination, plain stores into an unaligned one), scalar tiles else."""
    if blockcopy.kernel() is None:
        pytest.skip("no C compiler on this machine")
    src = torch.randint(-1000, 1000, (3 * rows * cols,)).to(dtype)
    want = src.view(3, rows, cols).transpose(1, 2).reshape(-1)
    for offset in (0, 1):  # offset 1: a destination that is not 64-byte aligned
        dst = torch.zeros(3 * rows * cols + 1, dtype=dtype)[offset : offset + 3 * rows * cols]
        assert blockcopy.transpose_blocks(src, dst, rows, cols)
        assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="whole"):
        blockcopy.transpose_blocks(src[:-1], dst[:-1], rows, cols)
    assert not blockcopy.transpose_blocks(src, torch.empty(src.numel(), dtype=torch.int8), rows, cols)


def test_a_layout_with_padding_is_not_held():
    """oneDNN pads a [100, 64] weight to whole blocks: no plain view covers it, so it keeps the re-pack path."""
    w = torch.randn(100, 64)
    assert Packed.of(onednn.pack(w), w, onednn.pack) is None


def greedy(engine: Engine) -> list[tuple[list[int], list[float]]]:
    engine.flush_cache().result(10)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    reqs = engine.generate([Request(p, params, return_logprob=True) for p in PROMPTS], timeout=60)
    return [(r.output_ids, r.output_logprobs) for r in reqs]


def fresh_engine_on(path, weights: dict[str, torch.Tensor], out) -> list:
    """Greedy outputs of an engine loaded from `path`'s model with `weights` saved over it."""
    hf = AutoModelForCausalLM.from_pretrained(path)
    hf.load_state_dict(weights, strict=False)
    hf.save_pretrained(out)
    for f in path.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy2(f, out / f.name)
    eng = Engine(out, kv_cache_mb=2, block_size=4).start()
    try:
        return greedy(eng)
    finally:
        eng.stop()


@pytest.mark.timeout(300)
def test_sync_is_one_pass_into_the_packed_weights_and_exact(tmp_path, monkeypatch):
    path = create_model("qwen3", "tiny")
    eng = Engine(path, kv_cache_mb=2, block_size=4).start()
    try:
        m = eng.model
        assert m.held and m.held == set(m.sources)  # every projection of the tiny qwen3 is held
        name = "model.layers.0.self_attn.k_proj.weight"
        assert rows_of(eng.hf.state_dict(keep_vars=True)[name]) is not None
        assert all(p.is_meta for key in m.held for p in m.sources[key][1])  # no plain copy kept
        tensors = dict(m.w)
        packs = []
        monkeypatch.setattr(m, "_pack", lambda w: packs.append(w) or onednn.pack(w))
        old = held_state_dict(eng.hf, m)
        g = torch.Generator().manual_seed(1)
        new = {n: t + 0.02 * torch.randn(t.shape, generator=g) for n, t in old.items()}
        eng.call(lambda: eng.apply_weights(new, 1)).result(60)
        assert packs == [] and all(m.w[k] is t for k, t in tensors.items())  # nothing re-packed or allocated
        held = held_state_dict(eng.hf, m)
        assert all(torch.equal(held[n], new[n]) for n in new)
        assert greedy(eng) == fresh_engine_on(path, new, tmp_path / "full")

        partial = {name: new[name] * 1.5}  # rows [64, 96) of the fused q|k|v: inside one 64-row block
        eng.call(lambda: eng.apply_weights(partial, 2)).result(60)
        assert packs == [] and torch.equal(held_state_dict(eng.hf, m)[name], partial[name])
        assert greedy(eng) == fresh_engine_on(path, {**new, **partial}, tmp_path / "partial")
    finally:
        eng.stop()


@pytest.mark.timeout(300)
def test_tied_lm_head_is_copied_then_repacked_in_place(tmp_path):
    from furlong.models.factory import SIZES, hf_config

    base = create_model("llama", "tiny")
    cfg = hf_config("llama", SIZES["tiny"])
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "tied")
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy2(f, tmp_path / "tied" / f.name)
    path = tmp_path / "tied"
    eng = Engine(path, kv_cache_mb=2, block_size=4).start()
    try:
        m = eng.model
        assert "lm_head" in m.packed and "lm_head" not in m.held  # the embedding lookup reads it too
        head = m.w["lm_head"]
        sd = held_state_dict(eng.hf, m)
        new = {n: t * 1.01 for n, t in sd.items()}
        eng.call(lambda: eng.apply_weights(new, 1)).result(60)
        assert m.w["lm_head"] is head  # re-packed into the same memory
        assert torch.equal(m.packed["lm_head"].read(0, head.shape[0]), new["model.embed_tokens.weight"])
        assert greedy(eng) == fresh_engine_on(path, new, tmp_path / "fresh")
    finally:
        eng.stop()
