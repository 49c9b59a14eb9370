"""Persistent per-request KV rows for decode attention.

Why: attention over the paged pool needs every block of every decoding sequence
gathered into one contiguous tensor, every layer, every step — at 32 sequences of
~100 tokens that is tens of MB of copies per step. So each running request keeps a
*row* of its own, [kv, cap, hd] per layer, extended by one token per step (the pool
still receives every token: it stays the truth for prefix reuse and preemption).

The rows persist across changes of the decoding set: a request that joins gets a
free row filled from the pool (its own blocks only), one that finishes frees its
row, and the rows in use are kept packed into [0, D) by moving (refilling) at most
one row per departed request, so attention always reads the in-place view
`k[:D, :, :L]` — no rebuild of the whole view when anyone joins or leaves, which in
real traffic (requests finishing at different lengths) is nearly every step.
Growth (more rows, or a longer context than `cap`) copies the storage once, doubling.

The assignment is host bookkeeping: `plan` runs on the host before the step's batch moves to the
device (`NativeModel.prepare`), so the forward gets its row indices as tensors already there and
never reads one back. CUDA graphs (`engine.graphs`) read the storage in place; `generation`
names each allocation so a graph captured over an older one is never replayed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

_STORAGES = itertools.count(1)  # numbers every storage of every DecodeRows: a number is never seen twice


@dataclass
class DecodePlan:
    """One step's decode rows, decided on the host (`DecodeRows.plan`); its tensors move with the batch."""

    rows: torch.Tensor  # [D] row of each decoding sequence (batch order)
    rows_list: list[int]  # the same, as ints (commit, CUDA-graph padding)
    inv: torch.Tensor | None  # [D] batch index of each row; None when row i is sequence i
    row_lens: torch.Tensor  # [D] context length of each row (row order), its new token included
    fill_i: torch.Tensor  # [F] batch indices whose rows are gathered from the pool this step
    fill_r: torch.Tensor  # [F] their rows
    fill_len: int  # the longest context among them (0: nothing to gather)
    L: int  # the longest context this step


class DecodeRows:
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, dtype: torch.dtype, device=None):
        self.n_layers, self.n_kv, self.head_dim, self.dtype = n_layers, n_kv, head_dim, dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.row_of: dict[int, int] = {}  # request serial -> its row
        self.lens: list[int] = []  # per row: tokens written
        self.generation = 0  # a new number whenever the storage is (re)allocated: a CUDA graph reads it in place

    @property
    def rows(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def cap(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def reserve(self, D: int, L: int) -> None:
        """Make room for D rows of L tokens, copying what is stored when it must grow."""
        if D <= self.rows and L <= self.cap:
            return
        R = max(D, 2 * self.rows) if D > self.rows else self.rows
        cap = L + max(L, 64) if L > self.cap else self.cap
        # Zeros, not empty: a shorter row's masked tail is still multiplied (by a zero weight), and
        # uninitialised memory may hold NaN.
        shape = (R, self.n_kv, cap, self.head_dim)
        old_k, old_v, r0, c0 = self.k, self.v, self.rows, self.cap
        # Always inference tensors, whether the host plan (`NativeModel.prepare`) or a forward grows them:
        # `torch.compile` guards on the kind, and a mix would recompile the decode step (`compiled_step`).
        with torch.inference_mode():
            self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
            self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
            for new, old in zip(self.k + self.v, old_k + old_v):
                new[:r0, :, :c0] = old
        self.lens += [0] * (R - r0)
        self.generation = next(_STORAGES)

    def assign(self, keys: tuple[int, ...], lens: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
        """`assign_rows` with the rows as a tensor."""
        rows, fill_i, fill_r = self.assign_rows(keys, lens)
        return torch.tensor(rows), fill_i, fill_r

    def assign_rows(
        self, keys: tuple[int, ...], lens: list[int], adds: list[int] | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """Rows for this step's sequences (batch order), all in [0, D).

        Returns (row of each sequence, batch indices to fill from the pool, their rows). A sequence
        keeps its row when it is in [0, D) and its length follows on from the last step (by its `adds`
        tokens this step: 1 for a decoding one, the default); any other (new, moved, or not following
        on) is filled from the pool this step.
        """
        D = len(keys)
        self.reserve(D, max(lens))
        adds = adds or [1] * D
        keep = {}
        for i, key in enumerate(keys):
            r = self.row_of.get(key)
            if r is not None and r < D and self.lens[r] + adds[i] == lens[i]:
                keep[i] = r
        taken = set(keep.values())
        free = iter(r for r in range(D) if r not in taken)
        rows, fill_i, fill_r = [], [], []
        for i in range(D):
            r = keep.get(i)
            if r is None:
                r = next(free)
                fill_i.append(i)
                fill_r.append(r)
            rows.append(r)
        self.row_of = {key: rows[i] for i, key in enumerate(keys)}
        return rows, fill_i, fill_r

    def plan(self, keys: tuple[int, ...], lens: list[int], adds: list[int] | None = None) -> DecodePlan:
        """`assign_rows`, and the index tensors attention needs (host tensors: `device.batch_to` moves them)."""
        rows_list, fill_i, fill_r = self.assign_rows(keys, lens, adds)
        D = len(rows_list)
        inv = None
        row_lens = torch.tensor(lens)
        if rows_list != list(range(D)):
            order = sorted(range(D), key=rows_list.__getitem__)
            inv, row_lens = torch.tensor(order), torch.tensor([lens[i] for i in order])
        fill_len = max((lens[i] for i in fill_i), default=0)
        return DecodePlan(
            torch.tensor(rows_list),
            rows_list,
            inv,
            row_lens,
            torch.tensor(fill_i, dtype=torch.long),
            torch.tensor(fill_r, dtype=torch.long),
            fill_len,
            max(lens),
        )

    def commit(self, rows: list[int] | torch.Tensor, lens: list[int]) -> None:
        """Record the lengths written this step (only after the forward completed)."""
        for r, n in zip(rows.tolist() if isinstance(rows, torch.Tensor) else rows, lens):
            self.lens[r] = n
