"""Attention of the native forward: decode tokens over their persistent rows, prompt chunks causally.

Functions of a `NativeModel` (its pools, head counts, scale), kept apart so the eager forward
(`NativeModel.forward`) and the static decode step CUDA graphs capture (`engine.graphs`) share
them. Everything here takes its lengths from host metadata (`Batch.decode_plan`,
`Batch.prefill_plan`, `Prefill`'s ints) and its indices as tensors already on the device:
no value is read back from the device, and no tensor is made from host data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from furlong.engine.decode_rows import DecodePlan, DecodeRows
    from furlong.engine.model import Batch, NativeModel


def decode_mask(row_lens: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, 1, L] additive mask: 0 where a row's key position is inside its length, -inf past it."""
    ar = torch.arange(L, device=row_lens.device)
    return torch.zeros(row_lens.shape[0], 1, 1, L, dtype=dtype, device=row_lens.device).masked_fill_(
        (ar[None, :] >= row_lens[:, None])[:, None, None, :], float("-inf")
    )


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

    The g query heads of a kv head are passed to SDPA as g query *positions* of that head, so the
    kv rows are read once per kv head, never repeated, and the strided row views go in as they are.
    Why SDPA rather than matmul + softmax + matmul (what this was): on CPU its fused kernel took
    159 us a layer against 397 us in bf16 (whose batched matmuls copied the strided rows first) and
    156 against 182 us in fp32 (R=32, 4 kv heads x 2, hd 64, L 90; 2 threads, Intel Xeon)."""
    R, hd = q.shape[0], m.head_dim
    qd = q.view(R, m.n_kv, m.n_heads // m.n_kv, hd)
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=m.scale).reshape(R, m.n_heads, hd)


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
    """Causal attention of every prompt chunk, written into `out` at its flat positions."""
    g, hd = m.n_heads // m.n_kv, m.head_dim
    pp = b.prefill_plan
    if pp is not None:  # fresh chunks, padded into one call
        qs = q[pp.idx].transpose(1, 2)  # [P, H, Lm, hd]
        ks = k[pp.idx].transpose(1, 2).repeat_interleave(g, dim=1)
        vs = v[pp.idx].transpose(1, 2).repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=pp.mask, scale=m.scale)
        out[pp.dst] = o.transpose(1, 2).flatten(0, 1).index_select(0, pp.src)
    kp, vp = m.k_pool[li].view(-1, m.n_kv, hd), m.v_pool[li].view(-1, m.n_kv, hd)
    for p in b.prefills:
        if p.cached == 0:
            continue
        qs = q[p.start : p.start + p.n].transpose(0, 1)[None]  # [1, H, n, hd]
        ks, vs = kp.index_select(0, p.ctx_slots), vp.index_select(0, p.ctx_slots)
        ar = torch.arange(p.cached + p.n, device=q.device)
        mask = ar[None, :] <= ar[p.cached :, None]
        ks = ks.transpose(0, 1).repeat_interleave(g, dim=0)[None]
        vs = vs.transpose(0, 1).repeat_interleave(g, dim=0)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=m.scale)
        out[p.start : p.start + p.n] = o[0].transpose(0, 1)
