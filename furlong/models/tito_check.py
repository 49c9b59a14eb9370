"""`furlong tito check MODEL_DIR`: does this model's chat template continue token-in-token-out?

Why: a multi-turn rollout never re-tokenises what came before. It keeps the ids the
engine produced for every assistant turn and appends only what follows (the template's
glue, the tool results, the next generation prompt; `chat.suffix_ids`). Training on such
a trajectory is only sound if those ids are the ones the template would give the whole
conversation rendered at once — otherwise the trainer scores a sequence the model would
never see in deployment. Templates break this in ordinary ways: Qwen3's drops the
`<think>` block of earlier turns, some add a newline only after the last turn, a BPE
merge can straddle a turn boundary. This check builds a multi-turn, tool-using
conversation turn by turn exactly as the rollout does, renders it whole, and compares
the ids; it also checks that the SFT path (`chat.conversation_sample`) trains exactly the
tokens a rollout's engine produced. A mismatch is shown at its first differing position.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from furlong.data.chat import (
    TemplateError,
    assistant_text,
    conversation_sample,
    encode_prompt,
    end_of_turn,
    missing_closing,
    suffix_ids,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluate arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def _call(expression: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


# Reasoning in every assistant turn, a tool call and its result, two user turns: the shapes templates rewrite.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 17 * 23?"},
    {"role": "assistant", "content": "<think>\nI should use the tool.\n</think>\n\n", "tool_calls": [_call("17*23")]},
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "<think>\nThe tool said 391.\n</think>\n\nThe answer is 391."},
    {"role": "user", "content": "And 391 + 9?"},
    {"role": "assistant", "content": "<think>\nAdd 9.\n</think>\n\n400"},
]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class TitoReport:
    """The verdict: every check, and the first position where turn-by-turn and whole differ (None: none)."""

    checks: list[Check] = field(default_factory=list)
    first_diff: int | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def text(self) -> str:
        lines = [f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        verdict = "PASS: the template continues token-in-token-out" if self.ok else "FAIL"
        if self.first_diff is not None:
            verdict += f" (first differing position: {self.first_diff})"
        return "\n".join([*lines, verdict])


@dataclass
class TurnByTurn:
    """A conversation built as a rollout builds it: ids, and which of them the engine produced."""

    ids: list[int] = field(default_factory=list)
    produced: list[bool] = field(default_factory=list)
    last_output: str = ""

    def add(self, ids: list[int], produced: bool) -> None:
        self.ids.extend(ids)
        self.produced.extend([produced] * len(ids))


def build_turn_by_turn(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> TurnByTurn:
    """The prompt, then per assistant turn what the engine emits (its text + end of turn), then `suffix_ids`."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    out = TurnByTurn()
    out.add(encode_prompt(tok, messages[:first], tools), False)
    end = end_of_turn(tok)
    i = first
    while i < len(messages):
        text = assistant_text(tok, messages[i], tools) + end
        out.add(tok.encode(text, add_special_tokens=False), True)
        out.last_output = text
        j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
        if j < len(messages):
            out.add(suffix_ids(tok, messages[i + 1 : j], tools=tools, after_output=text)[0], False)
        i = j
    return out


def _tokens(tok: Any, ids: list[int], at: int, width: int = 3) -> str:
    lo, hi = max(0, at - width), min(len(ids), at + width + 1)
    shown = [("»" if k == at else "") + repr(tok.decode([ids[k]])) for k in range(lo, hi)]
    return " ".join(shown) or "(end)"


def first_difference(a: list[int], b: list[int]) -> int | None:
    n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None and len(a) != len(b):
        n = min(len(a), len(b))
    return n


def check_tokenizer(
    tok: Any, messages: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None
) -> TitoReport:
    """Run every check on a tokenizer (with its chat template) and return the report."""
    messages = CONVERSATION if messages is None else messages
    tools = TOOLS if tools is None else tools
    report = TitoReport()
    if not getattr(tok, "chat_template", None):
        report.checks.append(Check("chat template", False, "the tokenizer has no chat template"))
        return report
    try:
        end = end_of_turn(tok)
        built = build_turn_by_turn(tok, messages, tools)
        sft = conversation_sample(tok, messages, tools)
    except (TemplateError, ValueError) as e:
        report.checks.append(Check("turn by turn", False, str(e)))
        return report
    report.checks.append(Check("end of turn", True, f"{end!r} (from the template's closing)"))
    # Append-only: built turn by turn (+ the closing the last turn leaves open) == rendered at once.
    closed = built.ids + tok.encode(missing_closing(tok, built.last_output), add_special_tokens=False)
    whole = encode_whole(tok, messages, tools)
    n = first_difference(closed, whole)
    if n is None:
        report.checks.append(Check("append-only", True, f"{len(whole)} tokens, turn by turn == whole"))
    else:
        report.first_diff = n
        detail = (
            f"position {n}: turn by turn {_tokens(tok, closed, n)} | whole {_tokens(tok, whole, n)}"
            f" ({len(closed)} vs {len(whole)} tokens)"
        )
        report.checks.append(Check("append-only", False, detail))
    # Trainable tokens: what SFT trains is exactly what the engine produced, at the same positions.
    trained = [0] * sft.prompt_length + list(sft.loss_mask)
    produced = [int(p) for p in built.produced]
    m = first_difference(sft.tokens, built.ids) if sft.tokens != built.ids else first_difference(trained, produced)
    if m is None:
        report.checks.append(Check("trainable tokens", True, f"{sum(trained)} trained, all produced by the engine"))
    else:
        report.first_diff = m if report.first_diff is None else min(report.first_diff, m)
        report.checks.append(Check("trainable tokens", False, f"position {m}: {_tokens(tok, built.ids, m)}"))
    return report


def encode_whole(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=False, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


def check_model_dir(path: str | Path) -> TitoReport:
    """Load MODEL_DIR's tokenizer (`models.load_tokenizer`: a clear error for a missing directory) and check it."""
    from furlong.models.loading import load_tokenizer

    return check_tokenizer(load_tokenizer(path))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="furlong tito", description="token-in-token-out conformance of a chat template")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check MODEL_DIR's chat template; exits 1 on a mismatch")
    c.add_argument("model_dir")
    args = p.parse_args(argv)
    try:
        report = check_model_dir(args.model_dir)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"furlong tito check: {e}", file=sys.stderr)
        return 2
    print(f"tito check {args.model_dir}")
    print(report.text())
    return 0 if report.ok else 1
