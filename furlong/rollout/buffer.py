"""The group buffer: prompts in flight or finished, in the order they were taken, bounded.

Every prompt the manager takes from the data source becomes a `Group` (its
`n_samples_per_prompt` samples) and enters this buffer; it leaves only when the
consumer trains it or drops it with a reason. Keeping the groups in the order the
prompts were taken — not the order they finish — is what makes the batches a pure
function of (prompts, seeds, weight versions): fully async with `max_staleness=0`
then trains exactly the samples sync would, however the requests interleave.

The bound is the back-pressure of fully async mode: the producer waits for space,
so generation never runs further ahead than `capacity` groups beyond those the consumer
has claimed. A claim (`claim(n)`: the trainer is waiting for the next `n` groups of its
batch) takes those groups out of the count, because they are about to leave: without it
a batch's slowest episode, at the head of the queue, would hold every finished group
behind it in the count and keep the engines idle through that batch's tail, though the
next window's groups would be exactly as fresh if they started at once. The buffer's
`state_dict()` holds every group's samples as they stand, partial responses
included, so a resumed run continues them instead of starting over.
"""

from __future__ import annotations

import asyncio
import copy
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from furlong.core.sample import Sample, Status

TERMINAL = (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)


@dataclass
class Group:
    """One prompt's samples. `seq` is its place in the order prompts were taken."""

    seq: int
    prompt_index: int
    samples: list[Sample]
    regenerations: int = 0  # times stale samples of this group were generated again
    task: asyncio.Task | None = field(default=None, repr=False, compare=False)

    def oldest_version(self) -> int | None:
        """The weight version of the group's oldest policy token (None before any token)."""
        versions = [v for v in (s.oldest_version() for s in self.samples) if v is not None]
        return min(versions) if versions else None

    @property
    def finished(self) -> bool:
        return all(Status(s.status) in TERMINAL for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "prompt_index": self.prompt_index,
            "regenerations": self.regenerations,
            "samples": [s.to_dict() for s in self.samples],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        return cls(
            seq=int(d["seq"]),
            prompt_index=int(d["prompt_index"]),
            regenerations=int(d.get("regenerations", 0)),
            samples=[Sample.from_dict(copy.deepcopy(s)) for s in d["samples"]],  # never alias the caller's state
        )


class GroupBuffer:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"GroupBuffer: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.claimed = 0  # groups at the head the consumer is waiting for: they do not count against capacity
        self._groups: deque[Group] = deque()
        self._space = asyncio.Event()
        self._space.set()

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(self._groups)

    def __getitem__(self, i: int) -> Group:
        return self._groups[i]

    @property
    def free(self) -> int:
        return self.capacity + self.claimed - len(self._groups)

    def claim(self, n: int) -> None:
        """The consumer waits for the next `n` groups (0: it waits for none): they stop counting against
        capacity, so the producer may start up to `n` more."""
        if n < 0:
            raise ValueError(f"GroupBuffer.claim: n must be >= 0, got {n}")
        self.claimed = n
        if self.free > 0:
            self._space.set()

    async def wait_for_space(self) -> None:
        """Back-pressure: return once fewer than `capacity` unclaimed groups are held."""
        while self.free <= 0:
            self._space.clear()
            await self._space.wait()

    def push(self, group: Group) -> None:
        if self.free <= 0:
            raise RuntimeError(f"GroupBuffer: full ({self.capacity} groups, {self.claimed} claimed)")
        if self._groups and group.seq <= self._groups[-1].seq:
            raise RuntimeError(f"GroupBuffer: group seq {group.seq} after {self._groups[-1].seq}")
        self._groups.append(group)

    def popleft(self) -> Group:
        group = self._groups.popleft()
        self._space.set()
        return group

    def state_dict(self) -> list[dict[str, Any]]:
        return [g.to_dict() for g in self._groups]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        if len(state) > self.capacity:
            raise ValueError(f"GroupBuffer.load_state_dict: {len(state)} groups exceed capacity {self.capacity}")
        self._groups = deque()
        for d in state:
            self.push(Group.from_dict(d))
