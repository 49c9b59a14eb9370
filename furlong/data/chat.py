"""Token ids for the messages appended to a conversation, without re-tokenising what came before.

Token-in-token-out (TITO) keeps the exact ids the engine produced for every model
turn. What follows a model turn — the template's glue, a tool result, the next
generation prompt — is the only text that must be tokenised, and it must be
tokenised the same way the chat template would render it in the whole conversation.

`suffix_ids` does that in three steps:

1. *closing*: what the template writes after an assistant message's content
   (end of turn and a newline in ChatML, `<|eot_id|>` in Llama 3, `</s>` in Mistral).
   The model usually produced part of it already (its stop token, `end_of_turn`);
   only the rest (the newline) is added.
2. *delta*: the rendering of the new messages plus the generation prompt, found as
   `render(dummy + new) - render(dummy)` with a fixed dummy conversation that ends
   with an assistant turn. It never depends on earlier model output, so a template
   that rewrites history (e.g. drops old `<think>` blocks) cannot shift it.
3. *sources*: each token is labelled with where its characters came from — the
   message's content (`tool` for tool results, `env` for anything else) or the
   template (`template`) — by rendering once more with sentinel contents to find
   exactly where the template placed each content.

Everything appended gets loss mask 0: only policy tokens are trained.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any

from furlong.core.sample import Sample, Source

DUMMY = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class TemplateError(ValueError):
    """The chat template cannot render the appended messages as a pure suffix."""


def encode_prompt(
    tokenizer: Any, prompt: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Prompt ids: messages go through the chat template (with a generation prompt), text is encoded as is."""
    if tokenizer is None:
        raise ValueError("encode_prompt: a tokenizer is needed to encode prompts (pass tokenizer= to the manager)")
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    out = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers 5 may return a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def render(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation_prompt: bool
) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def closing(tokenizer: Any) -> str:
    """What the template writes right after an assistant message's content."""
    sentinel = "\u2063furlong\u2063"
    text = render(tokenizer, [DUMMY[0], {"role": "assistant", "content": sentinel}], None, False)
    return text[text.index(sentinel) + len(sentinel) :]


def end_of_turn(tokenizer: Any) -> str:
    """The token an assistant turn ends with, read from the template: the first token of its closing.

    That is the template's own end-of-turn marker when the closing starts with a special or
    added token (ChatML, Llama 3, Gemma, Phi-3, Mistral, Tulu's EOS); a template whose closing
    is plain text ends turns with the tokenizer's EOS token.
    """
    close = closing(tokenizer)
    ids = tokenizer.encode(close, add_special_tokens=False) if close else []
    if ids:
        first = tokenizer.convert_ids_to_tokens(ids[0])
        if first in tokenizer.all_special_tokens or first in tokenizer.get_added_vocab():
            return first
    if tokenizer.eos_token is None:
        raise TemplateError("the chat template's closing starts with no special token and the tokenizer has no EOS")
    return tokenizer.eos_token


def stop_token_ids(tokenizer: Any, generation_eos: int | list[int] | None = None) -> list[int]:
    """The ids that end a turn: the generation config's EOS ids plus the template's end of turn (if it has one)."""
    ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    end = None
    if getattr(tokenizer, "chat_template", None):
        try:
            end = end_of_turn(tokenizer)
        except Exception:  # noqa: BLE001 - a template that cannot render a bare turn still serves raw prompts
            end = None
    end_id = tokenizer.convert_tokens_to_ids(end) if end is not None else tokenizer.eos_token_id
    if end_id is not None:
        ids.append(int(end_id))
    return list(dict.fromkeys(ids))


def missing_closing(tokenizer: Any, output_text: str) -> str:
    """The part of the closing the model did not write itself (all of it after a length cut)."""
    close = closing(tokenizer)
    for k in range(len(close), 0, -1):
        if output_text.endswith(close[:k]):
            return close[k:]
    return close


def source_of(message: dict[str, Any]) -> Source:
    return Source.TOOL if message.get("role") == "tool" else Source.ENV


def _delta(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    base = render(tokenizer, DUMMY, tools, False)
    full = render(tokenizer, DUMMY + messages, tools, True)
    if not full.startswith(base):
        raise TemplateError(
            "the chat template renders appended messages by rewriting earlier ones; "
            "this template cannot be continued token-in-token-out"
        )
    return full[len(base) :]


def content_spans(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, delta: str
) -> list[tuple[int, int, Source]]:
    """(start, end, source) of each message's content inside `delta`.

    Rendered once more with sentinel contents: the text between sentinels is the
    template's own. If putting the real contents back does not give `delta` (a
    template that transforms content), the whole delta is attributed to the messages.
    """
    marks = [f"\u2063{i}\u2063" for i in range(len(messages))]
    marked = [
        {**m, "content": mark} if isinstance(m.get("content"), str) and m["content"] else m
        for m, mark in zip(messages, marks)
    ]
    pieces_text = _delta(tokenizer, marked, tools)
    spans, rebuilt, pos = [], [], 0
    for m, mark, shown in zip(messages, marks, marked):
        if shown is m:  # no string content to place
            continue
        at = pieces_text.find(mark, pos)
        if at < 0:
            break
        rebuilt.append(pieces_text[pos:at])
        start = sum(map(len, rebuilt))
        rebuilt.append(m["content"])
        spans.append((start, start + len(m["content"]), source_of(m)))
        pos = at + len(mark)
    rebuilt.append(pieces_text[pos:])
    if "".join(rebuilt) != delta:
        return [(0, len(delta), source_of(messages[0]))] if messages else []
    return spans


def suffix_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    after_output: str | None = None,
) -> tuple[list[int], list[str]]:
    """Ids (and a Source value per id) that continue a conversation with `messages` and a generation prompt.

    `after_output` is the decoded text (special tokens kept) of the model turn these
    messages answer; None when the conversation so far ends with a generation prompt
    already closed (nothing to close).
    """
    prefix = "" if after_output is None else missing_closing(tokenizer, after_output)
    delta = _delta(tokenizer, messages, tools)
    spans = [(a + len(prefix), b + len(prefix), s) for a, b, s in content_spans(tokenizer, messages, tools, delta)]
    enc = tokenizer(prefix + delta, add_special_tokens=False, return_offsets_mapping=True)
    sources = []
    for start, end in enc["offset_mapping"]:
        src = next((s for a, b, s in spans if start < b and end > a), Source.TEMPLATE)
        sources.append(src.value)
    return [int(t) for t in enc["input_ids"]], sources


def append_runs(sample: Sample, ids: list[int], sources: list[str]) -> None:
    """Append non-policy tokens to `sample`, one `Sample.append` per run of one source (loss mask 0)."""
    start = 0
    for source, run in groupby(sources):
        n = len(list(run))
        sample.append(ids[start : start + n], source=source)
        start += n


def assistant_text(tokenizer: Any, message: dict[str, Any], tools: list[dict[str, Any]] | None) -> str:
    """What the template writes for an assistant message between its header and its closing.

    That is the text a model must produce for this turn (tool calls in the template's
    own `<tool_call>` format), so a demonstration teaches exactly what the rollout reads.
    """
    head = render(tokenizer, [DUMMY[0]], tools, True)
    full = render(tokenizer, [DUMMY[0], message], tools, False)
    close = closing(tokenizer)
    if not full.startswith(head) or not full.endswith(close):
        raise TemplateError("the chat template does not render an assistant turn as header + content + closing")
    return full[len(head) : len(full) - len(close)]


def conversation_sample(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    end_token: str | None = None,
) -> Sample:
    """A whole demonstrated conversation as one Sample whose token ids match what a multi-turn rollout produces.

    The prompt is everything before the first assistant turn (chat template with a
    generation prompt); each assistant turn is its template text plus `end_token`
    (what the model stops with; default: the template's `end_of_turn`), trained (loss mask 1); the messages between turns are
    added with `suffix_ids`, exactly as `multiturn.generate` and the session server
    add them, with loss mask 0. Messages after the last assistant turn are not used.
    """
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("conversation_sample: needs prompt messages followed by at least one assistant turn")
    end_token = end_of_turn(tokenizer) if end_token is None else end_token
    sample = Sample(prompt=list(messages[:first]), tokens=encode_prompt(tokenizer, messages[:first], tools))
    i = first
    while i < len(messages):
        text = assistant_text(tokenizer, messages[i], tools) + end_token
        sample.append(tokenizer.encode(text, add_special_tokens=False), version=0)
        j = next((k for k in range(i + 1, len(messages)) if messages[k].get("role") == "assistant"), None)
        if j is None:
            break
        ids, sources = suffix_ids(tokenizer, messages[i + 1 : j], tools=tools, after_output=text)
        append_runs(sample, ids, sources)
        i = j
    return sample
