"""WeightVersion: the one owner of "which weight version do the engines serve".

Every generated token is stamped with the version of the weights that produced it
(DESIGN §2), and three parts of the driver need that number: the rollout manager
(staleness is `current - oldest token version`), the engine supervisor (a replaced
engine is re-synced *at* the current version) and the run's checkpoint. Each used to
keep its own counter, and they agreed only because version == step. Now the driver
makes one `WeightVersion`, hands the same object down, and the others ask it.

Who moves it: the weight sync that made the engines serve new weights (the
supervisor, the moment the trainer's push succeeded), and a resume (`restore`).
Versions only go forward, except on restore: a version older than the current one
is a bug, and is refused loudly instead of silently un-staling old samples.
"""

from __future__ import annotations


class WeightVersion:
    """A monotonic weight-version counter shared by reference (see the module docstring)."""

    __slots__ = ("_current",)

    def __init__(self, current: int = 0):
        self._current = int(current)

    @property
    def current(self) -> int:
        return self._current

    def advance(self, version: int) -> None:
        """The engines now serve `version` (equal to the current one is a no-op; older is refused)."""
        if version < self._current:
            raise ValueError(f"weight version {version} is older than the current {self._current}")
        self._current = int(version)

    def restore(self, version: int) -> None:
        """Set the version from a checkpoint (a resume may go back to an older one)."""
        self._current = int(version)

    def __int__(self) -> int:
        return self._current

    def __repr__(self) -> str:
        return f"WeightVersion({self._current})"
