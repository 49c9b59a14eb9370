"""Tool-call formats: each family's template renders a call that its parser reads back; detection from the template."""

from __future__ import annotations

import pytest

from furlong.core.tool_calls import TOOL_FORMATS, detect_tool_format, parse_tool_calls, tool_call_start
from furlong.models.tokenizer import build_tokenizer, styles

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "17*23"}}}
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic"}}]


@pytest.mark.parametrize("style", list(styles()))
def test_template_renders_calls_its_detected_parser_reads(style: str) -> None:
    """What the template writes for an assistant tool call parses back to the same call, with the detected format."""
    from furlong.data.chat import assistant_text

    tok = build_tokenizer(512, 0, style)
    fmt = detect_tool_format(tok.chat_template)
    assert fmt == styles()[style].tool_format
    text = assistant_text(tok, {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}, TOOLS)
    content, calls, errors = parse_tool_calls(text, fmt)
    assert errors == [] and content == ""
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "17*23"})] * 2
    # the ids survive the tokenizer: decoding what the model would emit gives the same calls
    again = tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert [c.name for c in parse_tool_calls(again, fmt)[1]] == [c.name for c in calls]


def test_llama3_calls() -> None:
    content, calls, errors = parse_tool_calls(
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g"}', "llama3"
    )
    assert (content, [(c.name, c.arguments) for c in calls], errors) == ("", [("f", {"x": 1}), ("g", {})], [])
    assert parse_tool_calls("The answer is 4.", "llama3") == ("The answer is 4.", [], [])
    content, calls, errors = parse_tool_calls('{"name": "f", "parameters": [1]}', "llama3")
    assert calls == [] and content == '{"name": "f", "parameters": [1]}' and "must be an object" in errors[0]
    assert parse_tool_calls('{"a": 1} and more', "llama3")[1:] == ([], [])  # JSON content, not a call


def test_mistral_calls() -> None:
    text = 'Let me compute.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": "{}"}]'
    content, calls, errors = parse_tool_calls(text, "mistral")
    assert (content, [(c.name, c.arguments) for c in calls], errors) == (
        "Let me compute.",
        [("f", {"x": 1}), ("g", {})],
        [],
    )
    content, calls, _ = parse_tool_calls('[TOOL_CALLS]f[ARGS]{"x": 2}[TOOL_CALLS]g[ARGS]{}', "mistral")
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 2}), ("g", {})]
    content, calls, errors = parse_tool_calls("[TOOL_CALLS][{oops", "mistral")
    assert calls == [] and content == "[TOOL_CALLS][{oops" and errors
    assert parse_tool_calls("no calls", "mistral") == ("no calls", [], [])


def test_hermes_is_the_default_and_unknown_formats_are_refused() -> None:
    text = 'a<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>b'
    assert parse_tool_calls(text)[1][0].arguments == parse_tool_calls(text, "hermes")[1][0].arguments == {"x": 1}
    assert detect_tool_format(None) == detect_tool_format("{{ messages }}") == "hermes"
    assert [tool_call_start(f) for f in TOOL_FORMATS] == ["<tool_call>", None, "[TOOL_CALLS]"]
    with pytest.raises(ValueError, match="unknown format 'xml'"):
        parse_tool_calls(text, "xml")
