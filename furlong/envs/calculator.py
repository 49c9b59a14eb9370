"""The calculator environment: the `calculator` synthetic task solved with a tool.

Prompts come from `TASKS["calculator"]` (chat form, with the tool's schema in
`metadata["tools"]` so the chat template lists it). The model may call
`<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>`
any number of times (up to `rollout.max_turns`); the result comes back as a `tool`
turn; its final turn must state the answer.

Reward (a dict; `score` is what advantages use): `score` 1.0 iff the final turn's
first integer equals the label (the task's rule), plus `tool_calls` (how many
calls were made) and `used_tool` (1.0 if any), logged so a run shows the model
learning to call the tool.
"""

from __future__ import annotations

from typing import Any

from furlong.data.tasks import calculate, score_integer
from furlong.envs.protocol import ToolEnvironment, final_text
from furlong.rollout.sample import Sample


def calculator(expression: str) -> str:
    """The `calculator` tool: integer `+ - *` and parentheses (never `eval`)."""
    return str(calculate(str(expression)))


class CalculatorEnvironment(ToolEnvironment):
    def __init__(self, config: Any = None, tool_fn: Any = None):
        super().__init__({"calculator": calculator}, timeout_s=getattr(config, "timeout_s", 10.0), tool_fn=tool_fn)

    async def reward(self, sample: Sample) -> dict[str, float]:
        if sample.label is None:
            raise ValueError("CalculatorEnvironment.reward: the sample has no label")
        calls = float(sample.metadata.get("tool_calls", 0))
        return {"score": score_integer(final_text(sample), sample.label), "tool_calls": calls,
                "used_tool": float(calls > 0)}
