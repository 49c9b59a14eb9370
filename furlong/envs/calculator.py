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

`write_demonstrations` writes warm-up conversations for `data.sft_path` (`furlong envs
demos calculator FILE`): a correct one calls the tool with the question's expression
and answers with its result; a *flawed* one (a careless demonstrator) skips the tool
and answers the first product alone, which is always wrong. SFT on a mix teaches the
format and both habits; RL, rewarded only for correct answers, has to pick the tool.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from furlong.data.tasks import TASKS, calculate, score_integer
from furlong.envs.protocol import ToolEnvironment, final_text
from furlong.envs.sessions import template_tools
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


def demonstration(expression: str, label: int, tools: list[dict[str, Any]], question: list[dict[str, Any]],
                  flawed: bool) -> dict[str, Any]:
    """One warm-up conversation (`messages`, `tools`); see the module docstring for `flawed`.

    The answer is the bare number: after the tool's `<tool_response>` it is then the same
    tokens as the result, a copy a small model learns quickly ("Answer: 42" would start
    with " 4", another token than the result's "4").
    """
    if flawed:
        shortcut = calculate(" ".join(expression.split()[:3]))  # "12 * 34 + 56" -> 12 * 34
        return {"messages": [*question, {"role": "assistant", "content": str(shortcut)}], "tools": tools}
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return {"messages": [*question, {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_0", "content": calculator(expression)},
                         {"role": "assistant", "content": str(label)}], "tools": tools}


def write_demonstrations(path: str | Path, n: int, *, seed: int = 0, flawed: float = 0.5, difficulty: int = 1) -> Path:
    """`n` calculator conversations from the task's train split (another seed than the RL prompts'); a `flawed` fraction skip the tool.

    They are meant for rollouts through TITO sessions (`rollout.agent_fn`), so the tools are written as a
    session hands them to the chat template.
    """
    if not 0.0 <= flawed <= 1.0:
        raise ValueError(f"flawed: a fraction in [0, 1], got {flawed}")
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p in TASKS["calculator"].make("train", n, seed=seed + 7, difficulty=difficulty, chat=True):
            tools = template_tools(p.metadata["tools"])  # as the session renders them: prompts match token for token
            demo = demonstration(p.metadata["expression"], p.label, tools, p.prompt, rng.random() < flawed)
            f.write(json.dumps(demo) + "\n")
    return path
