"""The calculator environment: the `calculator` synthetic task solved with a tool.

Prompts come from `TASKS["calculator"]` (chat form, with the tool's schema in
`metadata["tools"]` so the chat template lists it). The model may call
`<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>`
any number of times (up to `rollout.max_turns`); the result comes back as a `tool`
turn; its final turn must state the answer.

Reward (a dict; `score` is what advantages use), in tiers so a small model that
cannot yet solve the task still gets a gradient toward using the tool well:

    1.0   the final turn's first integer equals the label (the task's rule)
    0.5   otherwise, the calculator was called with the question's expression
    0.2   otherwise, the calculator was called (a well-formed call)
    0.0   no call: a guess, which is wrong unless it happens to be the value

plus `correct`, `tool_calls` (how many calls were made), `used_tool` (1.0 if any) and
`right_expression` beside it, so a run shows each habit being learned. Set
`envs.connector: {tiers: false}` for the bare task rule (1.0 / 0.0).

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


TIERS = {"correct": 1.0, "right_expression": 0.5, "used_tool": 0.2}


def _same_expression(a: Any, b: Any) -> bool:
    return " ".join(str(a).split()) == " ".join(str(b).split())


def calculator_expressions(sample: Sample) -> list[str]:
    """The `expression` of every calculator call of the episode, in order.

    Multi-turn generate records them as the environment runs them; an agent on a TITO
    session runs its own tools, so its calls are read from the session's messages.
    """
    if "calculator_expressions" in sample.metadata:
        return list(sample.metadata["calculator_expressions"])
    out = []
    for m in sample.metadata.get("messages") or []:
        for c in m.get("tool_calls") or []:
            f = c.get("function", c)
            args = f.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args or "{}")
                except json.JSONDecodeError:
                    continue
            if f.get("name") == "calculator" and isinstance(args, dict) and "expression" in args:
                out.append(str(args["expression"]))
    return out


class CalculatorEnvironment(ToolEnvironment):
    def __init__(self, config: Any = None, tool_fn: Any = None):
        super().__init__({"calculator": calculator}, timeout_s=getattr(config, "timeout_s", 10.0), tool_fn=tool_fn)
        options = dict(getattr(config, "connector", None) or {})
        unknown = sorted(set(options) - {"tiers"})
        if unknown:
            raise ValueError(f"envs.connector: unknown key(s) {unknown} for the calculator environment; known: ['tiers']")
        self.tiers = bool(options.get("tiers", True))

    async def step(self, sample: Sample, action: str) -> tuple[list[dict[str, Any]], bool]:
        from furlong.envs.tools import parse_tool_calls

        _, calls, _ = parse_tool_calls(action)
        sample.metadata.setdefault("calculator_expressions", []).extend(
            str(c.arguments["expression"]) for c in calls if c.name == "calculator" and "expression" in c.arguments)
        return await super().step(sample, action)

    async def reward(self, sample: Sample) -> dict[str, float]:
        if sample.label is None:
            raise ValueError("CalculatorEnvironment.reward: the sample has no label")
        calls = float(sample.metadata.get("tool_calls", 0))
        expressions = calculator_expressions(sample)
        question = sample.metadata.get("expression")
        parts = {"correct": score_integer(final_text(sample), sample.label), "used_tool": float(calls > 0),
                 "right_expression": float(question is not None and any(_same_expression(e, question) for e in expressions))}
        score = parts["correct"] if not self.tiers else max(TIERS[k] * v for k, v in parts.items())
        return {"score": score, **parts, "tool_calls": calls}


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
