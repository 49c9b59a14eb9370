"""Synthetic tasks: determinism, disjoint splits, correct labels, and the reward rule on tricky strings."""

from __future__ import annotations

import re

import pytest

from furlong.data import CALCULATOR_TOOL, TASKS, Prompt, calculate, get_task
from furlong.data.tasks import split_of


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_and_prefix_stable(name):
    task = TASKS[name]
    a = task.make("train", 50, seed=3, difficulty=2)
    assert list(a) == list(task.make("train", 50, seed=3, difficulty=2))
    assert list(task.make("train", 20, seed=3, difficulty=2)) == list(a)[:20]
    assert [p.prompt for p in a] != [p.prompt for p in task.make("train", 50, seed=4, difficulty=2)]
    assert [p.prompt for p in a] != [p.prompt for p in task.make("train", 50, seed=3, difficulty=3)]
    assert [p.index for p in a] == list(range(50))


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("difficulty", [1, 2, 4])
def test_eval_split_never_in_train(name, difficulty):
    task = TASKS[name]
    evals = {p.metadata["question"] for p in task.make("eval", 200, seed=0, difficulty=difficulty)}
    trains = set()
    for seed in range(3):  # disjoint across seeds too: the split is a property of the question
        trains |= {p.metadata["question"] for p in task.make("train", 500, seed=seed, difficulty=difficulty)}
    assert evals and trains and not evals & trains
    assert all(split_of(name, q) == "eval" for q in evals)


def test_smallest_space_has_both_splits():
    """Single-digit addition has 100 questions; about 10 of them are held out."""
    evals = {p.prompt for p in TASKS["arithmetic"].make("eval", 300, difficulty=1)}
    trains = {p.prompt for p in TASKS["arithmetic"].make("train", 2000, difficulty=1)}
    assert 3 <= len(evals) <= 20 and len(evals) + len(trains) == 100


def test_text_and_chat_forms_share_questions():
    text = TASKS["arithmetic"].make("train", 5, seed=1)
    chat = TASKS["arithmetic"].make("train", 5, seed=1, chat=True)
    for t, c in zip(text, chat):
        assert t.prompt == c.metadata["question"] + " Answer:"
        assert c.prompt == [{"role": "user", "content": c.metadata["question"]}]
        assert t.label == c.label


def test_difficulty_one_is_single_digit_addition():
    for p in TASKS["arithmetic"].make("train", 100, difficulty=1):
        a, b = re.fullmatch(r"What is (\d) \+ (\d)\? Answer:", p.prompt).groups()
        assert p.label == int(a) + int(b)


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 6])
def test_arithmetic_and_calculator_labels(difficulty):
    for name in ("arithmetic", "calculator"):
        for p in TASKS[name].make("train", 30, seed=7, difficulty=difficulty):
            expr = re.search(r'(?:What is|compute) "?(.*?)"?[?.]$', p.metadata["question"]).group(1)
            assert p.label == eval(expr)  # trusted: the test's own generated text
            assert TASKS[name].score(f"Answer: {p.label}", p.label) == 1.0


def test_calculator_metadata_names_the_tool():
    p = TASKS["calculator"].make("eval", 1, seed=0, chat=True)[0]
    assert p.metadata["tool"] == "calculator" and p.metadata["tools"] == [CALCULATOR_TOOL]
    assert calculate(p.metadata["expression"]) == p.label
    assert "*" in p.metadata["expression"]


@pytest.mark.parametrize("name,transform", [("reverse", lambda s: s[::-1]), ("sort", lambda s: "".join(sorted(s)))])
def test_string_task_labels(name, transform):
    for d in (1, 3):
        for p in TASKS[name].make("train", 20, difficulty=d):
            letters = re.search(r" ([a-z]+)\.$", p.metadata["question"]).group(1)
            assert len(letters) == d + 2 and p.label == transform(letters)


@pytest.mark.parametrize(
    "response,label,reward",
    [
        (" 8", 8, 1.0),
        ("8<|im_end|>", 8, 1.0),
        ("Answer: 8", 8, 1.0),
        ("answer:8.", 8, 1.0),
        ("The answer is 8.", 8, 1.0),
        ("Let me think: 3 + 5 = 8. Answer: 8", 8, 1.0),  # the last Answer: decides
        ("Answer: 7. No wait. Answer: 8", 8, 1.0),
        ("Answer: 7 or 8", 8, 0.0),  # only the first guess counts
        ("3 + 5 = 8", 8, 0.0),  # no marker: the first integer, 3
        ("Answer: 8.5", 8, 0.0),
        ("Answer: 88", 8, 0.0),
        ("Answer: -3", -3, 1.0),
        ("Answer: 3", -3, 0.0),
        ("Answer: 1,234", 1234, 1.0),
        ("Answer: 12,34", 1234, 0.0),
        ("Answer: <|im_end|> 8", 8, 0.0),
        ("", 8, 0.0),
        ("no number here", 8, 0.0),
        ("Answer: 0008", 8, 1.0),
    ],
)
def test_integer_reward(response, label, reward):
    assert TASKS["arithmetic"].score(response, label) == reward
    assert TASKS["calculator"].score(response, label) == reward


@pytest.mark.parametrize(
    "response,reward",
    [
        (" cba", 1.0),
        ("cba<|im_end|>", 1.0),
        ("Answer: cba.", 1.0),
        ("Answer: c b a", 1.0),
        ("\n\n cba\nmore text", 1.0),
        ("Reverse the string abc. Answer: cba", 1.0),
        ("Answer: CBA", 0.0),
        ("Answer: cb", 0.0),
        ("Answer: cbaa", 0.0),
        ("cba is the answer", 0.0),  # the whole first line must be the answer
        ("", 0.0),
        ("   \n ", 0.0),
    ],
)
def test_string_reward(response, reward):
    assert TASKS["reverse"].score(response, "cba") == reward


@pytest.mark.parametrize(
    "expression,value",
    [("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-4 - -4", 0), ("12*34+56", 464), (" 7 ", 7)],
)
def test_calculate(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os')", "2 ** 10", "7 / 2", "1.5 + 1", "x + 1", "1 +", "True + 1", "9" * 20, "1+" * 150 + "1"],
)
def test_calculate_refuses_everything_else(expression):
    with pytest.raises(ValueError, match="calculator"):
        calculate(expression)


def test_registry_and_argument_errors():
    assert sorted(TASKS) == ["arithmetic", "calculator", "reverse", "sort"]
    assert get_task("sort") is TASKS["sort"]
    with pytest.raises(KeyError, match=r"unknown task 'add'; known tasks: \['arithmetic'"):
        get_task("add")
    with pytest.raises(ValueError, match="split must be one of"):
        TASKS["sort"].make("test", 1)
    with pytest.raises(ValueError, match="difficulty must be >= 1"):
        TASKS["sort"].make("train", 1, difficulty=0)
    assert isinstance(TASKS["sort"].make("train", 1)[0], Prompt)


def test_chat_prompts_render_with_the_tiny_models_template():
    from furlong.models import create_model, load_tokenizer

    tok = load_tokenizer(create_model("qwen3", "tiny"))
    for name, task in TASKS.items():
        p = task.make("train", 1, seed=0, chat=True)[0]
        text = tok.apply_chat_template(
            p.prompt, tools=p.metadata.get("tools"), add_generation_prompt=True, tokenize=False
        )
        assert text.endswith(f"<|im_start|>user\n{p.metadata['question']}<|im_end|>\n<|im_start|>assistant\n")
        assert ("- calculator(expression): " in text) == (name == "calculator")  # the tool's compact signature
        # Short text prompts: a handful of tokens, so a tiny model learns them on a CPU.
        assert len(tok(task.make("train", 1, seed=0)[0].prompt)["input_ids"]) <= 20


def test_calculate_equals_python_on_random_expressions_without_the_ast_module(monkeypatch):
    """Its own parser: the same values as Python's arithmetic (precedence, unary signs, parentheses), and
    no `ast.parse`, whose builder two threads at once break on CPython 3.11 (gh-106905)."""
    import ast
    import random

    def forbidden(*a, **k):
        raise AssertionError("calculate called ast.parse")

    def gen(rng: random.Random, depth: int) -> str:
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(["", "-", "+", "- -"]) + str(rng.randrange(1000))
        inner = f"{gen(rng, depth - 1)} {rng.choice('+-*')} {gen(rng, depth - 1)}"
        return f"({inner})" if rng.random() < 0.5 else inner

    want = {}
    rng = random.Random(0)
    for _ in range(300):
        e = gen(rng, 3)
        if len(e) <= 200:
            want[e] = eval(e)  # noqa: S307 - digits, signs, operators and parentheses only
    monkeypatch.setattr(ast, "parse", forbidden)
    for e, v in want.items():
        if abs(v) <= 10**12:
            assert calculate(e) == v, e
    assert len(want) > 200
