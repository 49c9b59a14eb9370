"""CUDA-graph capture of the decode step (`engine.cuda_graphs`), one graph per batch-size bucket.

Why: a decode step of a small model on a GPU is hundreds of tiny kernels, and launching them
from Python costs more than running them. A CUDA graph records the whole step once and replays
it with one launch. A graph replays fixed shapes at fixed addresses, so the step it records is a
*static* one (`static_decode_step`):

* the batch is padded to its bucket B (1, 2, 4, 8, ... up to `engine.max_running`); padded rows
  decode token 0 at position 0 into the free decode rows [D, B) (the rows in use are always
  packed into [0, D), `decode_rows.DecodeRows`) and write their pool KV into one scratch block
  that no request is ever given; their logits are dropped;
* its inputs live in one static [7, B] index buffer, refreshed by one non-blocking copy a step;
* attention runs over the decode rows' whole capacity (`DecodeRows.cap`), masked by length, so a
  longer context needs no new graph until the rows' storage grows — then (and whenever the
  storage is reallocated, `DecodeRows.generation`) the graphs are dropped and captured again;
* rows of sequences that joined are gathered from the pool before the replay, eagerly.

Weights are read in place. A weight update copies into the same parameter storage
(`weight_update.apply_named_tensors` uses `copy_`) and on CUDA the forward multiplies by those
very tensors (no oneDNN re-pack there: `NativeModel._pack` is the identity), so a captured graph
reads the new weights at its next replay. A re-pack that allocated new storage would leave the
graph reading the old one: the runner compares the weights' storage addresses each step and
recaptures when any moved. Prefill, mixed batches, routed-expert recording, LoRA adapters and
batches over the largest bucket run eagerly.

`capture=False` runs the same static step eagerly: that is what the CPU tests compare with the
dynamic forward (tests/unit/test_engine_graphs.py); replay ≡ eager on CUDA is
tests/gpu/test_cuda_graphs.py.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from furlong.engine import mixed_step
from furlong.engine.attention import decode_mask, fill_rows, row_slots, rows_attention, write_rows
from furlong.engine.compiled_step import CompiledStep
from furlong.engine.device import batch_to

if TYPE_CHECKING:
    from furlong.engine.decode_rows import DecodeRows
    from furlong.engine.model import Batch, NativeModel


def buckets(max_running: int) -> list[int]:
    """Powers of two from 1 to the first one >= `max_running`."""
    out = [1]
    while out[-1] < max_running:
        out.append(out[-1] * 2)
    return out


def require_cuda(enabled: bool, device: torch.device) -> None:
    """Refuse `engine.cuda_graphs` on a device that is not CUDA, naming both settings (before the model loads)."""
    if enabled and device.type != "cuda":
        raise ValueError(
            f"engine.cuda_graphs=true (--cuda-graphs) captures CUDA graphs, but this engine computes on {device} "
            "(engine.device): set engine.device=cuda[:N] on a machine with a GPU, or engine.cuda_graphs=false"
        )


def static_decode_step(
    m: NativeModel, dec: DecodeRows, meta: torch.Tensor, cols: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits [B, V] of B padded decode tokens; fixed shapes, no host value read: what a graph records.

    `meta` rows: token ids, positions, pool write slots, decode row of each token, token of each
    row, context length of each row (row order), write column of each token. Attention reads the
    first `cols.shape[0]` columns of the rows (`cols` is only a length, carried as a tensor size so
    `torch.compile` keeps it symbolic; None: their whole capacity, what a CUDA graph must read)."""
    ids, pos, slots, rows, inv, row_lens, last = meta.unbind(0)
    B = ids.shape[0]
    L = dec.cap if cols is None else cols.shape[0]
    x, cos, sin = m._embed(ids, pos)
    mask = decode_mask(row_lens, L, x.dtype)
    at = row_slots(dec, rows, last)
    for li in range(len(m.layers)):
        q, k, v = m._qkv(li, x, cos, sin)
        m.write_kv(li, slots, k, v)
        write_rows(dec, li, at, k, v)
        kd, vd = dec.k[li], dec.v[li]
        o = rows_attention(m, q.index_select(0, inv), kd[:B, :, :L], vd[:B, :, :L], mask).index_select(0, rows)
        x = m._mlp(li, x + m.proj(f"{li}.o", o.reshape(B, -1)), None)
    return m._head(x)


class DecodeGraphs:
    """Replays (or, `capture=False`, runs eagerly) the static decode step of each bucket."""

    def __init__(
        self, model: NativeModel, scratch_slot: int, max_running: int, capture: bool = True, compiled: bool = False
    ):
        """`capture`: record and replay CUDA graphs; `compiled` (and no capture): run the step compiled by
        `torch.compile` (`engine.compile`, `compiled_step.py`); neither: run it eagerly (tests)."""
        self.m, self.scratch, self.capture = model, scratch_slot, capture
        self.compiled = CompiledStep(model) if compiled and not capture else None
        # steps with short prompt chunks, over the rows (`mixed_step`): compiled, or (tests) run eagerly
        self.mixed = (
            CompiledStep(model, mixed_step.static_mixed_step, "mixed step") if compiled and not capture else None
        )
        self.mixed_steps = 0
        self.device = model.k_pool[0].device
        self.buckets = buckets(max(max_running, 2 if compiled else 1))
        self.meta: dict[int, torch.Tensor] = {}  # bucket -> static [7, B] index buffer
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (graph, its static logits)
        self.key: tuple = ()  # (rows' storage generation, weights' addresses) the graphs were captured for
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = {B: 0 for B in self.buckets}  # steps run by each bucket's static step (tests, stats)
        model.keep_decode_rows = capture  # idle engine: keep the rows the graphs read (`NativeModel.release`)

    def bucket(self, D: int) -> int | None:
        """The padded batch size of D decode tokens. Compiled: at least 2, since a dynamic-shape graph
        specialises size 1 and would compile a second time for it."""
        return next((B for B in self.buckets if B >= D and (B > 1 or self.compiled is None)), None)

    def fits(self, b: Batch) -> bool:
        """A decode-only step the static step computes exactly as the eager forward would."""
        ad = getattr(self.m, "adapters", None)
        return (
            b.n_decode > 0
            and not b.prefills
            and b.input_ids.shape[0] == b.n_decode
            and not b.want_routes
            and not b.lora
            and (ad is None or getattr(ad, "policy", None) is None)
            and self.bucket(b.n_decode) is not None
        )

    def fits_mixed(self, b: Batch) -> bool:
        """A step with prompt chunks that `mixed_step` runs over the rows (not under CUDA graphs, whose
        fixed shapes it does not have)."""
        return not self.capture and mixed_step.fits(b, getattr(self.m, "adapters", None))

    def run_mixed(self, b: Batch) -> tuple[torch.Tensor, None]:
        """(logits, no routes) of a host batch that `fits_mixed` (`mixed_step.run`)."""
        return mixed_step.run(self, b)

    def _host_meta(self, b: Batch, B: int) -> torch.Tensor:
        D, p = b.n_decode, b.decode_plan
        rows = p.rows_list + list(range(D, B))  # padded tokens take the free rows
        lens = b.decode_lens_host + [1] * (B - D)
        inv = sorted(range(B), key=rows.__getitem__)
        host = torch.zeros(7, B, dtype=torch.long)
        host[0, :D], host[1, :D], host[2, :D] = b.input_ids, b.positions, b.write_slots
        host[2, D:] = self.scratch
        host[3], host[4] = torch.tensor(rows), torch.tensor(inv)
        host[5] = torch.tensor([lens[i] for i in inv])
        host[6, :D] = b.decode_lens - 1
        return host

    def _weights_key(self) -> tuple:
        """Where every weight the step multiplies by lives: a tensor's storage address, or (a held format,
        e.g. quantised codes + scales) the object and the addresses of the tensors it holds."""

        def where(w) -> Any:
            if isinstance(w, torch.Tensor):
                return w.data_ptr() if w.layout == torch.strided else id(w)  # oneDNN-packed: no plain storage
            return (id(w), *(where(t) for t in vars(w).values() if isinstance(t, torch.Tensor)))

        return tuple(where(w) for w in self.m.w.values())

    def _capture(self, B: int, dec: DecodeRows) -> tuple[Any, torch.Tensor]:
        """Warm up on a side stream (same inputs: the step is idempotent), then record the step."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            static_decode_step(self.m, dec, self.meta[B])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call (an HTTP handler) does not invalidate this capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = static_decode_step(self.m, dec, self.meta[B])
        return graph, logits

    @torch.inference_mode()
    def run(self, b: Batch) -> tuple[torch.Tensor, None]:
        """(logits [D, V] on the host, no routes) of a prepared host batch that `fits`."""
        m = self.m
        if m._dirty:
            m._repack()
        if getattr(m, "adapters", None) is not None:
            m.adapters.plan = None  # `fits`: no adapter serves this step (a plan may be left from an eager one)
        D, B = b.n_decode, self.bucket(b.n_decode)
        dec, m.decode_kv = m.decode_kv, None  # set again only if this step completes
        # rows [D, B) for the padded tokens; compiled, a capacity above this step's longest context, so
        # the rows read are never the whole (contiguous) storage, a case the graph would specialise on
        dec.reserve(B, 0 if self.compiled is None else b.decode_plan.L + 1)
        key = (dec.generation, self._weights_key())
        if key != self.key:
            self.graphs.clear()  # they read storage that moved
            self.key = key
        host = self._host_meta(b, B)
        # On the host no device context: as a torch-function mode it would intercept every op of the step
        with self.device if self.device.type != "cpu" else contextlib.nullcontext():
            if B not in self.meta:
                self.meta[B] = torch.zeros(7, B, dtype=torch.long)
            self.meta[B].copy_(host, non_blocking=True)
            p = b.decode_plan
            if p.fill_len:
                on = batch_to(p, self.device)
                blocks = b.decode_blocks.to(self.device, non_blocking=True)
                for li in range(len(m.layers)):
                    fill_rows(m, li, dec, on, blocks)
            if self.compiled is not None:
                logits = self.compiled(m, dec, p.L, [(self.meta[B], (1,))], kept=True)
            elif not self.capture:
                logits = static_decode_step(m, dec, self.meta[B])
            else:
                if B not in self.graphs:
                    self.graphs[B] = self._capture(B, dec)
                graph, logits = self.graphs[B]
                graph.replay()
            out = logits[:D].cpu()  # the step's one device-to-host copy: sampling runs on the host
        dec.commit(p.rows_list, b.decode_lens_host)
        m.decode_kv = dec
        self.replays[B] += 1
        return out, None


def for_engine(engine: Any, cuda_graphs: bool, compile_decode: bool = False) -> DecodeGraphs | None:
    """The engine's decode-step runner: CUDA graphs (`engine.cuda_graphs`, the device checked by
    `require_cuda`), the compiled step (`engine.compile`), or None (the eager forward)."""
    if not (cuda_graphs or compile_decode):
        return None
    from furlong.engine.model import NativeModel

    setting = "engine.cuda_graphs=true (--cuda-graphs) captures" if cuda_graphs else "engine.compile=true compiles"
    if cuda_graphs and compile_decode:
        raise ValueError("engine.compile and engine.cuda_graphs: both run the decode step their own way; set one")
    if not isinstance(engine.model, NativeModel):
        raise ValueError(
            f"{setting} the native forward, but this model runs on the HF fallback ({engine.backend}): use a "
            f"native architecture, or set {setting.split('=')[0]}=false"
        )
    scratch = engine.pool.alloc()  # one block no request is ever given: where padded rows write their KV
    return DecodeGraphs(
        engine.model, scratch * engine.pool.block_size, engine.max_running, capture=cuda_graphs, compiled=compile_decode
    )
