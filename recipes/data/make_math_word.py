"""Writes math_word_{train,eval}.jsonl: multi-step arithmetic word problems with LaTeX answers.

    python recipes/data/make_math_word.py      # deterministic: the files in the repository are its output
    python recipes/data/make_math_word.py --easy --out DIR   # one-step problems, for a test's shortened run

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


def easy_problem(rng: random.Random) -> dict[str, str]:
    """One step, answer in the prompt ("Bo has 7 coins. ... \\boxed{7}"): a tiny model reads it off within a
    test's budget, so a shortened run of the recipe can show its reward (math-verify) climbing."""
    who, what, have = rng.choice(NAMES), rng.choice(THINGS), rng.randint(1, 9)
    return {
        "prompt": f"{who} has {have} {what}. How many {what} does {who} have? Put the final answer in \\boxed{{}}.",
        "label": str(have),
        "response": f" \\boxed{{{have}}}",
    }


def write(out: Path, easy: bool = False) -> list[Path]:
    """math_word_{train,eval}.jsonl under `out`: 240 distinct problems of one seeded stream, the first 200 to
    train on, the last 40 held out."""
    rng = random.Random(0)
    seen: set[str] = set()
    rows = []
    while len(rows) < 240:
        p = easy_problem(rng) if easy else problem(rng)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            rows.append(p)
    paths = []
    for name, part in (("train", rows[:200]), ("eval", rows[200:])):
        paths.append(out / f"math_word_{name}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--easy", action="store_true", help="one-step problems whose answer is in the prompt")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="output folder")
    args = ap.parse_args()
    write(args.out, easy=args.easy)


if __name__ == "__main__":
    main()
