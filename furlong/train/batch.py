"""Samples → tensors: padded per-sample views for the loss hub, padded blocks for the model.

Two layouts, because the two consumers want different things:

* The loss hub sees every per-token quantity as a padded `[B, T]` tensor over
  *response* positions (T = longest response), which keeps its maths readable.
* The model sees a micro-batch as a **right-padded `[B, L]` block** of whole
  sequences (`pack`), built from length-sorted samples so the padding is small
  (`micro_batches`). Right padding needs no attention mask (see `Packed`), so
  attention is plain causal SDPA over each row. The earlier layout, one packed row
  with restarting position ids, made transformers build a dense block-diagonal
  `[ΣL, ΣL]` mask: attention over the whole micro-batch's tokens instead of each
  sample's (~12x the work at 64-token responses) and no native GQA. The
  `micro_batch_tokens` budget is the padded size, rows × L.

`Packed.flat_index` lists the positions whose logits predict a response token
(position p predicts token p+1); only the last `keep` positions' logits are
computed (`logits_to_keep`), and the per-token results are scattered back into
`[B, T]` at (`rows`, `cols`). Log-probs equal an unpadded forward of each sample
alone up to fp32 rounding (tested at 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from furlong.core.sample import Sample, SampleError
from furlong.train.routing_replay import pack_routes

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
    """One micro-batch as a right-padded `[B, L]` block plus the map back to `[B, T]`.

    Right padding needs no attention mask: under the causal mask a real token only
    attends to earlier positions, which are all real, so pads never reach a logit we
    read. The model therefore runs `is_causal` attention (no `[L, L]` mask is built,
    and SDPA keeps native GQA instead of `repeat_kv` copies).
    """

    input_ids: torch.Tensor  # [B, L], right-padded with token 0
    position_ids: torch.Tensor  # [B, L]: 0..L-1 on every row
    flat_index: torch.Tensor  # [N] positions (in the flattened [B*L] block) whose logits predict a response token
    targets: torch.Tensor  # [N] the response token each of those positions predicts
    rows: torch.Tensor  # [N] sample index within the micro-batch
    cols: torch.Tensor  # [N] response position within the sample
    shape: tuple[int, int]  # (B, T) of the padded per-token view
    keep: int = 0  # `logits_to_keep`: the last `keep` positions hold every position in `flat_index`
    routes: torch.Tensor | None = None  # [B*L, MoE layers, k] R3: recorded expert ids, -1 = none (routing_replay)

    def to(self, device: torch.device | str) -> Packed:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def kept(self, logits: torch.Tensor) -> torch.Tensor:
        """The `[N, V]` logits at `flat_index` out of the model's `[B, keep, V]` (`logits_to_keep=keep`)."""
        L = self.input_ids.shape[1]
        return logits[self.rows, self.flat_index % L - (L - self.keep)]

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """Place per-position values `[N]` into a zero-padded `[B, T]` tensor (keeps autograd)."""
        out = flat.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), flat)


def pack(samples: list[Sample]) -> Packed:
    """Lay samples out as right-padded rows of one `[B, L]` block (L = the longest sample)."""
    L = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), L, dtype=torch.long)
    flat, targets, rows, cols = [], [], [], []
    first = L  # the earliest position that predicts a response token, over all rows
    for i, s in enumerate(samples):
        n, p, r = len(s.tokens), s.prompt_length, s.response_length
        ids[i, :n] = torch.tensor(s.tokens, dtype=torch.long)
        flat.extend(range(i * L + p - 1, i * L + n - 1))
        targets.extend(s.tokens[p:])
        rows.extend([i] * r)
        cols.extend(range(r))
        first = min(first, p - 1)
    T = max(s.response_length for s in samples)
    long = lambda x: torch.tensor(x, dtype=torch.long)
    pos = torch.arange(L).expand(len(samples), L)
    return Packed(
        ids,
        pos,
        long(flat),
        long(targets),
        long(rows),
        long(cols),
        (len(samples), T),
        keep=L - first,
        routes=pack_routes(samples, L),
    )


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


def micro_batches(lengths: list[int], budget: int, count: int = 1) -> list[list[int]]:
    """Split items into micro-batches of similar lengths whose padded size (rows × longest) fits `budget`.

    Items are taken longest first and a micro-batch grows while `rows × its longest` stays
    within the budget, so each block holds near-equal lengths and padding stays small. A
    single sequence longer than the budget gets a micro-batch of its own (it cannot be split
    without changing the maths), so the budget is a target, not a hard cap, for such outliers.
    With `count`, the largest micro-batches are halved (or empty ones added) until there are
    at least `count`: every FSDP rank must run the same number. Each list is sorted.
    """
    if budget <= 0:
        raise ValueError(f"train.micro_batch_tokens must be > 0, got {budget}")
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    while len(out) < count:
        splittable = [b for b in range(len(out)) if len(out[b]) > 1]
        if not splittable:
            out.append([])  # fewer items than micro-batches: an empty (dummy) step
            continue
        big = max(splittable, key=lambda b: (len(out[b]) * lengths[out[b][0]], -b))
        half = len(out[big]) // 2
        out[big : big + 1] = [out[big][:half], out[big][half:]]
    return [sorted(b) for b in out]
