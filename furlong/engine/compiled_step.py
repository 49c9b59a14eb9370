"""`engine.compile`: the decode step (and the mixed step) compiled by `torch.compile` (Inductor), for CPUs.

Why: a decode step of a small model on a CPU is a few dense projections and ~200 small
elementwise ops (RMSNorm, RoPE, SiLU x up, residual adds, KV writes, the attention mask), each a
dispatch, an allocation and a pass over memory. Inductor fuses the ops between two projections
into one generated C++ loop. It compiles the *static* decode step the CUDA graphs record
(`graphs.static_decode_step`: the batch padded to a power-of-two bucket, its indices in one
[7, B] tensor) once: what varies between steps is marked dynamic before the first compile (the
bucket, the rows' storage, the context length read, carried as a tensor's size) and nothing else
is (weights, pool and model sizes stay static, which keeps the compile short), and duck sizing is
off, so a size that merely equals another today (rows = bucket) is not assumed equal tomorrow.
One graph serves every bucket and context; the attention reads the rows up to this step's
longest context, not their whole capacity.

Weights are not baked into the graph, nor even graph inputs: every projection is the opaque op
`furlong::proj`, which calls `NativeModel.proj` when the step runs and so reads whatever the
model holds then (oneDNN-packed, quantised, fresh from a weight sync). A weight update therefore
stays a copy (and a re-pack) and never recompiles anything.

The first decode step compiles (8-11 s for the 25M-parameter model on 2 cores; logged, and
counted in `compiles` and `compile_s`). Only decode-only steps that `DecodeGraphs.fits` run here;
steps with short prompt chunks run `mixed_step.static_mixed_step`, compiled the same way by a second
`CompiledStep`; the others run the eager forward.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import TYPE_CHECKING

import torch

from furlong.engine import eager_ops

if TYPE_CHECKING:
    from furlong.engine.model import NativeModel

log = logging.getLogger("furlong.engine.compiled_step")
_MODELS: weakref.WeakValueDictionary[str, NativeModel] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register(m: NativeModel) -> str:
    """Give `m` the name its projections are called by from a compiled graph (a string: under dynamic
    shapes Dynamo would make an int argument symbolic)."""
    if getattr(m, "compile_id", None) is None:
        m.compile_id = f"m{next(_IDS)}"
        _MODELS[m.compile_id] = m
    return m.compile_id


def out_features(m: NativeModel, key: str) -> int:
    src = m.sources.get(key)
    return src[0].shape[0] if src is not None else m.w[key].layer.out_features  # a QuantProj's QuantLinear


def _proj_shape(x: torch.Tensor, model: str, key: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features(_MODELS[model], key))


@eager_ops.op("proj", "(Tensor x, str model, str key) -> Tensor", fake=_proj_shape)
def proj_op(x: torch.Tensor, model: str, key: str) -> torch.Tensor:
    """`NativeModel.proj(key, x)` of the model registered as `model`, run eagerly when the graph runs."""
    return _MODELS[model].proj(key, x)


def proj(m: NativeModel, key: str, x: torch.Tensor) -> torch.Tensor:
    """What `NativeModel.proj` is while Dynamo traces: the opaque op, by the model's name."""
    return proj_op(x, m.compile_id, key)


def _experts_shape(h: torch.Tensor, model: str, layer: int) -> torch.Tensor:
    return torch.empty_like(h)


@eager_ops.op("experts", "(Tensor h, str model, int layer) -> Tensor", fake=_experts_shape)
def experts_op(h: torch.Tensor, model: str, layer: int) -> torch.Tensor:
    """Layer `layer`'s routed experts of the registered model (`engine.moe.moe`), run eagerly: their
    data-dependent grouping (tokens per expert) is what a traced graph cannot hold."""
    from furlong.engine.moe import moe

    m = _MODELS[model]
    return moe(m.layers[layer].mlp, h, m.experts_kind)[0]


def experts(m: NativeModel, li: int, h: torch.Tensor) -> torch.Tensor:
    """What a MoE block's routed experts are while Dynamo traces: the opaque op."""
    return experts_op(h, m.compile_id, li)


class CompiledStep:
    """One static step (`graphs.static_decode_step`, `mixed_step.static_mixed_step`) compiled once, with
    dynamic shapes, for one model; times its compiles."""

    def __init__(self, m: NativeModel, fn=None, name: str = "decode step"):
        if fn is None:
            from furlong.engine.graphs import static_decode_step as fn
        register(m)
        self.fn = torch.compile(fn, fullgraph=True)
        self.name = name
        self.compile_s = 0.0  # seconds spent in calls that compiled
        self.compiles = 0  # calls that compiled (a new shape class, or the first call)
        self.calls = 0
        self._marked: set[int] = set()  # ids of the kept input buffers already marked
        self._rows_generation = -1  # the rows' storage whose dimensions were last marked

    def __call__(
        self, m: NativeModel, dec, L: int, inputs: list[tuple[torch.Tensor, tuple[int, ...]]], kept: bool = False
    ) -> torch.Tensor:
        """Run the step on `inputs` (each a tensor and its dynamic dims), then a context length L. `kept`: the
        inputs are buffers kept between calls (a bucket's meta buffer), marked once; else marked every call."""
        from torch._dynamo.utils import compilation_time_metrics

        cols = torch.empty(L, dtype=torch.int8, device=dec.device)  # only its size is read
        # What varies between steps is dynamic from the first compile: the batch's sizes, the rows' storage
        # (rows, capacity) and the context read; the weights, the pool and the model's sizes stay static.
        # A mark stays on its tensor, so the persistent ones are marked once: a bucket's meta buffer, and
        # the rows whenever their storage is new (a new generation). Marking all 33 every step and the host's
        # device context cost ~10% of a bf16 decode step on the AMX Xeon (benchmarks/RESULTS.md, round 15).
        torch._dynamo.mark_dynamic(cols, 0)
        if self._rows_generation != dec.generation:
            for t in dec.k + dec.v:
                torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(t, 2)
            self._rows_generation = dec.generation
        for t, dims in inputs:
            if id(t) not in self._marked:
                for d in dims:
                    torch._dynamo.mark_dynamic(t, d)
                if kept:
                    self._marked.add(id(t))
        before = _compiled_seconds(compilation_time_metrics)
        t0 = time.perf_counter()
        # No duck sizing: the rows' storage often holds exactly as many rows as the bucket, and an equality
        # guessed from that would recompile the step when the storage grows or a smaller bucket runs.
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            out = self.fn(m, dec, *(t for t, _ in inputs), cols)
        if _compiled_seconds(compilation_time_metrics) != before:  # this call compiled: count its whole time
            self.compile_s += time.perf_counter() - t0
            self.compiles += 1
            log.info(
                "%s compiled in %.1f s (%d so far, %.1f s in all)",
                self.name,
                time.perf_counter() - t0,
                self.compiles,
                self.compile_s,
            )
        self.calls += 1
        return out


def _compiled_seconds(metrics: dict) -> float:
    return sum(sum(v) for v in metrics.values())
