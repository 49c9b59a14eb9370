"""Turning one scheduler step's sequences into the flat `Batch` a forward runs, and prompt forks.

Why a module of its own: the scheduler (`engine.py`) decides *who* runs; this file
decides *where each token sits* in the flat batch and in the KV pool, which is pure
bookkeeping over the requests and the block pool.

Forks (n samples of one prompt with one prefill): when several fresh requests with
the same prompt are admitted in one step — `sampling_params.n`, a GRPO group, an
OpenAI `n` — only the first (the leader) is prefilled. Each follower shares the
leader's *full* prompt blocks (one more reference; a full block is never written
again), gets its own block for the partial tail block, which the engine copies from
the leader's right after the forward, and draws its first token from the leader's
last-prompt-token logits with its own generator. So n samples cost one prefill and
ceil(n_prompt / block) blocks plus one tail block each, and each sample is exactly
what the same request would produce alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from furlong.engine.adapters import lora_groups
from furlong.engine.kv_cache import BlockPool
from furlong.engine.model import Batch, Prefill
from furlong.engine.request import Request


def can_lead(r: Request) -> bool:
    """A fresh request whose prompt KV may be shared (prompt log-probs / routes need their own)."""
    return r.reuse_prefix and not r.output_ids


def fork(pool: BlockPool, follower: Request, leader: Request) -> bool:
    """Make `follower` share `leader`'s prompt KV; False when no block is free for its tail."""
    bs, n = pool.block_size, len(leader.prompt_ids)
    full = n // bs
    if n % bs and pool.available < 1:
        return False
    follower.blocks = list(leader.blocks[:full])
    pool.share(follower.blocks)
    if n % bs:
        follower.blocks.append(pool.alloc())
    follower.hashes = list(leader.hashes[:full])
    follower.epoch = leader.epoch
    follower.n_cached = 0
    follower.cached_prompt_tokens = n
    follower.fork_of = leader
    return True


def tail_copies(prefill: list[Request], block_size: int) -> tuple[list[int], list[int]]:
    """(source, destination) blocks: each follower's partial tail block, copied from its leader's."""
    src, dst = [], []
    for r in prefill:
        lead = r.fork_of
        if lead is not None and len(r.prompt_ids) % block_size:
            i = len(r.prompt_ids) // block_size
            src.append(lead.blocks[i])
            dst.append(r.blocks[i])
    return src, dst


@dataclass
class PrefillPlan:
    """Every fresh (no cached prefix) prompt chunk padded into one [P, Lm] batch for one attention call.

    Built here, on the host, from the chunks' Python lengths: the forward then only indexes with
    these tensors, never turns a device value into a shape (a boolean mask index would: a host sync)."""

    idx: torch.Tensor  # [P, Lm] flat batch index of each padded position (0 where padded)
    mask: torch.Tensor  # [P, 1, Lm, Lm] causal, and never a padded key
    src: torch.Tensor  # [n] the valid positions, as indices into the flattened [P * Lm]
    dst: torch.Tensor  # [n] their flat batch indices


def prefill_plan(prefills: list[Prefill]) -> PrefillPlan | None:
    fresh = [p for p in prefills if p.cached == 0]
    if not fresh:
        return None
    Lm = max(p.n for p in fresh)
    ar = torch.arange(Lm)
    valid = ar[None, :] < torch.tensor([p.n for p in fresh])[:, None]
    idx = torch.where(valid, torch.tensor([p.start for p in fresh])[:, None] + ar[None, :], 0)
    mask = (ar[None, :] <= ar[:, None])[None] & valid[:, None, :]
    src = torch.tensor([i * Lm + j for i, p in enumerate(fresh) for j in range(p.n)])
    dst = torch.tensor([p.start + j for p in fresh for j in range(p.n)])
    return PrefillPlan(idx, mask[:, None], src, dst)


@dataclass
class CachedPlan:
    """Every prompt chunk that continues a cached prefix, padded into one attention call over the KV pool.

    Why: such a chunk (an agent's next turn: its context is in the pool, its new tokens are not) took a gather,
    a mask and an SDPA call of its own in every layer, ~0.35 ms a chunk a layer on 2 cores (`small` model,
    fp32), and an agentic step carries a dozen. Keys are read from the pool (this step's are written before
    attention); a padded query attends to its chunk's context, so no row of the softmax is empty."""

    idx: torch.Tensor  # [P, Lq] flat batch index of each padded query position (0 where padded)
    slots: torch.Tensor  # [P * Lk] pool slot of each padded key position (0 where padded)
    mask: torch.Tensor  # [P, 1, Lq, Lk] causal over the whole context, never a key past it
    src: torch.Tensor  # [n] the valid query positions, as indices into the flattened [P * Lq]
    dst: torch.Tensor  # [n] their flat batch indices


def cached_plan(prefills: list[Prefill]) -> CachedPlan | None:
    cont = [p for p in prefills if p.cached]
    if not cont:
        return None
    Lq, Lk = max(p.n for p in cont), max(p.cached + p.n for p in cont)
    aq, ak = torch.arange(Lq), torch.arange(Lk)
    n, c = torch.tensor([p.n for p in cont]), torch.tensor([p.cached for p in cont])
    idx = torch.where(aq[None, :] < n[:, None], torch.tensor([p.start for p in cont])[:, None] + aq[None, :], 0)
    mask = (ak[None, None, :] <= (c[:, None] + aq[None, :])[:, :, None]) & (ak < c[:, None] + n[:, None])[:, None, :]
    slots = torch.zeros(len(cont), Lk, dtype=torch.long)
    for i, p in enumerate(cont):
        slots[i, : p.cached + p.n] = p.ctx_slots
    src = torch.tensor([i * Lq + j for i, p in enumerate(cont) for j in range(p.n)])
    dst = torch.tensor([p.start + j for p in cont for j in range(p.n)])
    return CachedPlan(idx, slots.reshape(-1), mask[:, None], src, dst)


def slots(req: Request, start: int, end: int, block_size: int) -> torch.Tensor:
    """Pool slots of `req`'s token positions [start, end)."""
    pos = torch.arange(start, end)
    bt = torch.tensor(req.blocks)
    return bt[pos // block_size] * block_size + pos % block_size


def build_batch(
    decode: list[Request], prefill: list[Request], block_size: int, needs_tokens: bool
) -> tuple[Batch, list[int], list[tuple[int, int]]]:
    """(batch, last_rows, prompt_rows): last_rows indexes the logits matrix per sequence (decode rows
    first, then each prefill's last row; a follower reuses its leader's), prompt_rows is (first row, n)
    of each prefill's prompt log-probs (-1 when not wanted)."""
    bs = block_size
    ids, pos, seq_of = [], [], []
    last_rows: list[int] = []
    prompt_rows: list[tuple[int, int]] = []
    for i, r in enumerate(decode):
        ids.append(r.output_ids[-1] if r.output_ids else r.prompt_ids[-1])
        pos.append(r.n_cached)
        seq_of.append(i)
        last_rows.append(i)
    D = len(decode)
    decode_blocks = lens = None
    lens_host = [r.n_cached + 1 for r in decode]
    write = []
    if D:
        lens = torch.tensor(lens_host)
        nb = -(-max(lens_host) // bs)
        bt = torch.tensor([(r.blocks + [0] * nb)[:nb] for r in decode])
        decode_blocks = bt
        last = lens - 1
        write.append(bt[torch.arange(D), last // bs] * bs + last % bs)
    prefills = []
    rows = list(last_rows)
    for j, r in enumerate(prefill):
        if r.fork_of is not None:  # no tokens of its own: its leader's logits row
            prompt_rows.append((-1, 0))
            last_rows.append(last_rows[D + prefill.index(r.fork_of)])
            continue
        toks = r.tokens
        start, n = len(ids), len(toks) - r.n_cached
        ids.extend(toks[r.n_cached :])
        pos.extend(range(r.n_cached, len(toks)))
        seq_of.extend([D + j] * n)
        ctx = slots(r, 0, len(toks), bs)
        write.append(ctx[r.n_cached :])
        prefills.append(Prefill(start, n, r.n_cached, ctx, r.serial))
        if r.input_logprobs is None and r.logprob_start_len >= 0:
            prompt_rows.append((len(rows), n))
            rows.extend(range(start, start + n))
        else:
            prompt_rows.append((-1, n))
            rows.append(start + n - 1)
        last_rows.append(len(rows) - 1)
    seqs = [r.tokens for r in decode + prefill] if needs_tokens else []
    batch = Batch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        write_slots=torch.cat(write),
        n_decode=D,
        decode_blocks=decode_blocks,
        decode_lens=lens,
        prefills=prefills,
        decode_keys=tuple(r.serial for r in decode),
        logit_rows=torch.tensor(rows),
        token_seq=seq_of,
        seq_tokens=seqs,
        want_routes=any(r.return_routed_experts for r in decode + prefill),
        decode_lens_host=lens_host,
        prefill_plan=prefill_plan(prefills),
        cached_plan=cached_plan(prefills),
        lora=lora_groups(decode + prefill, seq_of, rows),
    )
    return batch, last_rows, prompt_rows
