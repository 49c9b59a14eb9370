"""Writes math_word_{train,eval}.jsonl: multi-step arithmetic word problems with LaTeX answers.

    python recipes/data/make_math_word.py      # deterministic: the files in the repository are its output

Each problem chains two or three steps (buy, give away, share equally) so the answer is often a
fraction, written in LaTeX (`\\frac{7}{2}`); a response is scored by `furlong.rewards.math:
math_verify_reward`, which accepts any equal form (`3.5`, `\\boxed{\\frac{7}{2}}`, `7/2`).
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

NAMES = ["Ann", "Bo", "Cy", "Di", "Ed", "Flo"]
THINGS = ["apples", "pens", "cards", "shells", "coins"]


def latex(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"\\frac{{{x.numerator}}}{{{x.denominator}}}"


def problem(rng: random.Random) -> dict[str, str]:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    have, bags, per = rng.randint(1, 9), rng.randint(2, 4), rng.randint(2, 6)
    total = have + bags * per
    text = f"{who} has {have} {what} and buys {bags} bags of {per} {what}."
    if rng.random() < 0.5:
        gone = rng.randint(1, total - 1)
        total -= gone
        text += f" {who} gives away {gone}."
    friends = rng.randint(2, 4)
    text += f" {who} shares them equally among {friends} friends. How many {what} does each friend get?"
    return {
        "prompt": text + " Put the final answer in \\boxed{}.",
        "label": latex(Fraction(total, friends)),
        "response": f" \\boxed{{{latex(Fraction(total, friends))}}}",
    }


def main() -> None:
    here = Path(__file__).resolve().parent
    rng = random.Random(0)
    seen: set[str] = set()
    rows = []
    while len(rows) < 240:
        p = problem(rng)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            rows.append(p)
    for name, part in (("train", rows[:200]), ("eval", rows[200:])):
        (here / f"math_word_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
