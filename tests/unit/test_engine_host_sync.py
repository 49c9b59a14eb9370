"""The native forward never waits for the device: no host read of a device value, no shape made of device data.

On a GPU each of these stalls the host until the device catches up, and makes a step impossible
to capture as a CUDA graph: `.item()`, `.tolist()`, `int()/float()/bool()` of a tensor (they reach
`aten._local_scalar_dense`), `torch.equal`, ops whose output shape depends on values (`nonzero`,
boolean-mask indexing, `unique`, `masked_select`, `repeat_interleave` by a tensor), and a tensor made
from host data inside the forward (`aten.lift_fresh`: a blocking host-to-device copy). The guard
records each of them — a TorchDispatchMode for what reaches the dispatcher, patched Tensor methods
for what does not (`tolist`) — for the duration of a forward only, on the thread running it.

The forwards are real engine steps on CPU (the same code the GPU runs) of a tiny dense and a tiny
MoE model: decode, prefill, mixed decode + prefill, a cached-prefix prefill, prompt log-probs, forked
samples, routed-expert recording, and the static decode step CUDA graphs capture (`engine.graphs`).
"""

from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from furlong.engine import graphs as graphs_mod
from furlong.engine import moe
from furlong.engine.engine import Engine
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams

SYNC_OPS = {"_local_scalar_dense", "equal", "nonzero", "masked_select", "lift_fresh", "item"}
SYNC_PREFIXES = ("unique", "_unique")


class _SyncMode(TorchDispatchMode):
    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        bad = name in SYNC_OPS or name.startswith(SYNC_PREFIXES)
        if name in ("index", "index_put", "index_put_") and any(  # a boolean mask index is a nonzero
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        ):
            bad = True
        if func is torch.ops.aten.repeat_interleave.Tensor:  # repeats as a tensor: the output size is data
            bad = kwargs.get("output_size") is None
        if bad:
            self.found.append(f"aten.{name} at {_where()}")
        return func(*args, **kwargs)


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/furlong/" in f.filename]
    return f"{frames[-1].filename.split('/furlong/')[-1]}:{frames[-1].lineno}" if frames else "?"


_local = threading.local()
_PATCHED = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def no_host_sync(found: list[str]):
    """Record every host synchronisation inside the block (this thread only) into `found`."""
    originals = {n: getattr(torch.Tensor, n) for n in _PATCHED}

    def patched(name):
        orig = originals[name]

        def method(self, *a, **k):
            if getattr(_local, "on", False):
                found.append(f"Tensor.{name} at {_where()}")
            return orig(self, *a, **k)

        return method

    for n in _PATCHED:
        setattr(torch.Tensor, n, patched(n))
    _local.on = True
    try:
        with _SyncMode(found):
            yield
    finally:
        _local.on = False
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)


def test_the_guard_sees_every_kind_of_host_sync():
    """The detector itself can fail: each sync it must catch, caught; the old MoE expert loop too."""
    t = torch.arange(6)
    cases = {
        "tolist": lambda: t.tolist(),
        "item": lambda: t[0].item(),
        "int": lambda: int(t[1]),
        "float": lambda: float(t[1]),
        "bool": lambda: bool(t[1]),
        "equal": lambda: torch.equal(t, t),
        "mask index": lambda: t[t > 2],
        "nonzero": lambda: torch.where(t > 2),
        "unique": lambda: torch.unique(t),
        "from host data": lambda: torch.tensor([1, 2]),
        "repeat by tensor": lambda: t.repeat_interleave(t),
    }
    for name, fn in cases.items():
        found: list[str] = []
        with no_host_sync(found):
            fn()
        assert found, f"{name}: not detected"
    x, top_w = torch.randn(5, 8), torch.rand(5, 2)
    top_i, gu, dn = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 3], [1, 3]]), torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    found = []
    with no_host_sync(found):
        want = moe._reference(x, top_w, top_i, gu, dn)  # the per-expert loop the forward used to run
    assert any("unique" in f for f in found) and any("tolist" in f for f in found)
    for fn in (moe._grouped, moe._dense):
        found = []
        with no_host_sync(found):
            got = fn(x, top_w, top_i, gu, dn)
        assert found == [] and torch.allclose(got, want, atol=1e-5)


def _guard_forwards(eng: Engine, monkeypatch) -> tuple[list[str], set[str]]:
    found: list[str] = []
    kinds: set[str] = set()
    forward = eng.model.forward

    def guarded(b):
        kinds.add(
            ("decode" if b.n_decode else "")
            + ("+prefill" if b.prefills else "")
            + ("+cached" if any(p.cached for p in b.prefills) else "")
            + ("+routes" if b.want_routes else "")
        )
        with no_host_sync(found):
            return forward(b)

    monkeypatch.setattr(eng.model, "forward", guarded)
    step = graphs_mod.static_decode_step

    def guarded_static(m, dec, meta):
        kinds.add("static")
        with no_host_sync(found):
            return step(m, dec, meta)

    monkeypatch.setattr(graphs_mod, "static_decode_step", guarded_static)
    return found, kinds


def _drive(eng: Engine, waves: list[list[Request]], steps_between: int = 2) -> None:
    """Steps the scheduler by hand: each wave joins while the previous ones decode (mixed batches)."""
    for wave in waves:
        for r in wave:
            eng._add(r)
        for _ in range(steps_between):
            eng._step()
    while eng.running or eng.waiting:
        eng._step()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_native_forward_has_no_host_sync(arch, monkeypatch):
    from furlong.models import create_model

    eng = Engine(create_model(arch, "tiny"), kv_cache_mb=2, max_running=8, block_size=4, device="cpu")
    found, kinds = _guard_forwards(eng, monkeypatch)
    greedy = lambda n, **kw: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)
    first = Request([5, 6, 7, 8, 9, 10, 11], greedy(6))
    waves = [
        [first, Request([9, 10, 11, 12, 13], greedy(9), return_logprob=True, logprob_start_len=0)],
        [Request([300, 2, 40, 41], greedy(5), return_routed_experts=arch == "qwen3_moe")]
        + [Request([77] * 9, SamplingParams(max_new_tokens=4, temperature=1.0, seed=s)) for s in range(3)],  # forks
    ]
    _drive(eng, waves)
    again = Request(first.prompt_ids + first.output_ids + [12, 13], greedy(3))  # a cached prefix
    _drive(eng, [[again]])
    eng.graphs = graphs_mod.DecodeGraphs(eng.model, eng.pool.alloc() * eng.pool.block_size, 8, capture=False)
    _drive(eng, [[Request([5, 6], greedy(4)), Request([7, 8, 9, 10, 11, 12], greedy(6))]])
    assert found == [], "host synchronisations inside the forward:\n" + "\n".join(sorted(set(found)))
    want = {"decode", "+prefill", "decode+prefill", "+prefill+cached", "static"}
    assert want <= {k.replace("+routes", "") for k in kinds}, kinds
    if arch == "qwen3_moe":
        assert eng.model.experts_kind == "grouped" and any("routes" in k for k in kinds)
