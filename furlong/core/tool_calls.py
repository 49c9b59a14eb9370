"""Tool calls in model output: the one parser every reader of tool calls uses.

Formats (`TOOL_FORMATS`), as the families' chat templates write them:

- `hermes` (Qwen, Hermes, the factory's template): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- `llama3` (Llama 3.1+): the turn is a JSON object `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name": ..., "arguments": {...}}`
  (or, in newer tokenizers, `[TOOL_CALLS]name[ARGS]{...}`).

`detect_tool_format(chat_template)` picks one from the template's own markers. Parsing
works on decoded text only to *read* the call; the tokens the model produced are kept
as they were (token-in-token-out). The engine's OpenAI routes, the TITO session server
and the environments all call `parse_tool_calls`, so a call one of them accepts the others accept too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_OPEN = "<tool_call>"
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
TOOL_FORMATS = ("hermes", "llama3", "mistral")
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_ARGS_RE = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


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


def detect_tool_format(chat_template: str | None) -> str:
    """The tool-call format a chat template writes, from its markers; `hermes` when it shows none."""
    t = chat_template or ""
    if MISTRAL_CALLS in t:
        return "mistral"
    if TOOL_OPEN in t:
        return "hermes"
    if PYTHON_TAG in t or ("ipython" in t and '"parameters"' in t):
        return "llama3"
    return "hermes"


def tool_call_start(fmt: str = "hermes") -> str | None:
    """The text that opens a call in `fmt` (None: llama3 calls have no opening marker), for streaming cut-offs."""
    return {"hermes": TOOL_OPEN, "mistral": MISTRAL_CALLS, "llama3": None}[_check(fmt)]


def _check(fmt: str) -> str:
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"tool-call format: unknown format {fmt!r}; choose one of {list(TOOL_FORMATS)}")
    return fmt


def _call(obj: Any, keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A ToolCall from a decoded object; ValueError naming what is wrong."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("expected an object with a string 'name'")
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError(f"'{keys[0]}' must be an object")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[str, list[ToolCall], list[str]]:
    """Split model output into (content without the calls, calls, errors for blocks that do not parse).

    A block with bad JSON, no string `name`, or non-object `arguments` is kept in the
    content and reported in `errors`, so nothing the model wrote is silently lost.
    `arguments` given as a JSON string (as the OpenAI API writes them) is decoded.
    `fmt` is one of `TOOL_FORMATS` (see `detect_tool_format`).
    """
    if _check(fmt) == "llama3":
        return _parse_llama3(text)
    if fmt == "mistral":
        return _parse_mistral(text)
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept, last = [], 0
    for m in TOOL_CALL_RE.finditer(text):
        try:
            call = _call(json.loads(m.group(1)))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            errors.append(f"unparsable tool call {m.group(0)[:200]!r}: {e}")
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(call)
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls, errors


def _parse_llama3(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """Llama 3: the turn (after an optional <|python_tag|>) is one or more `;`-separated JSON calls.

    Text that is not a call at all is plain content (no error); a turn that opens with
    `<|python_tag|>` or `{"name"` but does not parse is reported, and kept as content.
    """
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    body = body[len(PYTHON_TAG) :].strip() if tagged else body
    if not (tagged or body.startswith("{")):
        return text, [], []
    dec, calls, pos = json.JSONDecoder(), [], 0
    try:
        while pos < len(body):
            obj, end = dec.raw_decode(body, pos)
            calls.append(_call(obj, ("parameters", "arguments")))
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
    except ValueError as e:
        if tagged or body.startswith('{"name"'):
            return text, [], [f"unparsable tool call {body[:200]!r}: {e}"]
        return text, [], []
    return "", calls, []


def _parse_mistral(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """Mistral: content, then `[TOOL_CALLS]` and a JSON list of calls (or `name[ARGS]{json}` per call)."""
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return text, [], []
    content, rest = text[:at].strip(), text[at:]
    calls: list[ToolCall] = []
    try:
        if _MISTRAL_ARGS_RE.match(rest):
            dec = json.JSONDecoder()
            for m in _MISTRAL_ARGS_RE.finditer(rest):
                args, _ = dec.raw_decode(rest, m.end())
                calls.append(_call({"name": m.group(1), "arguments": args}))
        else:
            items, _ = json.JSONDecoder().raw_decode(rest[len(MISTRAL_CALLS) :].lstrip())
            for obj in items if isinstance(items, list) else [items]:
                calls.append(_call(obj))
    except ValueError as e:
        return text, [], [f"unparsable tool call {rest[:200]!r}: {e}"]
    return content, calls, []
