"""DataSource: hands out prompts in seeded-shuffled epochs, with a cursor that resumes exactly.

The rollout manager asks for `next_batch(n)`. Epoch e visits every prompt once in
the order of a permutation seeded by `(seed, e)`, so the order is a pure function
of the seed: nothing needs saving but the epoch and the position within it. A
batch that crosses an epoch boundary takes the last items of one epoch and the
first of the next.

Prompts a rollout could not use (an aborted partial rollout, a group dropped for
staleness, a shutdown mid-step) come back through `push_back(prompts)` and are
handed out again, first in first out, before the cursor moves on. They are part
of the checkpoint, so a restart neither loses nor repeats them.

`state_dict()` is plain JSON (epoch, position, seed, the pushed-back prompt indices
and counters); `load_state_dict()` on a fresh DataSource over the same dataset, in
any process, continues with exactly the prompts the uninterrupted source would
have given. Loading a state made for a dataset of another size, seed or shuffle
setting is refused.

`PromptSource` is the protocol a custom data source (the `data source` plug point)
must follow; `DataSource` is the built-in one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from furlong.data.datasets import Prompt

STATE_VERSION = 1


@runtime_checkable
class PromptSource(Protocol):
    """What the rollout manager needs from a data source."""

    def next_batch(self, n: int) -> list[Prompt]: ...

    def push_back(self, prompts: Sequence[Prompt]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DataSource:
    """Seeded epochs over a dataset of prompts, with push-back and exact resume.

    `num_epochs=None` cycles forever; otherwise `next_batch` returns fewer than `n`
    prompts (finally none) once the last epoch is spent, and `exhausted` turns true.
    """

    def __init__(
        self, dataset: Sequence[Prompt], *, seed: int = 0, shuffle: bool = True, num_epochs: int | None = None
    ):
        if len(dataset) == 0:
            raise ValueError("DataSource: the dataset is empty")
        if seed < 0:
            raise ValueError(f"DataSource: seed must be >= 0, got {seed}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"DataSource: num_epochs must be >= 1 or None, got {num_epochs}")
        for i, p in enumerate(dataset):
            if p.index != i:
                raise ValueError(
                    f"DataSource: prompt at position {i} has index {p.index}; indices must be 0..n-1 in order"
                )
        self.dataset = dataset
        self.seed = int(seed)
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.epoch = 0
        self.position = 0
        self.consumed = 0  # prompts handed out, pushed-back ones counted each time
        self.returned = 0  # prompts pushed back
        self._pending: deque[int] = deque()
        self._order = self._permutation(0)

    # ---- reading ---------------------------------------------------------
    @property
    def exhausted(self) -> bool:
        return not self._pending and self.num_epochs is not None and self.epoch >= self.num_epochs

    def next_batch(self, n: int) -> list[Prompt]:
        """The next `n` prompts: pushed-back ones first, then the cursor's."""
        if n < 0:
            raise ValueError(f"next_batch: n must be >= 0, got {n}")
        out: list[Prompt] = []
        while len(out) < n and self._pending:
            out.append(self.dataset[self._pending.popleft()])
        while len(out) < n and not self.exhausted:
            out.append(self.dataset[int(self._order[self.position])])
            self.position += 1
            if self.position == len(self.dataset):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        self.consumed += len(out)
        return out

    def push_back(self, prompts: Sequence[Prompt]) -> None:
        """Return prompts that were handed out but not used; they come out next, in this order."""
        indices = []
        for p in prompts:
            if not 0 <= p.index < len(self.dataset) or self.dataset[p.index].prompt != p.prompt:
                raise ValueError(f"push_back: prompt with index {p.index} did not come from this source")
            indices.append(p.index)
        self._pending.extend(indices)
        self.returned += len(indices)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    # ---- checkpointing ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
            "epoch": self.epoch,
            "position": self.position,
            "pending": list(self._pending),
            "consumed": self.consumed,
            "returned": self.returned,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {
            "version": STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
        }
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(
                    f"DataSource.load_state_dict: state has {key}={state.get(key)!r}, this source has {value!r}"
                )
        n = len(self.dataset)
        if not 0 <= state["position"] < n or state["epoch"] < 0:
            raise ValueError(
                f"DataSource.load_state_dict: epoch={state['epoch']}, position={state['position']} out of range"
            )
        bad = [i for i in state["pending"] if not 0 <= i < n]
        if bad:
            raise ValueError(f"DataSource.load_state_dict: pending index {bad[0]} out of range for {n} prompts")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._pending = deque(int(i) for i in state["pending"])
        self.consumed, self.returned = int(state["consumed"]), int(state["returned"])
        self._order = self._permutation(self.epoch)
