"""The environment protocol, the tool-use environment every built-in one starts from, and the lookup.

An environment (the `envs.environment` plug point builds one) is async:

    async def reset(sample) -> list[message]             # messages added before the first turn
    async def step(sample, action: str) -> (list[message], done)   # after each model turn
    async def reward(sample) -> float | dict             # once the episode ends

`action` is the model turn's decoded text (special tokens kept, so tool-call
markers are visible); the returned messages (`tool` results, `user` feedback) are
rendered through the chat template and appended with loss mask 0. Keep per-episode
state in `sample.metadata`, not on the object: a sample can be aborted at a weight
sync and resumed by a later call, or restored from a checkpoint in another process.

`ToolEnvironment` answers each turn's `<tool_call>` blocks with the tools' results and
ends the episode at the first turn without a call; its reward is the synthetic
task's rule applied to the *final* turn only, so a number that appeared in a tool
result is never mistaken for the model's answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from furlong.config.protocols import Environment  # plug points are declared once, in config/protocols.py
from furlong.core.plugins import import_path
from furlong.core.sample import Sample
from furlong.core.tool_calls import parse_tool_calls
from furlong.envs.tools import execute_all

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig

__all__ = ["Environment", "ToolEnvironment", "build_environment", "final_text"]


def final_text(sample: Sample) -> str:
    """The last model turn's text: what a reward reads as the answer."""
    return str(sample.metadata.get("response_text", ""))


class ToolEnvironment:
    """Tool use: execute the calls of each turn; done at the first turn with none."""

    def __init__(
        self,
        tools: dict[str, Callable[..., Any]] | None = None,
        *,
        timeout_s: float = 10.0,
        tool_fn: Callable[..., Any] | None = None,
    ):
        self.tools = dict(tools or {})
        self.timeout_s = timeout_s
        self.tool_fn = tool_fn

    async def reset(self, sample: Sample) -> list[dict[str, Any]]:
        return []

    async def step(self, sample: Sample, action: str) -> tuple[list[dict[str, Any]], bool]:
        _, calls, errors = parse_tool_calls(action)
        sample.metadata["tool_calls"] = sample.metadata.get("tool_calls", 0) + len(calls)
        if errors:
            sample.metadata["tool_call_errors"] = sample.metadata.get("tool_call_errors", 0) + len(errors)
        if not calls:
            return [], True
        return await execute_all(calls, self.tools, timeout_s=self.timeout_s, tool_fn=self.tool_fn), False

    async def reward(self, sample: Sample) -> float | dict[str, float]:
        from furlong.data.tasks import get_task

        task = sample.metadata.get("task")
        if task is None:
            raise ValueError("ToolEnvironment.reward: sample metadata has no 'task'; subclass and define reward()")
        return float(get_task(task).score(final_text(sample), sample.label))


BUILTIN = {
    "calculator": "furlong.envs.calculator:CalculatorEnvironment",
    "coding": "furlong.envs.coding:CodingEnvironment",
    "tools": "furlong.envs.protocol:ToolEnvironment",
}
TOOLS = {  # tools `envs.tools` may name
    "calculator": "furlong.envs.calculator:calculator",
    "python": "furlong.envs.coding:python",
}


def build_environment(envs: EnvsConfig | None, sample: Sample) -> Environment:
    """The environment for `sample`: `envs.environment` (custom), else `envs.name`, else the sample's task.

    `envs` is the `envs` config section or None (defaults). A sample whose metadata
    names a built-in (`metadata["env"]`, or a `task` that is one) gets it; any other
    sample gets a `ToolEnvironment` with the tools in `envs.tools` (none: one turn).
    """
    timeout_s = getattr(envs, "timeout_s", 10.0)
    tool_fn = getattr(envs, "tool_fn", None)
    if isinstance(tool_fn, str):
        from furlong.config.registry import load_plugin

        tool_fn = load_plugin("envs.tool_fn", tool_fn)
    factory = getattr(envs, "environment", None)
    if factory is not None:
        if isinstance(factory, str):
            from furlong.config.registry import load_plugin

            factory = load_plugin("envs.environment", factory)
        return factory(config=envs, seed=sample.metadata.get("seed", 0))
    name = getattr(envs, "name", None) or sample.metadata.get("env") or sample.metadata.get("task")
    from furlong.envs.connectors import CONNECTORS, connector

    if name in CONNECTORS:
        module = connector(name)
        if not hasattr(module, "environment"):
            raise ValueError(
                f"envs.name={name!r}: this connector is an agent, not an environment; "
                f"set rollout.agent_fn: {module.__name__}:agent instead"
            )
        return module.environment(config=envs, seed=sample.metadata.get("seed", 0))
    if name not in BUILTIN:
        if getattr(envs, "name", None):
            raise ValueError(f"envs.name={name!r}: not a built-in environment; known: {sorted(BUILTIN)}")
        name = "tools"
    cls = import_path(BUILTIN[name], "envs.name")
    if name == "tools":
        wanted = list(getattr(envs, "tools", None) or [])
        unknown = [t for t in wanted if t not in TOOLS] if tool_fn is None else []
        if unknown:
            raise ValueError(f"envs.tools: unknown tool(s) {unknown}; built in: {sorted(TOOLS)} (or set envs.tool_fn)")
        fns = {t: import_path(TOOLS[t], "envs.tools") for t in wanted if t in TOOLS}
        return cls(fns, timeout_s=timeout_s, tool_fn=tool_fn)
    return cls(config=envs, tool_fn=tool_fn)
