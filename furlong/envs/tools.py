"""Tool calls: parsed from model output, executed asynchronously with a timeout.

Format: the chat template's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen / Hermes style). Parsing works on decoded text only to *read* the call; the
tokens the model produced are kept as they were (token-in-token-out).

A tool is `fn(**arguments) -> str` or an async one, or any `tool_fn(name, arguments)`
plug point (`envs.tool_fn`) that executes every call itself. A failing or slow tool
never fails the rollout: its error (or "timed out after N s") becomes the tool's
result text, which is what the model sees and learns from — as a real agent would.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any

from furlong.core import spans
from furlong.core.tool_calls import ToolCall

MAX_RESULT_CHARS = 4096


async def _invoke(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await an async tool; run a plain one in a thread so a slow tool cannot stall the event loop."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return await fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


async def execute(
    call: ToolCall, tools: dict[str, Callable[..., Any]], *, timeout_s: float, tool_fn: Callable[..., Any] | None = None
) -> str:
    """One call's result text; errors and timeouts become text (the module docstring says why).

    A plain tool that times out keeps running in its thread until it returns (Python
    cannot kill a thread): tools that may hang should be async or use the sandbox.
    """
    with spans.span("env", "tool-call", tool=call.name):  # each call's latency on the env lane of the timeline
        return await _execute(call, tools, timeout_s=timeout_s, tool_fn=tool_fn)


async def _execute(
    call: ToolCall, tools: dict[str, Callable[..., Any]], *, timeout_s: float, tool_fn: Callable[..., Any] | None
) -> str:
    try:
        if tool_fn is not None:
            result = await asyncio.wait_for(_invoke(tool_fn, call.name, call.arguments), timeout_s)
        elif call.name not in tools:
            return f"error: unknown tool {call.name!r}; available: {sorted(tools)}"
        else:
            result = await asyncio.wait_for(_invoke(tools[call.name], **call.arguments), timeout_s)
    except TimeoutError:
        return f"error: tool {call.name!r} timed out after {timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 - the tool's failure is the model's observation
        return f"error: {type(e).__name__}: {e}"
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + "...[truncated]"


async def execute_all(
    calls: list[ToolCall],
    tools: dict[str, Callable[..., Any]],
    *,
    timeout_s: float,
    tool_fn: Callable[..., Any] | None = None,
) -> list[dict[str, Any]]:
    """Run a turn's calls concurrently; one `tool` message per call, in the order they were made."""
    results = await asyncio.gather(*(execute(c, tools, timeout_s=timeout_s, tool_fn=tool_fn) for c in calls))
    return [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": r} for c, r in zip(calls, results)]
