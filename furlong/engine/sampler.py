"""Sampling parameters and the batched sampler.

Reported log-probs are the *raw* model distribution (log-softmax of the
logits, before temperature / top-k / top-p), the quantity the trainer
recomputes; the sampling transforms only decide which token is drawn.

Reproducibility: each request owns a `torch.Generator` (seeded from its
`seed`) and draws with the exponential race — argmax(p / E), E ~ Exp(1) — from
its own noise, so a seeded request gives the same tokens whatever else is in
the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else random.getrandbits(63))
        return g


def sample(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
) -> tuple[list[int], torch.Tensor]:
    """Draw one token per row; returns (token ids, raw log-probs [B, V])."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows)
        sub = logits[idx] / torch.tensor([params[i].temperature for i in rows])[:, None]
        top_k = [params[i].top_k for i in rows]
        if any(k > 0 for k in top_k):
            V = sub.shape[-1]
            ks = torch.tensor([min(k, V) if k > 0 else V for k in top_k])
            kth = sub.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
            sub = sub.masked_fill(sub < kth, float("-inf"))
        probs = torch.softmax(sub, dim=-1)
        top_p = torch.tensor([params[i].top_p for i in rows])
        if (top_p < 1).any():
            sp, si = probs.sort(dim=-1, descending=True)
            drop = (sp.cumsum(-1) - sp) > top_p[:, None]  # keep the smallest set reaching top_p
            probs = probs.masked_fill(torch.zeros_like(drop).scatter(1, si, drop), 0.0)
        min_p = torch.tensor([params[i].min_p for i in rows])
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
        noise = torch.stack([torch.empty(probs.shape[-1]).exponential_(generator=gens[i]) for i in rows])
        tokens[idx] = (probs / noise).argmax(dim=-1)
    return tokens.tolist(), logprobs
