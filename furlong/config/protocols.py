"""The typed signatures of furlong's plug points, and of the objects some of them build.

`registry.py` maps each config key to one of these Protocols and checks a loaded function
against it (see its docstring for what "fits" means). They live apart so the registry's
table and loader stay readable, and so a plug-point author can read every signature in one
place. Annotations are strings so importing this module never imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from furlong.config.schema import AlgoConfig
    from furlong.core.sample import Sample

# Types of the floors above config, named in the Protocols' annotations but never imported, not even
# for type checkers: config sits below data, rollout and train (DESIGN §4). Annotations are postponed
# (the __future__ import), so they stay the strings written here and are rendered as such in the docs
# (`_render`); `noqa: F821` marks each such name. Where each lives:
#   Prompt, PromptSource   furlong.data                 Group           furlong.rollout.buffer
#   RolloutContext         furlong.rollout.generate     TrainBatch      furlong.train.batch
#   Correction             furlong.train.losses.corrections


# ---------------------------------------------------------------- objects some plug points build
class Buffer(Protocol):
    """Groups in flight or finished, in the order their prompts were taken (see `rollout/buffer.py`)."""

    capacity: int

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Group: ...  # noqa: F821
    def __iter__(self) -> Iterator[Group]: ...  # noqa: F821
    def push(self, group: Group) -> None: ...  # noqa: F821
    def popleft(self) -> Group: ...  # noqa: F821
    def claim(self, n: int) -> None: ...  # the consumer waits for the next n groups: they stop counting
    async def wait_for_space(self) -> None: ...
    def state_dict(self) -> list[dict[str, Any]]: ...
    def load_state_dict(self, state: list[dict[str, Any]]) -> None: ...


class Environment(Protocol):
    """An agentic environment: observations after each model turn, then a reward."""

    async def reset(self, sample: Sample) -> list[dict[str, Any]]: ...  # extra messages to start from
    async def step(self, sample: Sample, action: str) -> tuple[list[dict[str, Any]], bool]: ...  # (messages, done)
    async def reward(self, sample: Sample) -> float | dict[str, float]: ...


class Sandbox(Protocol):
    """Runs untrusted code away from the trainer and engine processes, with limits."""

    async def run(self, code: str, *, timeout_s: float) -> dict[str, Any]: ...  # stdout, stderr, exit_code, ...
    async def close(self) -> None: ...


class LoggingSink(Protocol):
    """Receives every step's metrics (console, JSONL, TensorBoard, W&B, MLflow are sinks too)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


BUILT_OBJECTS = (Buffer, Environment, Sandbox, LoggingSink)


# ---------------------------------------------------------------- the plug points' signatures
class RolloutFn(Protocol):
    async def __call__(
        self,
        ctx: RolloutContext,  # noqa: F821
        data_source: PromptSource,  # noqa: F821
        step: int,
    ) -> list[list[Sample]]: ...


class GenerateFn(Protocol):
    async def __call__(
        self,
        ctx: RolloutContext,  # noqa: F821
        sample: Sample,
        sampling_params: dict[str, Any],
    ) -> Sample: ...


class AgentFn(Protocol):
    async def __call__(self, sample: Sample, base_url: str) -> float | dict[str, float] | None: ...


class RewardFn(Protocol):
    async def __call__(self, sample: Sample) -> float | dict[str, float]: ...


class GroupRewardFn(Protocol):
    async def __call__(self, samples: list[Sample]) -> list[float | dict[str, float]]: ...


class RewardPostFn(Protocol):
    def __call__(self, samples: list[Sample]) -> list[float]: ...


class DynamicFilterFn(Protocol):
    async def __call__(self, samples: list[Sample]) -> str | bool | None: ...


class SampleFilterFn(Protocol):
    async def __call__(self, sample: Sample) -> str | bool | None: ...


class DataSourceFactory(Protocol):
    def __call__(self) -> PromptSource: ...  # noqa: F821


class BufferFactory(Protocol):
    def __call__(self, capacity: int) -> Buffer: ...


class EvalFn(Protocol):
    async def __call__(
        self,
        ctx: RolloutContext,  # noqa: F821
        prompts: list[tuple[Prompt, list[int]]],  # noqa: F821
    ) -> dict[str, float]: ...


class LossFn(Protocol):
    def __call__(
        self, algo: AlgoConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, float]]: ...


class AdvantageFn(Protocol):
    def __call__(
        self,
        algo: AlgoConfig,
        rewards: Tensor,
        group_index: Tensor,
        mask: Tensor,
        values: Tensor | None,
        kl: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]: ...


class CorrectionFn(Protocol):
    def __call__(self, algo: AlgoConfig, tensors: Mapping[str, Tensor]) -> Correction: ...  # noqa: F821


class ReducerFn(Protocol):
    def __call__(
        self,
        values: Tensor,
        mask: Tensor,
        *,
        constant: float | None,
        total_tokens: float | None,
        total_samples: float | None,
    ) -> Tensor: ...


class ConvertFn(Protocol):
    def __call__(self, samples: list[Sample]) -> TrainBatch: ...  # noqa: F821


class BeforeTrainStepFn(Protocol):
    def __call__(self, step: int, batch: TrainBatch) -> None: ...  # noqa: F821


class AfterSaveFn(Protocol):
    def __call__(self, step: int, path: str) -> None: ...


class ToolFn(Protocol):
    async def __call__(self, name: str, arguments: dict[str, Any]) -> str: ...


class EnvironmentFactory(Protocol):
    def __call__(self) -> Environment: ...


class SandboxFactory(Protocol):
    def __call__(self) -> Sandbox: ...


class SinkFactory(Protocol):
    def __call__(self) -> LoggingSink: ...
