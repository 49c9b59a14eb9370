"""The calculator environment: the `calculator` synthetic task solved with a tool.

Prompts come from `TASKS["calculator"]` (chat form, with the tool's schema in
`metadata["tools"]` so the chat template lists it). The model may call
`<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>`
any number of times (up to `rollout.max_turns`); the result comes back as a `tool`
turn; its final turn must state the answer.

Reward (a dict; `score` is what advantages use): 1.0 when the final turn's first integer
equals the label (the task's rule); otherwise partial credit for each part of using the tool
well, so a small model that cannot yet solve the task still gets a gradient:

    0.2   the calculator was called (a well-formed call)
  + 0.3   it was called with the question's expression
  + 0.3   the answer is the tool's (last) result, copied

Each skill is credited on its own because a GRPO advantage is one number for the whole
episode: crediting the call alone would also reinforce whatever answer followed it, and
teach the model to answer carelessly after a good call. Beside `score` come `correct`,
`used_tool`, `right_expression`, `copied_result` and `tool_calls`, so a run shows each habit
being learned. `envs.connector: {tiers: false}` gives the bare task rule (1.0 / 0.0).

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
from typing import TYPE_CHECKING, Any

from furlong.core.sample import Sample
from furlong.data.tasks import TASKS, calculate, score_integer
from furlong.envs.protocol import ToolEnvironment, final_text
from furlong.envs.session_store import template_tools

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig


def calculator(expression: str) -> str:
    """The `calculator` tool: integer `+ - *` and parentheses (never `eval`)."""
    return str(calculate(str(expression)))


CREDIT = {"used_tool": 0.2, "right_expression": 0.3, "copied_result": 0.3}  # below 1.0 together: only correct earns 1


def _copied(answer: str, result: str) -> bool:
    """Whether the answer states the tool's result (an error message is never a number to copy)."""
    try:
        return score_integer(answer, int(result.strip())) == 1.0
    except ValueError:
        return False


def _same_expression(a: Any, b: Any) -> bool:
    return " ".join(str(a).split()) == " ".join(str(b).split())


def calculator_calls(sample: Sample) -> tuple[list[str], list[str]]:
    """(the `expression` of every calculator call, every tool result), in order.

    Multi-turn generate records them as the environment runs them; an agent on a TITO
    session runs its own tools, so they are read from the session's messages.
    """
    if "calculator_expressions" in sample.metadata:
        return list(sample.metadata["calculator_expressions"]), list(sample.metadata.get("calculator_results", []))
    expressions, results = [], []
    for m in sample.metadata.get("messages") or []:
        if m.get("role") == "tool":
            results.append(str(m.get("content") or ""))
        for c in m.get("tool_calls") or []:
            f = c.get("function", c)
            args = f.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args or "{}")
                except json.JSONDecodeError:
                    continue
            if f.get("name") == "calculator" and isinstance(args, dict) and "expression" in args:
                expressions.append(str(args["expression"]))
    return expressions, results


class CalculatorEnvironment(ToolEnvironment):
    def __init__(self, config: EnvsConfig | None = None, tool_fn: Any = None):
        super().__init__({"calculator": calculator}, timeout_s=getattr(config, "timeout_s", 10.0), tool_fn=tool_fn)
        options = dict(getattr(config, "connector", None) or {})
        unknown = sorted(set(options) - {"tiers"})
        if unknown:
            raise ValueError(
                f"envs.connector: unknown key(s) {unknown} for the calculator environment; known: ['tiers']"
            )
        self.tiers = bool(options.get("tiers", True))

    async def step(self, sample: Sample, action: str) -> tuple[list[dict[str, Any]], bool]:
        from furlong.core.tool_calls import parse_tool_calls

        _, calls, _ = parse_tool_calls(action)
        sample.metadata.setdefault("calculator_expressions", []).extend(
            str(c.arguments["expression"]) for c in calls if c.name == "calculator" and "expression" in c.arguments
        )
        messages, done = await super().step(sample, action)
        sample.metadata.setdefault("calculator_results", []).extend(
            str(m.get("content") or "") for m in messages if m.get("role") == "tool"
        )
        return messages, done

    async def reward(self, sample: Sample) -> dict[str, float]:
        if sample.label is None:
            raise ValueError("CalculatorEnvironment.reward: the sample has no label")
        calls = float(sample.metadata.get("tool_calls", 0))
        expressions, results = calculator_calls(sample)
        question = sample.metadata.get("expression")
        answer = final_text(sample)
        parts = {
            "correct": score_integer(answer, sample.label),
            "used_tool": float(calls > 0),
            "right_expression": float(question is not None and any(_same_expression(e, question) for e in expressions)),
            "copied_result": float(bool(results) and _copied(answer, results[-1])),
        }
        if parts["correct"] or not self.tiers:
            score = parts["correct"]
        else:
            score = sum(CREDIT[k] * parts[k] for k in CREDIT)
        return {"score": score, **parts, "tool_calls": calls}


def demonstration(
    expression: str, label: int, tools: list[dict[str, Any]], question: list[dict[str, Any]], flawed: bool
) -> dict[str, Any]:
    """One warm-up conversation (`messages`, `tools`); see the module docstring for `flawed`.

    The answer is the bare number: after the tool's `<tool_response>` it is then the same
    tokens as the result, a copy a small model learns quickly ("Answer: 42" would start
    with " 4", another token than the result's "4").
    """
    if flawed:
        shortcut = calculate(" ".join(expression.split()[:3]))  # "12 * 34 + 56" -> 12 * 34
        return {"messages": [*question, {"role": "assistant", "content": str(shortcut)}], "tools": tools}
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": expression}},
    }
    return {
        "messages": [
            *question,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": calculator(expression)},
            {"role": "assistant", "content": str(label)},
        ],
        "tools": tools,
    }


def write_demonstrations(path: str | Path, n: int, *, seed: int = 0, flawed: float = 0.5, difficulty: int = 1) -> Path:
    """`n` calculator conversations from the task's train split (another seed than the RL prompts').

    A `flawed` fraction skip the tool.

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
