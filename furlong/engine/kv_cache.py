"""Paged KV-cache bookkeeping with automatic prefix reuse.

The pool is `num_blocks` blocks of `block_size` token slots (the tensors live in
the model; this class only hands out block ids). Why paged: sequences of very
different lengths share one memory budget without reserving the maximum
context per sequence, and a preempted sequence frees exactly what it held.

Prefix reuse: a *full* block is named by a hash chained over every token
before it, so two requests whose token prefixes agree map to the same blocks.
When a request finishes its full blocks stay cached (evictable, LRU) instead
of being freed, so the next turn of an agent session — whose prompt is the
previous prompt + response + new text — skips recomputing them.

Its partial *tail* block is kept too (`keep_tail`), named by the hash of the full
blocks before it and the tokens it holds, and handed over whole to the next request
that continues those exact tokens (`match`): without it every turn recomputes up to
`block_size - 1` tokens it already has, which in an agent episode of short turns
(`benchmarks/async_speedup.py --env-latency`: ~13 tokens a turn, 4 tool tokens
between) is most of each turn's prefill. A tail is adopted, never shared: the
adopter writes its next tokens into that block, so the cache forgets it at once.

A weight update forgets every cached prefix: its KV was computed by the old weights. An update
in place (`engine.pause_mode=in_place`, whose requests in flight already go on over KV of the old
weights) keeps the prefixes of the epoch that ends for one epoch more (`flush(carry=True)`), so an
agent episode's next turn reuses its context instead of recomputing it on every sync; each named
block carries the oldest epoch its KV (its chain included) comes from, so cached KV is never more
than one update behind.

`prefix_cache=False` (`engine.prefix_cache`, `--no-prefix-cache`) turns reuse off: no
block is ever named, so every prompt is computed in full — for measuring cold-prefill
cost, or when cached KV must never be shared between requests.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple


class Match(NamedTuple):
    """What `BlockPool.match` found: referenced blocks, their chain hashes, the tokens their KV covers,
    and the oldest cache epoch that KV comes from (the pool's current one when nothing matched)."""

    blocks: list[int]
    hashes: list[int]
    n: int
    epoch: int


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if num_blocks < 1:
            raise ValueError("--kv-cache-mb: budget too small for one KV block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but holding a cached prefix
        self.hash_of: dict[int, int] = {}
        self.by_hash: dict[int, int] = {}
        # kept tails by (parent chain hash, tokens they hold): several may follow one parent (a GRPO group's
        # samples after one shared prompt block); and the way back from a block
        self.tails: dict[tuple[int, tuple[int, ...]], int] = {}
        self.tail_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.hit_tokens = 0  # prompt tokens served from the prefix cache (for /metrics)
        self.epoch = 0  # bumped by flush()
        self.keep_from = 0  # the oldest epoch whose KV may be named (served to another request)
        self.named_epoch: dict[int, int] = {}  # a named block -> the oldest epoch its KV comes from

    @property
    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    def alloc(self) -> int | None:
        if self.free:
            b = self.free.popleft()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self._forget(b)
        else:
            return None
        self.ref[b] = 1
        return b

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of or b in self.tail_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def share(self, blocks: list[int]) -> None:
        """Take one more reference on live blocks: a forked sample reads its leader's full prompt blocks.

        Why this is safe without copy-on-write machinery: a *full* block is never written again
        (new tokens go to the tail block), so sharers only ever read it; the partial tail block is
        the one a fork copies (`Engine._fork`)."""
        for b in blocks:
            if self.ref[b] == 0:
                self.evictable.pop(b, None)
            self.ref[b] += 1

    @staticmethod
    def chain(parent: int, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))

    def _forget(self, b: int) -> None:
        """Un-name block `b` (a cached full block or a kept tail): it is about to be reused."""
        self.named_epoch.pop(b, None)
        if b in self.hash_of:
            self.by_hash.pop(self.hash_of.pop(b), None)
        elif b in self.tail_of:
            del self.tails[self.tail_of.pop(b)]

    def may_name(self, epoch: int) -> bool:
        """Whether KV of `epoch` (a request's oldest) may still be named for others to reuse."""
        return epoch >= self.keep_from

    def match(self, tokens: list[int]) -> Match:
        """Take references on the cached blocks that cover a prefix of `tokens`.

        Only prefixes of `tokens[:-1]` are matched: the last token must be
        computed to produce the next-token logits. Returns (blocks, hashes, tokens
        cached): the full blocks, then a kept tail block when one continues them with
        tokens that `tokens` has next (adopted: it leaves the cache). Nothing with the
        prefix cache off.
        """
        if not self.prefix_cache:
            return Match([], [], 0, self.epoch)
        bs, blocks, hashes, h, oldest = self.block_size, [], [], 0, self.epoch
        for i in range((len(tokens) - 1) // bs):
            h = self.chain(h, tokens[i * bs : (i + 1) * bs])
            b = self.by_hash.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                self.evictable.pop(b, None)
            self.ref[b] += 1
            blocks.append(b)
            hashes.append(h)
            oldest = min(oldest, self.named_epoch.get(b, oldest))
        n, parent = len(blocks) * bs, hashes[-1] if hashes else 0
        # the longest kept tail after these blocks that `tokens` continues (one lookup per length, longest first)
        tails = (tuple(tokens[n : n + k]) for k in range(min(bs - 1, len(tokens) - 1 - n), 0, -1))
        tail = next((t for t in tails if (parent, t) in self.tails), None) if self.tails else None
        if tail is not None:
            b = self.tails[(parent, tail)]
            oldest = min(oldest, self.named_epoch.get(b, oldest))
            self._forget(b)
            self.evictable.pop(b, None)
            self.ref[b] = 1
            blocks.append(b)
            n += len(tail)
        self.hit_tokens += n
        return Match(blocks, hashes, n, oldest)

    def keep_tail(
        self, blocks: list[int], hashes: list[int], tokens: list[int], n_cached: int, epoch: int | None = None
    ) -> None:
        """Before `blocks` are released: keep the partial tail block, whose first `n_cached % block_size`
        slots hold the KV of those tokens, for the next request that continues them (`match`).

        Only a tail whose full blocks are all named (`hashes`: same cache epoch) and that nobody else holds; one
        holding the same tokens after the same full blocks as an older one replaces it (the older is freed)."""
        bs = self.block_size
        full, n = divmod(n_cached, bs)
        if not self.prefix_cache or not n or len(hashes) != full or len(blocks) <= full:
            return
        b, parent, held = blocks[full], hashes[-1] if hashes else 0, tuple(tokens[full * bs : n_cached])
        if self.ref[b] != 1 or b in self.hash_of or b in self.tail_of:
            return
        old = self.tails.get((parent, held))
        if old is not None:  # unreferenced, since a kept tail is adopted, never shared
            self._forget(old)
            self.evictable.pop(old, None)
            self.free.append(old)
        self.tails[(parent, held)] = b
        self.tail_of[b] = (parent, held)
        self.named_epoch[b] = self.epoch if epoch is None else epoch

    def register(
        self, blocks: list[int], hashes: list[int], tokens: list[int], n_cached: int, epoch: int | None = None
    ) -> None:
        """Name every block that became full (all its KV written); extends `hashes` in place. `epoch`: the
        oldest epoch of the writer's KV (None: this one).

        With the prefix cache off no block is named, so a finished request's blocks go
        straight back to the free list instead of lingering as evictable.
        """
        if not self.prefix_cache:
            return
        bs = self.block_size
        for i in range(len(hashes), min(n_cached // bs, len(blocks))):
            h = self.chain(hashes[-1] if hashes else 0, tokens[i * bs : (i + 1) * bs])
            hashes.append(h)
            b = blocks[i]
            if h not in self.by_hash and b not in self.hash_of:
                self.by_hash[h] = b
                self.hash_of[b] = h
                self.named_epoch[b] = self.epoch if epoch is None else epoch

    def flush(self, carry: bool = False) -> None:
        """Forget the cached prefixes (after a weight update their KV is stale) and start a new epoch.

        `carry`: keep those of the epoch that ends for one epoch more (an update in place); those
        carried already go. Blocks still in use lose their names and are freed on release."""
        self.epoch += 1
        self.keep_from = self.epoch - 1 if carry else self.epoch
        for b in [b for b, e in self.named_epoch.items() if e < self.keep_from]:
            self._forget(b)
            if b in self.evictable:
                del self.evictable[b]
                self.free.append(b)
