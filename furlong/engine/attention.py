"""Attention of the native forward: decode tokens over their persistent rows, prompt chunks causally.

Functions of a `NativeModel` (its pools, head counts, scale), kept apart so the eager forward
(`NativeModel.forward`) and the static decode step CUDA graphs capture (`engine.graphs`) share
them. Everything here takes its lengths from host metadata (`Batch.decode_plan`,
`Batch.prefill_plan`, `Prefill`'s ints) and its indices as tensors already on the device:
no value is read back from the device, and no tensor is made from host data.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from furlong.engine.decode_rows import DecodePlan, DecodeRows
    from furlong.engine.model import Batch, NativeModel


def query_mask(lens: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, Q, L] additive mask of Q queries a row, each seeing the first `lens[r, q]` key positions of
    its row: 0 inside, -inf past it."""
    ar = torch.arange(L, device=lens.device)
    R, Q = lens.shape
    return torch.zeros(R, 1, Q, L, dtype=dtype, device=lens.device).masked_fill_(
        (ar >= lens[:, :, None])[:, None], float("-inf")
    )


def decode_mask(row_lens: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, 1, L] additive mask: 0 where a row's key position is inside its length, -inf past it."""
    return query_mask(row_lens[:, None], L, dtype)


def fill_rows(m: NativeModel, li: int, dec: DecodeRows, p: DecodePlan, decode_blocks: torch.Tensor) -> None:
    """Gather the rows of joined (or moved) sequences from their pool blocks: the first `p.fill_len` slots."""
    Lf, n = p.fill_len, p.fill_i.shape[0]
    flat = decode_blocks[p.fill_i, : -(-Lf // m.block_size)].reshape(-1)  # index_select: fast here
    for pool, rows in ((m.k_pool[li], dec.k[li]), (m.v_pool[li], dec.v[li])):
        rows[p.fill_r, :, :Lf] = pool.index_select(0, flat).view(n, -1, m.n_kv, m.head_dim)[:, :Lf].transpose(1, 2)


def row_slots(dec: DecodeRows, rows: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[D * kv] indices into a row storage viewed flat as [R * kv * cap, hd]: each decoding token's
    column `last` in its row `rows`, one index per kv head. Computed once per step, shared by all layers."""
    kv, cap = dec.n_kv, dec.cap
    heads = torch.arange(kv, device=rows.device)
    return ((rows[:, None] * kv + heads[None, :]) * cap + last[:, None]).reshape(-1)


def write_rows(dec: DecodeRows, li: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Layer `li`'s new k and v ([D, kv, hd]) into their rows at `slots` (`row_slots`).

    Why flat: the advanced-index assignment `rows_k[rows, :, last] = k` took ~120 us a call on
    CPU (two index tensors into a 4-d tensor), one `index_copy_` over whole hd-vectors a few."""
    hd = dec.head_dim
    dec.k[li].view(-1, hd).index_copy_(0, slots, k.reshape(-1, hd))
    dec.v[li].view(-1, hd).index_copy_(0, slots, v.reshape(-1, hd))


def rows_attention(m: NativeModel, q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, mask: torch.Tensor):
    """GQA attention of R queries (row order, [R, H, hd]) over rows [R, kv, L, hd]; returns [R, H, hd].

    The g query heads of a kv head are passed as g query *positions* of that head, so the kv rows are
    read once per kv head, never repeated, and the strided row views go in as they are. How: the
    model's `attend_rows` (`pick_decode_attention`, measured when the model loads)."""
    R, hd = q.shape[0], m.head_dim
    qd = q.view(R, m.n_kv, m.n_heads // m.n_kv, hd)
    return m.attend_rows(qd, kd, vd, mask, m.scale).reshape(R, m.n_heads, hd)


def sdpa_rows(qd: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """[R, kv, g, hd] queries over [R, kv, L, hd] rows through SDPA's fused kernel.

    Why SDPA rather than matmul + softmax + matmul: on the Intel Xeon of the benchmarks its kernel
    took 159 us a layer against 397 us in bf16 (whose batched matmuls copied the strided rows first)
    and 156 against 182 us in fp32 (R=32, 4 kv heads x 2, hd 64, L 90; 2 threads). Scores stay fp32
    inside the kernel whatever the dtype, so it is the only choice below fp32."""
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)


def bmm_rows(qd: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention as `sdpa_rows` as two batched matmuls over the strided rows (viewed, not copied)
    and one masked softmax. Why: on an AVX2 AMD EPYC (2 threads, fp32, same shapes) SDPA's CPU kernel
    took 630-740 us a layer, these 270 us, which is the time to stream the rows from memory once."""
    R, kv, g, hd = qd.shape
    L = kd.shape[2]
    s = torch.baddbmm(
        mask.expand(R, kv, g, L).reshape(R * kv, g, L),
        qd.reshape(R * kv, g, hd),
        kd.flatten(0, 1).transpose(1, 2),
        alpha=scale,
    )
    return torch.bmm(s.softmax(-1), vd.flatten(0, 1)).view(R, kv, g, hd)


COLD_ROWS_BYTES = 128 << 20  # the rows `pick_decode_attention` reads a round: far more than a core's own caches
MAX_SETS = 64  # and at most this many calls a round (tiny shapes: the probe stays short)

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@functools.cache
def pick_decode_attention(
    dtype: torch.dtype, device: torch.device, n_kv: int, group: int, head_dim: int, rows: int = 32, cols: int = 96
) -> DecodeAttention:
    """The fastest of `sdpa_rows`, `bmm_rows` (fp32) and `rows_kernel.native_rows` (bf16 and fp32, where its C
    kernel builds) on this machine, timed once on a decode step's shapes.

    Which one wins depends on the CPU (see each one's docstring), so it is measured rather than
    assumed: four interleaved rounds each, the best of the last three kept. Each round attends
    `COLD_ROWS_BYTES` of distinct rows, one set after another, as a step reads every layer's rows once:
    timed on one set that stays in the cache, SDPA and the C kernel came out even on the 2-vCPU Xeon
    with AMX (~220 us a call each), while inside the engine's bf16 decode step SDPA took ~450 us a layer
    and the kernel ~140 (a step of 12.5 against 9.9 ms, so a pick that fell to SDPA cost 25%); over
    128 MiB of rows the probe reads them as the step does (SDPA ~470 us, the kernel ~290). It adds
    0.1-0.3 s to a model's load on one thread (m25, fp32 and bf16). Off the CPU, or in a dtype only
    SDPA computes, SDPA (`sdpa_rows` says why). All compute the same attention; they differ in
    summation order and exp only (fp32 ~1e-6; bf16 within one rounding of the output). Measured once
    per process and shapes (cached), so every model a process loads computes the same way."""
    from furlong.engine import rows_kernel

    best = {sdpa_rows: float("inf")}
    if device.type == "cpu" and dtype == torch.float32:
        best[bmm_rows] = float("inf")
    if device.type == "cpu" and rows_kernel.available(dtype):
        best[rows_kernel.native_rows] = float("inf")
    if len(best) == 1:
        return sdpa_rows
    cap = cols + 32  # rows are views into a longer storage, as in the engine
    gen = torch.Generator().manual_seed(0)  # its own: the process's random stream is not touched
    k, v = (torch.randn(rows, n_kv, cap, head_dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(rows, n_kv, group, head_dim, generator=gen).to(dtype)
    mask = decode_mask(torch.randint(cols // 2, cols + 1, (rows,), generator=gen), cols, dtype)
    n_sets = max(1, min(MAX_SETS, COLD_ROWS_BYTES // (2 * k.numel() * k.element_size())))
    sets = [(k.clone()[:, :, :cols], v.clone()[:, :, :cols]) for _ in range(n_sets)]  # same values, new memory
    with torch.inference_mode():
        for i in range(4):  # the first round warms up (allocator, thread pool) and is not counted
            for fn in best:
                t0 = time.perf_counter()
                for ks, vs in sets:
                    fn(q, ks, vs, mask, head_dim**-0.5)
                best[fn] = min(best[fn], time.perf_counter() - t0) if i >= 1 else best[fn]
    return min(best, key=best.__getitem__)


def decode_attention(m: NativeModel, li: int, q, k, v, b: Batch, dec: DecodeRows, mask, slots) -> torch.Tensor:
    """Decode attention of the D decoding tokens over their persistent rows (batch order in and out);
    `slots`: `row_slots` of this step's decode plan."""
    p = b.decode_plan
    D, L = b.n_decode, p.L
    kd, vd = dec.k[li], dec.v[li]
    if p.fill_len:  # after this step's pool write: the gathered rows include the new token
        fill_rows(m, li, dec, p, b.decode_blocks)
    write_rows(dec, li, slots, k[:D], v[:D])
    qd = q[:D] if p.inv is None else q[:D].index_select(0, p.inv)  # attention runs in row order
    o = rows_attention(m, qd, kd[:D, :, :L], vd[:D, :, :L], mask)
    return o if p.inv is None else o.index_select(0, p.rows)


def prefill_attention(m: NativeModel, li: int, q, k, v, b: Batch, out: torch.Tensor) -> None:
    """Causal attention of every prompt chunk, written into `out` at its flat positions: fresh chunks over
    this step's keys, chunks after a cached prefix over their whole context in the pool, one call each."""
    g, hd = m.n_heads // m.n_kv, m.head_dim
    pp = b.prefill_plan
    if pp is not None:  # fresh chunks, padded into one call
        qs = q[pp.idx].transpose(1, 2)  # [P, H, Lm, hd]
        ks = k[pp.idx].transpose(1, 2).repeat_interleave(g, dim=1)
        vs = v[pp.idx].transpose(1, 2).repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=pp.mask, scale=m.scale)
        out[pp.dst] = o.transpose(1, 2).flatten(0, 1).index_select(0, pp.src)
    cp = b.cached_plan
    if cp is not None:  # chunks after a cached prefix, padded into one call over their context in the pool
        P = cp.idx.shape[0]
        qs = q[cp.idx].transpose(1, 2)  # [P, H, Lq, hd]
        ks, vs = (
            pool[li].view(-1, m.n_kv, hd).index_select(0, cp.slots).view(P, -1, m.n_kv, hd).transpose(1, 2)
            for pool in (m.k_pool, m.v_pool)
        )
        ks, vs = ks.repeat_interleave(g, dim=1), vs.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=cp.mask, scale=m.scale)
        out[cp.dst] = o.transpose(1, 2).flatten(0, 1).index_select(0, cp.src)
