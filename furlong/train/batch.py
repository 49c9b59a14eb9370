"""Samples → tensors: padded per-sample views for the loss hub, packed rows for the model.

Two layouts, because the two consumers want different things:

* The loss hub sees every per-token quantity as a padded `[B, T]` tensor over
  *response* positions (T = longest response), which keeps its maths readable.
* The model sees a micro-batch as **one packed row**: the samples' token ids
  concatenated, `position_ids` restarting at 0 for each sample and no attention
  mask. transformers turns restarting position ids into a block-diagonal causal
  mask (`find_packed_sequence_indices`), so each sample attends only to itself
  and the logits equal an unpadded forward of every sample alone. Packing wastes
  no compute on padding, and because a micro-batch is one row its size is simply
  its token count — the `micro_batch_tokens` budget.

`Packed.flat_index` lists the row positions whose logits predict a response
token (position p predicts token p+1), so only those logits are computed
(`logits_to_keep`) and scattered back into `[B, T]` at (`rows`, `cols`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from furlong.core.sample import Sample, SampleError

# Per-token [B, T] fields of a TrainBatch that `select` slices alongside the samples.
_TOKEN_FIELDS = (
    "mask",
    "rollout_logprobs",
    "teacher_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "old_values",
    "advantages",
    "returns",
)


@dataclass
class TrainBatch:
    """A global batch: the samples plus their padded `[B, T]` per-token tensors.

    `old_logprobs`, `ref_logprobs`, `old_values`, `advantages` and `returns`
    start empty and are filled by `Trainer.prepare`.
    """

    samples: list[Sample]
    mask: torch.Tensor  # [B, T] float, 1 = trained response token
    rollout_logprobs: torch.Tensor  # [B, T]
    rewards: torch.Tensor | None  # [B]; None when any sample has no reward (SFT)
    group_index: torch.Tensor  # [B] long
    teacher_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def seq_lengths(self) -> list[int]:
        return [len(s.tokens) for s in self.samples]

    @classmethod
    def from_samples(cls, samples: list[Sample]) -> TrainBatch:
        """Validate every sample and pad its per-token lists to `[B, T]`."""
        if not samples:
            raise SampleError("train batch: no samples")
        for s in samples:
            s.validate()
            if s.response_length == 0:
                raise SampleError(f"sample {s.index}: response_length=0; nothing to train on")
            if s.prompt_length == 0:
                raise SampleError(f"sample {s.index}: empty prompt; the first response token has no context")
        T = max(s.response_length for s in samples)
        with_teacher = [s.teacher_logprobs is not None for s in samples]
        if any(with_teacher) and not all(with_teacher):
            missing = next(s.index for s, w in zip(samples, with_teacher) if not w)
            raise SampleError(f"sample {missing}: teacher_logprobs missing while other samples in the batch have them")
        rewards = None
        if all(s.reward is not None for s in samples):
            rewards = torch.tensor([s.scalar_reward for s in samples], dtype=torch.float32)
        return cls(
            samples=list(samples),
            mask=_pad([s.loss_mask for s in samples], T),
            rollout_logprobs=_pad([s.rollout_logprobs for s in samples], T),
            rewards=rewards,
            group_index=torch.tensor([s.group_index for s in samples], dtype=torch.long),
            teacher_logprobs=_pad([s.teacher_logprobs for s in samples], T) if all(with_teacher) else None,
        )

    def select(self, indices: list[int]) -> TrainBatch:
        """The sub-batch of `indices`, its T trimmed to its own longest response."""
        samples = [self.samples[i] for i in indices]
        T = max((s.response_length for s in samples), default=0)
        idx = torch.tensor(indices, dtype=torch.long)
        changes: dict = {"samples": samples, "group_index": self.group_index[idx]}
        changes["rewards"] = None if self.rewards is None else self.rewards[idx]
        for name in _TOKEN_FIELDS:
            value = getattr(self, name)
            changes[name] = None if value is None else value[idx, :T]
        return replace(self, **changes)

    def loss_tensors(self) -> dict[str, torch.Tensor]:
        """The filled per-token fields, named as the loss hub expects."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _TOKEN_FIELDS and value is not None:
                out[f.name] = value
        return out


def _pad(rows: list[list[float]], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


@dataclass
class Packed:
    """One micro-batch as a single packed row plus the map back to `[B, T]`."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    flat_index: torch.Tensor  # [N] row positions whose logits predict a response token
    targets: torch.Tensor  # [N] the response token each of those positions predicts
    rows: torch.Tensor  # [N] sample index within the micro-batch
    cols: torch.Tensor  # [N] response position within the sample
    shape: tuple[int, int]  # (B, T) of the padded per-token view

    def to(self, device: torch.device | str) -> Packed:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "shape"})

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """Place per-position values `[N]` into a zero-padded `[B, T]` tensor (keeps autograd)."""
        out = flat.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), flat)


def pack(samples: list[Sample]) -> Packed:
    """Concatenate samples into one row with per-sample restarting position ids."""
    ids, pos, flat, targets, rows, cols = [], [], [], [], [], []
    offset = 0
    for i, s in enumerate(samples):
        n, p, r = len(s.tokens), s.prompt_length, s.response_length
        ids.extend(s.tokens)
        pos.extend(range(n))
        flat.extend(range(offset + p - 1, offset + n - 1))
        targets.extend(s.tokens[p:])
        rows.extend([i] * r)
        cols.extend(range(r))
        offset += n
    T = max(s.response_length for s in samples)
    long = lambda x: torch.tensor(x, dtype=torch.long)
    return Packed(long([ids]), long([pos]), long(flat), long(targets), long(rows), long(cols), (len(samples), T))


def partition(lengths: list[int], bins: int) -> list[list[int]]:
    """Longest-processing-time split of items into `bins` lists of near-equal total length.

    Deterministic (ties broken by index) so every rank computes every rank's split
    without talking. Each returned list is sorted, keeping sample order stable.
    """
    loads = [0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(bins), key=lambda b: (loads[b], b))
        out[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in out]


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Split items into the fewest balanced micro-batches whose token totals fit `budget`.

    A single sequence longer than the budget gets a micro-batch of its own (it
    cannot be split without changing the maths), so the budget is a target, not a
    hard cap, for such outliers.
    """
    if budget <= 0:
        raise ValueError(f"train.micro_batch_tokens must be > 0, got {budget}")
    if not lengths:
        return []
    k = max(1, -(-sum(lengths) // budget))
    while k < len(lengths):
        split = partition(lengths, k)
        if all(sum(lengths[i] for i in b) <= budget or len(b) == 1 for b in split):
            return split
        k += 1
    return [[i] for i in range(len(lengths))]
