"""Mixed steps (decode tokens plus short prompt chunks) as one step over the decode rows, compiled.

Why: in agent work a step that decodes also takes in, nearly every time, a turn that just came
back from its tool (a few tool tokens after a cached context), and the eager forward that runs such
a mixed step costs about 1.6x a compiled decode step of the same rows: ~300 small ops, three
attention calls a layer and, the next step, a second gather of the new sequence's context into
its decode row. Here a prompt chunk is given its decode row at once (`NativeModel.prepare` with
`with_prefills`), filled from the pool up to its cached prefix, and the whole step reads rows:

* every token's k and v go to the pool (the truth) and to its row, at its position;
* decode tokens attend one query a row, as in the decode step (`rows_attention` over all rows; a
  prompt row there holds a throwaway query);
* each prompt chunk's tokens attend over their own row as up to `MAX_CHUNK` queries, each masked
  at its own position (causal), the chunk's rows gathered into one small [P, kv, L, hd] copy;
* the hidden states of every token come back; the logits rows are picked on the host side.

The step is `static_mixed_step`: its inputs are three index tensors of dynamic sizes (tokens,
rows, chunks x their longest chunk), so one compile (`CompiledStep`, `engine.compile`) serves every
mix. A size of 1 would be specialised by the compile, so rows and chunks are padded to at least 2
(a padded row or chunk reads row 0 with a one-column mask; its output is dropped). Only steps that
`fits` take this path: a chunk longer than `MAX_CHUNK` (a fresh long prompt, whose big products
gain little from fusion, while its padded query block would cost more) runs the eager forward, as
do routed-expert recording and LoRA adapters.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from furlong.engine.attention import decode_mask, fill_rows, query_mask, row_slots, rows_attention, write_rows

if TYPE_CHECKING:
    from furlong.engine.decode_rows import DecodeRows
    from furlong.engine.model import Batch, NativeModel

MAX_CHUNK = 64  # prompt tokens of one sequence a mixed step takes over rows; longer chunks run eagerly


def fits(b: Batch, adapters) -> bool:
    """A step with prompt chunks that `static_mixed_step` computes as the eager forward would."""
    T = b.input_ids.shape[0]
    return (
        bool(b.prefills)
        and T >= 2
        and b.n_decode + len(b.prefills) >= 2
        and max(p.n for p in b.prefills) <= MAX_CHUNK
        and not b.want_routes
        and not b.lora
        and (adapters is None or getattr(adapters, "policy", None) is None)
    )


def host_inputs(b: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's three index tensors, from the batch and its row plan (`b.decode_plan`, every sequence).

    tok [5, T]: id, position, pool slot, row, and where its attention output sits in the step's
    [rows + chunks x Q] outputs. rows [2, Rp]: each row's decode token and its context length (a row
    without one: token 0, length 1). chunks [3, Pp, Q]: each chunk's tokens, their context lengths
    (causal: position + 1; padding 1) and the chunk's row."""
    D, P, plan = b.n_decode, len(b.prefills), b.decode_plan
    rows = plan.rows_list
    Rp, Pp = max(D + P, 2), max(P, 2)
    Q = max(2, *(p.n for p in b.prefills))
    T = b.input_ids.shape[0]
    tok_row, tok_out = rows[:D] + [0] * (T - D), rows[:D] + [0] * (T - D)
    row_tok, row_len = [0] * Rp, [1] * Rp
    for i in range(D):
        row_tok[rows[i]], row_len[rows[i]] = i, b.decode_lens_host[i]
    ch_tok, ch_len, ch_row = [[0] * Q for _ in range(Pp)], [[1] * Q for _ in range(Pp)], [[0] * Q for _ in range(Pp)]
    for j, p in enumerate(b.prefills):
        r = rows[D + j]
        ch_row[j] = [r] * Q
        for t in range(p.n):
            k = p.start + t
            ch_tok[j][t], ch_len[j][t] = k, p.cached + t + 1
            tok_row[k], tok_out[k] = r, Rp + j * Q + t
    tok = torch.stack((b.input_ids, b.positions, b.write_slots, torch.tensor(tok_row), torch.tensor(tok_out)))
    return tok, torch.tensor([row_tok, row_len]), torch.tensor([ch_tok, ch_len, ch_row])


def block_table(b: Batch, block_size: int) -> torch.Tensor:
    """[R, nb] pool blocks of every sequence of the step (decode ones, then each chunk's), padded with 0."""
    tables = [] if b.decode_blocks is None else b.decode_blocks.tolist()
    tables += [p.ctx_slots[::block_size].div(block_size, rounding_mode="floor").tolist() for p in b.prefills]
    nb = max(map(len, tables))
    return torch.tensor([t + [0] * (nb - len(t)) for t in tables])


def static_mixed_step(
    m: NativeModel, dec: DecodeRows, tok: torch.Tensor, rows: torch.Tensor, chunks: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """Hidden states [T, hidden] (before the final norm) of a mixed step; no host value read.

    Attention reads the first `cols.shape[0]` columns of the rows (a length carried as a tensor size,
    so the compile keeps it symbolic)."""
    ids, pos, slots, tok_row, tok_out = tok.unbind(0)
    row_tok, row_len = rows.unbind(0)
    ch_tok, ch_len, ch_row = chunks.unbind(0)
    Rp, (Pp, Q), L = rows.shape[1], ch_tok.shape, cols.shape[0]
    kv, g, hd = m.n_kv, m.n_heads // m.n_kv, m.head_dim
    x, cos, sin = m._embed(ids, pos)
    row_mask = decode_mask(row_len, L, x.dtype)
    chunk_mask = query_mask(ch_len.repeat_interleave(g, dim=1), L, x.dtype)  # [Pp, 1, Q * g, L]
    at = row_slots(dec, tok_row, pos)
    ch_rows, ch_q = ch_row[:, 0], ch_tok.reshape(-1)
    for li in range(len(m.layers)):
        q, k, v = m._qkv(li, x, cos, sin)
        m.write_kv(li, slots, k, v)
        write_rows(dec, li, at, k, v)
        kd, vd = dec.k[li], dec.v[li]
        o_rows = rows_attention(m, q.index_select(0, row_tok), kd[:Rp, :, :L], vd[:Rp, :, :L], row_mask)
        qc = q.index_select(0, ch_q).view(Pp, Q, kv, g, hd).transpose(1, 2).reshape(Pp, kv, Q * g, hd)
        kc, vc = (t[:, :, :L].index_select(0, ch_rows) for t in (kd, vd))  # copies the L columns read
        o_ch = m.attend_rows(qc, kc, vc, chunk_mask, m.scale).view(Pp, kv, Q, g, hd).transpose(1, 2)
        o = torch.cat((o_rows.reshape(Rp, -1), o_ch.reshape(Pp * Q, -1))).index_select(0, tok_out)
        x = m._mlp(li, x + m.proj(f"{li}.o", o), None)
    return x


@torch.inference_mode()
def run(runner, b: Batch) -> tuple[torch.Tensor, None]:
    """(logits of `b.logit_rows` on the host, no routes) of a host batch that `fits`, through `runner`
    (`graphs.DecodeGraphs`: its compiled mixed step, or the same step run eagerly)."""
    m = runner.m
    if m._dirty:
        m._repack()
    if getattr(m, "adapters", None) is not None:
        m.adapters.plan = None  # `fits`: no adapter serves this step (a plan may be left from an eager one)
    m.prepare(b, with_prefills=True)  # rows for the chunks too: they keep them when they decode
    dec, m.decode_kv = m.decode_kv, None  # set again only if this step completes
    p = b.decode_plan
    tok, rows, chunks = host_inputs(b)
    # compiled: a capacity above this step's longest context, so the rows read are never the whole storage
    dec.reserve(rows.shape[1], p.L + 1)
    dev = runner.device
    tok, rows, chunks = (t.to(dev, non_blocking=True) for t in (tok, rows, chunks))
    fill = _fills(b)
    if fill.fill_len:
        on = fill if dev.type == "cpu" else _plan_to(fill, dev)
        blocks = block_table(b, m.block_size).to(dev, non_blocking=True)
        for li in range(len(m.layers)):
            fill_rows(m, li, dec, on, blocks)
    if runner.mixed is not None:
        dims = [(tok, (1,)), (rows, (1,)), (chunks, (1, 2))]
        x = runner.mixed(m, dec, p.L, dims)
    else:
        x = static_mixed_step(m, dec, tok, rows, chunks, torch.empty(p.L, dtype=torch.int8, device=dev))
    logits = m._head(x.index_select(0, b.logit_rows.to(dev, non_blocking=True))).cpu()
    lens = b.decode_lens_host + [c.cached + c.n for c in b.prefills]
    dec.commit(p.rows_list, lens)
    m.decode_kv = dec
    runner.mixed_steps += 1
    return logits, None


def _fills(b: Batch):
    """The plan's rows to gather from the pool, up to what the pool holds before this step: a decoding
    sequence's context, a chunk's cached prefix (none for a fresh prompt: the step writes all of it)."""
    p = b.decode_plan
    upto = b.decode_lens_host + [c.cached for c in b.prefills]
    keep = [(i, r) for i, r in zip(p.fill_i.tolist(), p.fill_r.tolist()) if upto[i]]
    return dataclasses.replace(
        p,
        fill_i=torch.tensor([i for i, _ in keep], dtype=torch.long),
        fill_r=torch.tensor([r for _, r in keep], dtype=torch.long),
        fill_len=max((upto[i] for i, _ in keep), default=0),
    )


def _plan_to(p, dev):
    from furlong.engine.device import batch_to

    return batch_to(p, dev)
