"""`engine.cuda_graphs` on a CUDA GPU: graph replay ≡ eager, weights updated under a captured graph, no host sync.

Skipped (with the reason) without CUDA: these have NOT run in this repository yet (no session so far had
a GPU). `scripts/gpu-check.sh` runs them. The CPU half — the static padded step a graph records, run
eagerly, ≡ the dynamic forward in fp32 — is tests/unit/test_engine_graphs.py; the host-sync guard on
CPU is tests/unit/test_engine_host_sync.py.

Stated tolerances. Graph replay against the same static step run eagerly (same kernels, same shapes):
1e-4 nats in fp32. Graph replay against the dynamic eager forward (other shapes, so other kernel
choices and reduction orders): fp32 1e-3 nats; bf16 0.1 nats (bf16 keeps 8 mantissa bits; equally
valid kernel orders move a log-prob by ~1e-2), and a greedy divergence counts only when the eager
engine's own margin at that step exceeds the tolerance (random tiny models have many near-ties).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]
from tests.unit.test_engine_graphs import lockstep  # noqa: E402 - the same lockstep run as the CPU test

TOL = {"float32": 1e-3, "bfloat16": 0.1}


def _gap(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_moe_dir"])
def test_graph_replay_equals_eager(model, dtype, request):
    from furlong.engine.engine import Engine
    from furlong.engine.graphs import DecodeGraphs

    path = request.getfixturevalue(model)
    kw = dict(kv_cache_mb=8, max_running=8, block_size=4, device="cuda", dtype=dtype)
    graphed = Engine(path, cuda_graphs=True, **kw)
    eager, static = Engine(path, **kw), Engine(path, **kw)
    static.graphs = DecodeGraphs(static.model, static.pool.alloc() * static.pool.block_size, 8, capture=False)
    update = {n: p.detach() * 1.01 for n, p in eager.hf.named_parameters() if "layers.0." in n}
    runner = graphed.graphs
    reqs = lockstep({"graphed": graphed, "eager": eager, "static": static}, update)
    assert {1, 2, 4, 8} <= {B for B, n in runner.replays.items() if n}, runner.replays
    assert runner.graphs, "no graph was captured"
    # The update copied into the captured weights' storage: no re-pack, so no recapture was needed.
    assert runner.key[1] == runner._weights_key()
    tol = TOL[dtype]
    for g, s in zip(reqs["graphed"], reqs["static"]):  # same kernels, same shapes
        assert g.output_ids == s.output_ids and _gap(g, s) <= (1e-4 if dtype == "float32" else tol)
    for g, e in zip(reqs["graphed"], reqs["eager"]):
        diff = next((i for i, (a, b) in enumerate(zip(g.output_ids, e.output_ids)) if a != b), None)
        if diff is not None:  # a tie: the eager engine's own top-2 margin at that step is within the tolerance
            (top, _), (second, _) = e.output_top_logprobs[diff][:2]
            assert top - second <= tol, (diff, top, second)
        n = len(g.output_ids) if diff is None else diff
        assert max([abs(x - y) for x, y in zip(g.output_logprobs[:n], e.output_logprobs[:n])] or [0]) <= tol


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_moe_dir"])
def test_native_forward_never_synchronises_on_cuda(model, request, monkeypatch):
    """torch's own sync detector (`set_sync_debug_mode("error")`) around every forward and graph replay."""
    from furlong.engine import graphs
    from furlong.engine.engine import Engine
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams

    eng = Engine(request.getfixturevalue(model), kv_cache_mb=8, max_running=8, block_size=4, device="cuda")
    forward, static, seen = eng.model.forward, graphs.static_decode_step, []

    def strict(fn):
        def run(*a):
            seen.append(fn.__name__)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*a)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    monkeypatch.setattr(eng.model, "forward", strict(forward))
    monkeypatch.setattr(graphs, "static_decode_step", strict(static))
    greedy = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    first = [Request([5, 6, 7, 8, 9], greedy(6)), Request([9, 10, 11], greedy(9), return_logprob=True)]
    for r in first:
        eng._add(r)
    eng._step()
    eng._step()
    eng._add(Request([300, 2, 40, 41, 42], greedy(4)))  # joins while the others decode: a mixed batch
    while eng.running or eng.waiting:
        eng._step()
    eng.graphs = graphs.DecodeGraphs(eng.model, eng.pool.alloc() * eng.pool.block_size, 8, capture=False)
    for r in [Request([5, 6], greedy(4)), Request([7, 8, 9, 10], greedy(5))]:
        eng._add(r)
    while eng.running or eng.waiting:
        eng._step()
    assert "forward" in seen and "static_decode_step" in seen
