"""Format rewards: is the response shaped as asked (reasoning in `<think>`, the answer in `<answer>`)?

Used alone for a format warm-up, or added to a correctness reward through a `reward_fn` that
returns a dict (`{"score": correct + 0.1 * format, "format": ...}`: every key is logged).
"""

from __future__ import annotations

import re
from typing import Any

THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>(.*?)</answer>\s*$", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _response(sample: Any) -> str:
    return str(sample.metadata.get("response_text", "")).split("<|", 1)[0]


def think_answer_format(sample: Any) -> float:
    """1.0 for exactly `<think>...</think>` then `<answer>...</answer>` (whitespace around them allowed)."""
    return float(THINK_ANSWER.match(_response(sample)) is not None)


def answer_text(text: str) -> str | None:
    """The last `<answer>` block's text, stripped; None without one."""
    found = ANSWER.findall(text)
    return found[-1].strip() if found else None


def answer_tag_reward(sample: Any) -> dict[str, float]:
    """1.0 when the `<answer>` block equals the label exactly; logs the format apart (`format`)."""
    got = answer_text(_response(sample))
    return {"score": float(got is not None and got == str(sample.label).strip()), "format": think_answer_format(sample)}
