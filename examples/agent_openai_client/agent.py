"""A black-box agent that knows nothing of furlong: only the official `openai` client.

It solves a calculator question with tool calls, the way any agent harness would:
send the conversation, run the tools the model asks for, send the results back,
until the model answers or the turn limit is reached. Point it at a furlong TITO
session (`base_url = <sessions server>/sessions/<id>/v1`) and every token of the
episode is recorded exactly, ready for training — the agent needs no change.

    FURLONG_ADMIN_TOKEN=T furlong serve --model DIR --port 30000 &
    furlong envs sessions --engine http://127.0.0.1:30000 --port 31000 &
    python examples/agent_openai_client/agent.py --sessions http://127.0.0.1:31000

`agent(sample, base_url)` fits the `rollout.agent_fn` plug point (it returns the reward).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import ssl
from typing import Any

import httpx
from openai import AsyncOpenAI, OpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "integer + - * and parentheses",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def calculator(expression: str) -> str:
    """The agent's own tool: digits, spaces, + - * and parentheses only, so `eval` sees nothing else."""
    if not re.fullmatch(r"[\d\s+\-*()]{1,200}", expression):
        return "error: only integers, + - * and parentheses"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - the regex admits arithmetic only
    except Exception as e:  # noqa: BLE001 - the tool's error is the model's observation
        return f"error: {e}"


def tool_results(message: Any, fallback: str | None) -> list[dict[str, Any]]:
    """`tool` messages answering the model's calls; with none, `fallback` (if given) is sent as a result."""
    out = []
    for call in message.tool_calls or []:
        try:
            args = json.loads(call.function.arguments)
            result = (
                calculator(str(args.get("expression", "")))
                if call.function.name == "calculator"
                else "error: unknown tool"
            )
        except json.JSONDecodeError:
            result = "error: arguments are not JSON"
        out.append({"role": "tool", "tool_call_id": call.id, "content": result})
    if not out and fallback is not None:
        out.append({"role": "tool", "tool_call_id": "call_0", "content": calculator(fallback)})
    return out


def run(
    base_url: str,
    question: str,
    *,
    max_turns: int = 3,
    force_tool: str | None = None,
    seed: int | None = None,
    **create: Any,
) -> list[dict[str, Any]]:
    """One episode; returns the conversation. `force_tool`: an expression whose result the agent sends after
    every turn without a call (an untrained model rarely calls tools); `seed`: turn i samples with seed + i;
    `create`: extra `create()` arguments."""
    client = OpenAI(base_url=base_url, api_key="unused")
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for turn in range(max_turns):
        if seed is not None:
            create["seed"] = seed + turn
        resp = client.chat.completions.create(model="furlong", messages=messages, tools=[CALCULATOR], **create)
        message = resp.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        results = tool_results(message, force_tool)
        if not results or turn == max_turns - 1:
            break
        messages += results
    return messages


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every episode: building one loads the CA bundle (~45 ms of CPU), and an agent run
    as `rollout.agent_fn` plays dozens of episodes a step in the driver's process."""
    return httpx.create_ssl_context()


async def agent(sample: Any, base_url: str) -> float:
    """The `rollout.agent_fn` plug point: solve `sample`'s question; reward 1.0 iff the last reply holds the label."""
    question = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    http = httpx.AsyncClient(verify=_tls())  # the SDK's own client would build a TLS context per episode
    async with AsyncOpenAI(base_url=base_url, api_key="unused", http_client=http) as client:
        for _ in range(3):
            resp = await client.chat.completions.create(
                model="furlong", messages=messages, tools=[CALCULATOR], max_tokens=64
            )
            message = resp.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            results = tool_results(message, None)
            if not results:
                break
            messages += results
    numbers = re.findall(r"-?\d+", messages[-1].get("content") or "")
    return float(bool(numbers) and int(numbers[0]) == int(sample.label))


def main() -> None:
    import urllib.request

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", required=True, help="the furlong sessions server, e.g. http://127.0.0.1:31000")
    parser.add_argument("--question", default="Use the calculator to compute 12 * 34 + 56.")
    args = parser.parse_args()
    with urllib.request.urlopen(urllib.request.Request(args.sessions + "/sessions", data=b"{}", method="POST")) as r:
        sid = json.load(r)["id"]
    for m in run(f"{args.sessions}/sessions/{sid}/v1", args.question, max_tokens=64):
        print(f"{m['role']:>9}: {m.get('content') or m.get('tool_calls')}")
    print(f"recorded Samples: {args.sessions}/sessions/{sid}/samples")


if __name__ == "__main__":
    main()
