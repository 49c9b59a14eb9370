"""Synthetic tasks: prompts a tiny model can learn on a CPU, with their reward functions.

Every task makes prompts deterministically from `(seed, difficulty, split, index)`:
item i is drawn from its own seeded generator, so `make(n=10)[:5] == make(n=5)`
and two processes always agree. Train and held-out (`eval`) splits are disjoint
by construction: a question belongs to the eval split iff a stable hash of its
text falls in the first `EVAL_PERCENT` of 100 buckets. That keeps them disjoint
across seeds and difficulties too, so an eval set never leaks into training.
Within a split, items are drawn with replacement (the easiest levels hold only
a hundred or so distinct questions).

Prompt forms (`chat=False` / `chat=True`):

- text: the question followed by `" Answer:"`, e.g. `"What is 3 + 5? Answer:"`; a
  completion model answers with `" 8"`. This is the shape the local tokenizer's
  corpus was built from, so digits, operators and `Answer:` are cheap tokens.
- chat: `[{"role": "user", "content": "What is 3 + 5?"}]`, for the ChatML template;
  the assistant may answer `"8"` or `"Answer: 8"`.

Tasks (`TASKS[name]`):

- `arithmetic`: integer expressions; label is the int value. Difficulty d uses
  `2 + (d-1)//2` operands of up to `(d+1)//2` digits; d=1 adds, d=2..3 add and
  subtract, d>=4 may also hold one product. d=1 is single-digit addition (`3 + 5`).
- `reverse`: reverse a string of `d+2` lowercase letters; label is the reversed string.
- `sort`: sort the `d+2` letters of a string alphabetically; label is the sorted string.
- `calculator`: a multi-step expression meant to be solved with the `calculator`
  tool: a product of two numbers followed by d more `+`/`-` steps, every second
  step itself a product (`12 * 34 + 56`, `12 * 34 - 56 + 78 * 90`, ...); numbers
  have two digits, three from d=3.
  Label is the int value; metadata names the tool (`tool`) and carries its
  OpenAI-style schema (`tools`) for the chat template. `calculate()` is the tool.

Reward rule, `task.score(response_text, label) -> 1.0 | 0.0`:

1. The answer region is the text after the last `Answer:` (any case), or the whole
   response when there is none; it ends at the first `<|` (a leaked special token).
2. Integer tasks: the first integer (optional `-`, digits; `,` thousands separators
   allowed; not part of a decimal like `8.5`) in the region must equal the label. `"The answer is 8."` scores 1;
   `"Answer: 7 or 8"` scores 0 (only the first guess counts, so listing numbers
   cannot earn reward).
3. String tasks: the first non-empty line of the region, with spaces removed and
   one trailing `.` dropped, must equal the label exactly (letters are lowercase).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from furlong.data.datasets import Dataset, Prompt

EVAL_PERCENT = 10
SPLITS = ("train", "eval")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "integer + - * and parentheses",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

# A question is (text shown to the model, label, extra metadata).
Question = tuple[str, Any, dict[str, Any]]


# ---------------------------------------------------------------- the calculator
_TOKEN = re.compile(r"\s*(?:(\d+)|(\S))")


def calculate(expression: str, max_abs: int = 10**12) -> int:
    """Evaluate an integer expression of `+ - *`, unary minus and parentheses.

    This is the `calculator` tool's implementation and how arithmetic labels are
    computed. It is its own small parser rather than `eval` or `ast.parse`, so a
    model-written expression can do nothing but arithmetic, and it caps magnitudes
    so `9**9**9`-style blow-ups (built from repeated `*`) stop early. Raises
    ValueError on anything else. Why not `ast.parse`: CPython 3.11's AST builder
    keeps its recursion depth per interpreter, not per thread, so two threads
    parsing at once — ours (rewards run in `asyncio.to_thread`) or any library's —
    raised "SystemError: AST constructor recursion depth mismatch" (gh-106905) in
    the test suite, twice, even with our own calls serialised.

    Grammar (Python's precedence): expr = term (("+" | "-") term)*;
    term = unary ("*" unary)*; unary = ("+" | "-") unary | INT | "(" expr ")".
    """
    if len(expression) > 200:
        raise ValueError("calculator: expression longer than 200 characters")
    tokens: list[str | int] = []
    for number, other in _TOKEN.findall(expression.strip()):
        if number:
            tokens.append(int(number))
        elif other in "+-*()":
            tokens.append(other)
        else:
            raise ValueError(f"calculator: unsupported expression {expression!r}")
    pos = 0

    def peek() -> str | int | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str | int:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"calculator: cannot parse {expression!r}")
        pos += 1
        return tokens[pos - 1]

    def capped(value: int) -> int:
        if abs(value) > max_abs:
            raise ValueError(f"calculator: value exceeds {max_abs}")
        return value

    def unary() -> int:
        tok = take()
        if tok in ("+", "-"):
            return capped(unary() * (-1 if tok == "-" else 1))
        if tok == "(":
            value = expr()
            if take() != ")":
                raise ValueError(f"calculator: cannot parse {expression!r}")
            return value
        if isinstance(tok, int):
            return capped(tok)
        raise ValueError(f"calculator: unsupported expression {expression!r}")

    def term() -> int:
        value = unary()
        while peek() == "*":
            take()
            value = capped(value * unary())
        return value

    def expr() -> int:
        value = term()
        while peek() in ("+", "-"):
            op = take()
            value = capped(value + term() if op == "+" else value - term())
        return value

    value = expr()
    if pos != len(tokens):  # "1 2", "1)", or a trailing operator's leftovers
        raise ValueError(f"calculator: cannot parse {expression!r}")
    return value


# ---------------------------------------------------------------- scoring
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
# An integer not glued to a neighbouring number: "8.5" and "3,45" hold none.
_INT = re.compile(r"(?<![\d.,])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?!\d|[.,]\d)")


def answer_region(text: str) -> str:
    """The part of a response that holds the answer (rule 1 in the module docstring)."""
    marks = list(_ANSWER.finditer(text))
    if marks:
        text = text[marks[-1].end() :]
    return text.split("<|", 1)[0]


def score_integer(response_text: str, label: Any) -> float:
    """1.0 iff the first integer in the answer region equals `label`."""
    match = _INT.search(answer_region(response_text))
    if match is None:
        return 0.0
    return float(int(match.group().replace(",", "")) == int(label))


def score_string(response_text: str, label: Any) -> float:
    """1.0 iff the first non-empty line of the answer region, spaces removed, equals `label`."""
    for line in answer_region(response_text).splitlines():
        answer = "".join(line.split())
        if answer:
            return float(answer.removesuffix(".") == str(label))
    return 0.0


# ---------------------------------------------------------------- question generators
def _arithmetic(rng: random.Random, d: int) -> Question:
    n_operands, digits = 2 + (d - 1) // 2, (d + 1) // 2
    ops = "+" if d == 1 else "+-" if d < 4 else "+-*"
    terms = [str(rng.randrange(10**digits))]
    for _ in range(n_operands - 1):
        op = rng.choice(ops)
        ops = ops.replace("*", "") if op == "*" else ops  # one product at most keeps answers short
        terms += [op, str(rng.randrange(10**digits))]
    expr = " ".join(terms)
    return f"What is {expr}?", calculate(expr), {}


def _letters(rng: random.Random, d: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(d + 2))


def _reverse(rng: random.Random, d: int) -> Question:
    s = _letters(rng, d)
    return f"Reverse the string {s}.", s[::-1], {}


def _sort(rng: random.Random, d: int) -> Question:
    s = _letters(rng, d)
    return f"Sort the letters {s}.", "".join(sorted(s)), {}


def _calculator(rng: random.Random, d: int) -> Question:
    lo, hi = (10, 100) if d < 3 else (100, 1000)
    terms = [str(rng.randrange(lo, hi)), "*", str(rng.randrange(lo, hi))]
    for k in range(d):
        terms += [rng.choice("+-"), str(rng.randrange(lo, hi))]
        if k % 2:
            terms += ["*", str(rng.randrange(lo, hi))]
    expr = " ".join(terms)
    meta = {"tool": "calculator", "tools": [CALCULATOR_TOOL], "expression": expr}
    # Quoted, the expression tokenises exactly as it does inside the tool call's JSON string, so
    # a small model copies it token for token.
    return f'Use the calculator to compute "{expr}".', calculate(expr), meta


# ---------------------------------------------------------------- the task record
def split_of(task: str, question: str) -> str:
    """The split a question belongs to, from a stable hash of its text."""
    bucket = int.from_bytes(hashlib.sha256(f"{task}|{question}".encode()).digest()[:8], "big") % 100
    return "eval" if bucket < EVAL_PERCENT else "train"


@dataclass(frozen=True)
class Task:
    """A synthetic task: how to draw questions, and how to score an answer."""

    name: str
    question: Callable[[random.Random, int], Question]
    score: Callable[[str, Any], float]

    def make(
        self, split: str = "train", n: int = 1000, *, seed: int = 0, difficulty: int = 1, chat: bool = False
    ) -> Dataset:
        """`n` prompts of `split` ('train' or 'eval'), deterministic in every argument."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if difficulty < 1:
            raise ValueError(f"difficulty must be >= 1, got {difficulty}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        prompts = []
        for i in range(n):
            rng = random.Random(f"{self.name}:{seed}:{difficulty}:{split}:{i}")
            for _ in range(10_000):  # the eval split is ~10% of questions: ~10 draws
                text, label, meta = self.question(rng, difficulty)
                if split_of(self.name, text) == split:
                    break
            else:
                raise RuntimeError(f"task {self.name}: no {split} question found at difficulty {difficulty}")
            prompt: str | list[dict[str, Any]] = [{"role": "user", "content": text}] if chat else f"{text} Answer:"
            metadata = {"task": self.name, "split": split, "difficulty": difficulty, "question": text, **meta}
            prompts.append(Prompt(index=i, prompt=prompt, label=label, metadata=metadata))
        return Dataset(prompts, f"task:{self.name}:{split}:seed={seed}:difficulty={difficulty}")

    def answer(self, label: Any, chat: bool = False) -> str:
        """The reference response for a prompt (SFT warm-up targets): `" 8"` after `Answer:`, `"8"` in chat."""
        return f"{label}" if chat else f" {label}"


TASKS: dict[str, Task] = {
    "arithmetic": Task("arithmetic", _arithmetic, score_integer),
    "reverse": Task("reverse", _reverse, score_string),
    "sort": Task("sort", _sort, score_string),
    "calculator": Task("calculator", _calculator, score_integer),
}


def get_task(name: str) -> Task:
    """`TASKS[name]` with an error that lists the known tasks."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name]
