"""Chat-template styles of the common model families, for tokenizers built locally.

Why: a model a user brings carries its family's template (Llama-3 headers, Mistral
`[INST]`, Gemma turns, Phi-3 role tokens, Tulu/OLMo text roles), and everything that
reads tokens — end of turn, loss masks, tool calls, TITO — must work from the template
rather than from one family's constants. The tiny models the tests build carry these
templates so that each path is exercised with the tokens its family really uses.
The ChatML styles (Qwen, the factory's default) live in `tokenizer.py`.

Each template is written in the family's style (the same markers, the same places for
system prompts, tool calls and tool results), kept compact: tools are listed by name,
not as JSON schemas, so a tiny vocabulary stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Style:
    """What a tokenizer of one family carries: its special tokens, its template, its turn end."""

    name: str
    special: tuple[str, ...]  # special tokens (skipped when decoding with skip_special_tokens)
    eos: str
    end_of_turn: str  # what the model writes to end an assistant turn (a stop token in generation_config)
    template: str
    tool_format: str  # the `core.tool_calls` format its assistant turns use
    bos: str | None = None
    added: tuple[str, ...] = field(default=())  # ordinary added tokens (tool markers the model must emit)


def _args(f: str = "f") -> str:
    return f"{{% if {f}.arguments is string %}}{{{{ {f}.arguments }}}}{{% else %}}{{{{ {f}.arguments | tojson }}}}{{% endif %}}"


_TOOL_LIST = (
    "Tools:\n{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "- {{ f.name }}{{ ': ' ~ f.description if f.description else '' }}\n{% endfor %}"
)
_EACH_CALL = "{% for tc in message.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
_HERMES_CALL = _EACH_CALL + '<tool_call>{"name": "{{ f.name }}", "arguments": ' + _args() + "}</tool_call>{% endfor %}"

# Llama 3.1: header tokens around each role, <|eot_id|> ends a turn, tool results in the `ipython`
# role, a tool call is the whole assistant turn as {"name": ..., "parameters": ...}.
LLAMA3 = Style(
    name="llama3",
    special=("<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    eos="<|end_of_text|>",
    bos="<|begin_of_text|>",
    end_of_turn="<|eot_id|>",
    tool_format="llama3",
    added=("<|python_tag|>",),
    template=(
        "{{ bos_token }}"
        "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
        "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
        + _TOOL_LIST
        + 'Respond with {"name": ..., "parameters": ...}<|eot_id|>'
        "{% endif %}"
        "{% for message in messages %}"
        "{% if message.role == 'system' %}"
        "{% if not tools %}<|start_header_id|>system<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}"
        "{% elif message.role == 'tool' %}"
        "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
        "{% elif message.role == 'assistant' %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{{ message.content or '' }}"
        + _EACH_CALL
        + '{"name": "{{ f.name }}", "parameters": '
        + _args()
        + "}{% endfor %}<|eot_id|>"
        "{% else %}"
        "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
)

# Mistral (v3 tokenizer): [INST] ... [/INST], the answer, </s>; tools as [AVAILABLE_TOOLS], calls as
# [TOOL_CALLS] followed by a JSON list, results as [TOOL_RESULTS] ... [/TOOL_RESULTS]. No generation prompt.
MISTRAL = Style(
    name="mistral",
    special=(
        "</s>",
        "<s>",
        "[INST]",
        "[/INST]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
    ),
    eos="</s>",
    bos="<s>",
    end_of_turn="</s>",
    tool_format="mistral",
    added=("[TOOL_CALLS]",),
    template=(
        "{{ bos_token }}"
        "{% if tools %}[AVAILABLE_TOOLS]{% for tool in tools %}"
        "{% set f = tool.function if tool.function is defined else tool %}{{ f.name }} {% endfor %}"
        "[/AVAILABLE_TOOLS]{% endif %}"
        "{% for message in messages %}"
        "{% if message.role == 'system' %}[INST]{{ message.content }}[/INST]"
        "{% elif message.role == 'user' %}[INST]{{ message.content }}[/INST]"
        "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
        "{% elif message.role == 'assistant' %}{{ message.content or '' }}"
        "{% if message.tool_calls %}[TOOL_CALLS]["
        "{% for tc in message.tool_calls %}{% set f = tc.function if tc.function is defined else tc %}"
        '{"name": "{{ f.name }}", "arguments": ' + _args() + "}{{ ', ' if not loop.last else '' }}{% endfor %}]"
        "{% endif %}</s>"
        "{% endif %}{% endfor %}"
    ),
)

# Gemma 2/3: <start_of_turn>role ... <end_of_turn>, the assistant role is `model`, the system prompt
# is folded into the first user turn. Gemma has no tool format of its own: Hermes-style calls.
GEMMA = Style(
    name="gemma",
    special=("<eos>", "<bos>", "<pad>", "<start_of_turn>", "<end_of_turn>"),
    eos="<eos>",
    bos="<bos>",
    end_of_turn="<end_of_turn>",
    tool_format="hermes",
    added=("<tool_call>", "</tool_call>"),
    template=(
        "{{ bos_token }}"
        "{% set first = messages[0].content ~ '\n\n' if messages[0].role == 'system' else '' %}"
        "{% for message in messages %}"
        "{% if message.role == 'system' %}"
        "{% elif message.role == 'assistant' %}"
        "<start_of_turn>model\n{{ message.content or '' }}" + _HERMES_CALL + "<end_of_turn>\n"
        "{% else %}"
        "<start_of_turn>{{ 'user' if message.role == 'user' else message.role }}\n"
        "{{ first if loop.index0 == (1 if messages[0].role == 'system' else 0) else '' }}"
        "{{ message.content }}<end_of_turn>\n"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
)

# Phi-3: <|system|>, <|user|>, <|assistant|> role tokens, each turn ended by <|end|>.
PHI3 = Style(
    name="phi3",
    special=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    eos="<|endoftext|>",
    end_of_turn="<|end|>",
    tool_format="hermes",
    added=("<tool_call>", "</tool_call>"),
    template=(
        "{% for message in messages %}"
        "{% if message.role == 'assistant' %}<|assistant|>\n{{ message.content or '' }}" + _HERMES_CALL + "<|end|>\n"
        "{% elif message.role in ('system', 'user') %}<|{{ message.role }}|>\n{{ message.content }}<|end|>\n"
        "{% else %}<|user|>\n{{ message.content }}<|end|>\n"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
)

# OLMo 2 / Tulu: roles as plain text lines, an assistant turn ended by the EOS token (the last one
# without the newline that follows the others).
TULU = Style(
    name="tulu",
    special=("<|endoftext|>", "<|pad|>"),
    eos="<|endoftext|>",
    end_of_turn="<|endoftext|>",
    tool_format="hermes",
    added=("<tool_call>", "</tool_call>"),
    template=(
        "{% for message in messages %}"
        "{% if message.role == 'assistant' %}<|assistant|>\n{{ message.content or '' }}"
        + _HERMES_CALL
        + "{{ eos_token }}{{ '' if loop.last else '\n' }}"
        "{% else %}<|{{ message.role }}|>\n{{ message.content }}\n"
        "{% endif %}"
        "{% if loop.last and add_generation_prompt %}<|assistant|>\n{% endif %}"
        "{% endfor %}"
    ),
)

FAMILY_STYLES = {s.name: s for s in (LLAMA3, MISTRAL, GEMMA, PHI3, TULU)}
