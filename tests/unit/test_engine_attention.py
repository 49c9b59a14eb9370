"""Decode attention over persistent rows: the two kernels the engine picks between agree, and the pick is
measured only where it can matter (fp32 on a CPU)."""

from __future__ import annotations

import pytest
import torch

from furlong.engine.attention import bmm_rows, decode_mask, pick_decode_attention, sdpa_rows
from furlong.engine.engine import Engine
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams
from furlong.models import create_model


def rows_case(R: int = 6, kv: int = 2, g: int = 3, hd: int = 16, L: int = 11, cap: int = 19, seed: int = 0):
    """Queries [R, kv, g, hd] over strided row views [R, kv, L, hd] (storage of capacity `cap`), ragged lengths."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(R, kv, cap, hd, generator=gen)[:, :, :L] for _ in range(2))
    q = torch.randn(R, kv, g, hd, generator=gen)
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


def test_the_pick_is_measured_only_for_fp32_on_a_cpu_and_cached():
    assert pick_decode_attention(torch.bfloat16, torch.device("cpu"), 2, 3, 16) is sdpa_rows
    assert pick_decode_attention(torch.float32, torch.device("cuda"), 2, 3, 16) is sdpa_rows  # no tensor is made
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    first = pick_decode_attention(torch.float32, torch.device("cpu"), 2, 3, 16, rows=4, cols=10)
    assert torch.equal(torch.rand(3), expected)  # the probe drew from its own generator, not the process's
    assert first in (sdpa_rows, bmm_rows)
    assert pick_decode_attention(torch.float32, torch.device("cpu"), 2, 3, 16, rows=4, cols=10) is first


@pytest.mark.timeout(180)
def test_engines_on_either_kernel_generate_the_same_tokens_and_logprobs():
    path = create_model("qwen3", "tiny")
    params = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    out, calls = {}, {sdpa_rows: 0, bmm_rows: 0}

    def counted(kernel):
        def run(*args):
            calls[kernel] += 1
            return kernel(*args)

        return run

    for kernel in (sdpa_rows, bmm_rows):
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
    assert calls[sdpa_rows] == calls[bmm_rows] > 0  # every decode step went through the kernel given
    for a, b in zip(out[sdpa_rows], out[bmm_rows]):
        assert a.output_ids == b.output_ids and len(a.output_ids) == a.params.max_new_tokens
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-5
