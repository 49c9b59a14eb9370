"""Decode attention over persistent rows: the kernels the engine picks between (SDPA, batched matmuls, the
C kernel of `rows_kernel`) agree, and the pick is measured only where it can matter (on a CPU)."""

from __future__ import annotations

import pytest
import torch

from furlong.engine import rows_kernel
from furlong.engine.attention import bmm_rows, decode_mask, pick_decode_attention, query_mask, sdpa_rows
from furlong.engine.engine import Engine
from furlong.engine.request import Request
from furlong.engine.rows_kernel import native_rows
from furlong.engine.sampler import SamplingParams
from furlong.models import create_model

needs_kernel = pytest.mark.skipif(rows_kernel.kernel() is None, reason="no C compiler on this machine")


def rows_case(
    R: int = 6, kv: int = 2, g: int = 3, hd: int = 16, L: int = 11, cap: int = 19, seed: int = 0, dtype=torch.float32
):
    """Queries [R, kv, g, hd] over strided row views [R, kv, L, hd] (storage of capacity `cap`), ragged lengths."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(R, kv, cap, hd, generator=gen).to(dtype)[:, :, :L] for _ in range(2))
    q = torch.randn(R, kv, g, hd, generator=gen).to(dtype)
    lens = torch.tensor([1 + (5 * i) % L for i in range(R)])
    return q, k, v, lens


def test_bmm_rows_equals_sdpa_rows_and_a_direct_computation():
    q, k, v, lens = rows_case()
    mask = decode_mask(lens, k.shape[2], torch.float32)
    a, b = sdpa_rows(q, k, v, mask, 0.25), bmm_rows(q, k, v, mask, 0.25)
    assert a.shape == b.shape == q.shape
    assert (a - b).abs().max() <= 1e-5
    for r, n in enumerate(lens.tolist()):  # each row sees exactly its first n keys
        w = torch.softmax(q[r] @ k[r, :, :n].transpose(-1, -2) * 0.25, -1)
        assert torch.allclose(b[r], w @ v[r, :, :n], atol=1e-5)
    assert k.stride(2) == 16 and not k.is_contiguous()  # the rows went in as views, not copies


def test_the_pick_is_measured_only_on_a_cpu_and_cached(monkeypatch):
    assert pick_decode_attention(torch.float32, torch.device("cuda"), 2, 3, 16) is sdpa_rows  # no tensor is made
    assert pick_decode_attention(torch.float16, torch.device("cpu"), 2, 3, 16) is sdpa_rows  # no other kernel has it
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    first = pick_decode_attention(torch.float32, torch.device("cpu"), 2, 3, 16, rows=4, cols=10)
    assert torch.equal(torch.rand(3), expected)  # the probe drew from its own generator, not the process's
    assert first in (sdpa_rows, bmm_rows, native_rows)
    assert pick_decode_attention(torch.float32, torch.device("cpu"), 2, 3, 16, rows=4, cols=10) is first
    bf16 = pick_decode_attention(torch.bfloat16, torch.device("cpu"), 2, 3, 16, rows=4, cols=10)
    assert bf16 in ((sdpa_rows, native_rows) if rows_kernel.kernel() is not None else (sdpa_rows,))
    monkeypatch.setattr(rows_kernel, "available", lambda dtype: False)  # no compiler: SDPA without a probe
    assert pick_decode_attention(torch.bfloat16, torch.device("cpu"), 2, 3, 16, rows=5, cols=10) is sdpa_rows


def test_the_pick_times_rows_read_from_memory_not_one_cached_set(monkeypatch):
    """Each probe round attends `COLD_ROWS_BYTES` of distinct rows, one set after another, as a decode step reads
    every layer's rows once: a probe on one set that stayed in the cache called SDPA and the C kernel even on
    the AMX Xeon, where inside the step the kernel was ~3x faster, so the pick fell either way."""
    from furlong.engine import attention

    rows, n_kv, cap, hd = 4, 2, 10 + 32, 16
    set_bytes = 2 * rows * n_kv * cap * hd * 4  # keys and values of one set, fp32
    monkeypatch.setattr(attention, "COLD_ROWS_BYTES", 5 * set_bytes)
    reads: list[tuple[int, int]] = []

    def probe(qd, kd, vd, mask, scale):
        reads.append((kd.data_ptr(), vd.data_ptr()))
        return sdpa_rows(qd, kd, vd, mask, scale)

    monkeypatch.setattr(attention, "sdpa_rows", probe)
    assert attention.pick_decode_attention.__wrapped__(torch.float32, torch.device("cpu"), n_kv, 3, hd, rows, 10) in (
        probe,
        bmm_rows,
        native_rows,
    )
    assert len(reads) == 4 * 5  # four rounds of five sets
    assert len(set(reads[:5])) == 5 and reads[5:10] == reads[:5]  # distinct memory within a round, the same each round
    assert len({p for kv in reads[:5] for p in kv}) == 10  # keys and values of every set are their own


def reference(q, k, v, mask, scale):
    """The attention in float64: what every kernel approximates."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=scale
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd,g", [(16, 3), (64, 2), (64, 1), (128, 4), (40, 2)])
def test_native_rows_matches_sdpa(dtype, hd, g):
    """The C kernel on strided rows and ragged lengths, across its variants (head dims of 64 and 128 have their
    own unrolled code, others the generic loop; an odd number of queries a head): as close to the float64
    attention as SDPA is, to one rounding of the output. L = 150 spans three blocks of 64 columns, and the
    shortest rows leave whole blocks masked (-inf), which must add nothing (an early version gave NaN there)."""
    q, k, v, lens = rows_case(R=7, kv=2, g=g, hd=hd, L=150, cap=170, dtype=dtype)
    lens[0], lens[1] = 150, 3
    mask = decode_mask(lens, 150, dtype)
    got, sdpa = native_rows(q, k, v, mask, hd**-0.5), sdpa_rows(q, k, v, mask, hd**-0.5)
    want = reference(q, k, v, mask, hd**-0.5)
    assert got.shape == q.shape and got.dtype == dtype and not k.is_contiguous()
    err, err_sdpa = (got.double() - want).abs().max(), (sdpa.double() - want).abs().max()
    assert err <= (1e-5 if dtype == torch.float32 else err_sdpa + 2**-8 * want.abs().max())
    # prompt chunks (a mixed step): several queries a row, each with its own length (`query_mask`)
    ch = torch.tensor([[1 + (7 * r + 3 * i) % 150 for i in range(3)] for r in range(7)])
    cmask = query_mask(ch.repeat_interleave(g, dim=1), 150, dtype)
    qc = torch.randn(7, 2, 3 * g, hd, generator=torch.Generator().manual_seed(1)).to(dtype)
    got, want = native_rows(qc, k, v, cmask, 0.3), reference(qc, k, v, cmask, 0.3)
    tol = 1e-5 if dtype == torch.float32 else (sdpa_rows(qc, k, v, cmask, 0.3).double() - want).abs().max() + 0.02
    assert (got.double() - want).abs().max() <= tol


@needs_kernel
def test_native_rows_inside_a_compiled_function_and_its_fallbacks():
    """In a compiled step the kernel is the opaque op (fullgraph: no break); inputs it cannot read (a last
    dimension that is not contiguous) and dtypes it lacks go to SDPA and give SDPA's result."""
    q, k, v, lens = rows_case(hd=64, g=2)
    mask = decode_mask(lens, k.shape[2], torch.float32)
    step = torch.compile(lambda q, k, v, m: native_rows(q * 1.0, k, v, m, 0.125) + 1.0, fullgraph=True)
    assert torch.equal(step(q, k, v, mask), native_rows(q, k, v, mask, 0.125) + 1.0)
    kt = k.transpose(2, 3).contiguous().transpose(2, 3)  # same values, hd no longer the contiguous dimension
    assert torch.equal(native_rows(q, kt, v, mask, 0.125), sdpa_rows(q, kt, v, mask, 0.125))
    h = [t.half() for t in (q, k, v, mask)]
    assert torch.equal(native_rows(*h, 0.125), sdpa_rows(*h, 0.125))


def test_native_kernels_can_be_switched_off(monkeypatch, tmp_path):
    """`FURLONG_NATIVE_KERNELS=0`: no kernel is built or loaded, and the attention goes to SDPA."""
    monkeypatch.setenv("FURLONG_NATIVE_KERNELS", "0")
    monkeypatch.setenv("FURLONG_CACHE_DIR", str(tmp_path))
    rows_kernel.kernel.cache_clear()
    try:
        assert rows_kernel.kernel() is None and not rows_kernel.available(torch.float32)
        q, k, v, lens = rows_case()
        mask = decode_mask(lens, k.shape[2], torch.float32)
        assert torch.equal(native_rows(q, k, v, mask, 0.25), sdpa_rows(q, k, v, mask, 0.25))
        assert not any(tmp_path.rglob("*.so"))
    finally:
        rows_kernel.kernel.cache_clear()


@pytest.mark.timeout(180)
def test_engines_on_any_kernel_generate_the_same_tokens_and_logprobs():
    path = create_model("qwen3", "tiny")
    params = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    kernels = (sdpa_rows, bmm_rows) + ((native_rows,) if rows_kernel.kernel() is not None else ())
    out, calls = {}, dict.fromkeys(kernels, 0)

    def counted(kernel):
        def run(*args):
            calls[kernel] += 1
            return kernel(*args)

        return run

    for kernel in kernels:
        eng = Engine(path, kv_cache_mb=2, max_running=8, block_size=4, device="cpu")
        eng.model.attend_rows = counted(kernel)
        reqs = [
            Request([(3 * i + j) % 300 + 5 for j in range(2 + 3 * i)], params(4 + 2 * i), return_logprob=True)
            for i in range(5)
        ]
        for r in reqs:
            eng._add(r)
        with torch.no_grad():
            while eng.running or eng.waiting:
                eng._step()
        out[kernel] = reqs
    assert len(set(calls.values())) == 1 and calls[sdpa_rows] > 0  # every decode step went through the kernel given
    for kernel in kernels[1:]:
        for a, b in zip(out[sdpa_rows], out[kernel]):
            assert a.output_ids == b.output_ids and len(a.output_ids) == a.params.max_new_tokens
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-5
