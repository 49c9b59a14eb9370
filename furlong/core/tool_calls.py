"""Tool calls in model output: the one parser every reader of tool calls uses.

Format: the chat template's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen / Hermes style). Parsing works on decoded text only to *read* the call; the
tokens the model produced are kept as they were (token-in-token-out). The engine's
OpenAI routes, the TITO session server and the environments all call
`parse_tool_calls`, so a call one of them accepts the others accept too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_OPEN = "<tool_call>"
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry (arguments as a JSON string, as the API sends them)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """Split model output into (content without the calls, calls, errors for blocks that do not parse).

    A block with bad JSON, no string `name`, or non-object `arguments` is kept in the
    content and reported in `errors`, so nothing the model wrote is silently lost.
    `arguments` given as a JSON string (as the OpenAI API writes them) is decoded.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept, last = [], 0
    for m in TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError("expected an object with a string 'name'")
            args = obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args) if args.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("'arguments' must be an object")
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            errors.append(f"unparsable tool call {m.group(0)[:200]!r}: {e}")
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(ToolCall(obj["name"], args))
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls, errors
