"""The coding environment: write a Python function, graded by unit tests in the sandbox.

Problems are synthetic and deterministic (`make_prompts(n, seed)`), each a short
spec with hidden `assert` tests, e.g. "Write a Python function `add_7(x)` that
returns x plus 7." The model answers with code (a ```python block, or bare code);
during the episode it may call the `python` tool to run a snippet in the sandbox
and see its output. The reward (`code_reward`, also usable alone as
`rollout.reward_fn: furlong.envs.coding:code_reward`) runs the final turn's code
followed by the tests in the sandbox: `score` 1.0 iff every test passes.

Model code is never run in the trainer's process: always in the sandbox (see
`sandbox.py` for what an escape attempt runs into).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from furlong.core import spans
from furlong.core.sample import Sample
from furlong.data.datasets import Prompt
from furlong.envs.protocol import ToolEnvironment, final_text
from furlong.envs.sandbox.factory import build_sandbox
from furlong.envs.sandbox.local import LocalSandbox

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program in a sandbox and return its stdout and stderr.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)

# (name template, spec, reference solution, test inputs) — {k} is drawn per problem.
PROBLEMS: list[tuple[str, str, Callable[[int, Any], Any], list[Any]]] = [
    ("add_{k}", "returns x plus {k}", lambda k, x: x + k, [0, 1, -5, 100]),
    ("times_{k}", "returns x multiplied by {k}", lambda k, x: x * k, [0, 2, -3, 11]),
    (
        "is_multiple_of_{k}",
        "returns True if x is a multiple of {k}, else False",
        lambda k, x: x % k == 0,
        [0, 1, 6, 12, 35],
    ),
    ("repeat_{k}", "returns the string s repeated {k} times", lambda k, s: s * k, ["", "a", "xy"]),
    ("last_{k}", "returns the last {k} characters of the string s", lambda k, s: s[-k:], ["abcdefgh", "hello world"]),
    (
        "count_{k}s",
        "returns how many times the digit {k} occurs in the decimal digits of the non-negative integer x",
        lambda k, x: str(x).count(str(k)),
        [0, 7, 1234567, 777, 90909],
    ),
]


def make_problem(rng: random.Random) -> dict[str, Any]:
    name_t, spec_t, ref, inputs = rng.choice(PROBLEMS)
    k = rng.randrange(2, 10)
    name, spec = name_t.format(k=k), spec_t.format(k=k)
    arg = "s" if isinstance(inputs[0], str) else "x"
    tests = "\n".join(f"assert {name}({x!r}) == {ref(k, x)!r}, {f'failed on {name}({x!r})'!r}" for x in inputs)
    return {
        "question": f"Write a Python function `{name}({arg})` that {spec}.",
        "entry_point": name,
        "tests": tests,
        "solution": f"def {name}({arg}):\n    return {_ref_expr(name_t, k, arg)}\n",
    }


def _ref_expr(name_t: str, k: int, arg: str) -> str:
    return {
        "add_{k}": f"{arg} + {k}",
        "times_{k}": f"{arg} * {k}",
        "is_multiple_of_{k}": f"{arg} % {k} == 0",
        "repeat_{k}": f"{arg} * {k}",
        "last_{k}": f"{arg}[-{k}:]",
        "count_{k}s": f"str({arg}).count('{k}')",
    }[name_t]


def make_prompts(n: int, seed: int = 0, *, tool: bool = True) -> list[Prompt]:
    """`n` coding prompts (chat messages), deterministic in (n, seed); tests and a reference solution in metadata."""
    out = []
    for i in range(n):
        p = make_problem(random.Random(f"coding:{seed}:{i}"))
        meta = {"env": "coding", "tests": p["tests"], "entry_point": p["entry_point"], "solution": p["solution"]}
        if tool:
            meta["tools"] = [PYTHON_TOOL]
        text = p["question"] + " Reply with the code in a ```python block."
        out.append(Prompt(index=i, prompt=[{"role": "user", "content": text}], label=p["tests"], metadata=meta))
    return out


def data_source(config: Any = None, seed: int = 0) -> Any:
    """The `rollout.data_source` plug point for coding prompts (a resumable, shuffled DataSource)."""
    from furlong.data import DataSource

    return DataSource(make_prompts(1000, seed), seed=seed)


def extract_code(text: str) -> str:
    """The last ```python block of a response, or the response itself when it has none."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text.split("<|", 1)[0]


_DEFAULT_SANDBOX: LocalSandbox | None = None


def _sandbox() -> LocalSandbox:
    global _DEFAULT_SANDBOX
    if _DEFAULT_SANDBOX is None:
        _DEFAULT_SANDBOX = LocalSandbox()
    return _DEFAULT_SANDBOX


async def run_tests(code: str, tests: str, sandbox: Any = None, timeout_s: float | None = None) -> dict[str, Any]:
    """Run `code` then `tests` in the sandbox (its own time limit unless `timeout_s`); its result plus `passed`."""
    with spans.span("env", "sandbox-run", purpose="tests") as attrs:  # the test run's latency on the env lane
        result = await (sandbox or _sandbox()).run(f"{code}\n\n{tests}\n", timeout_s=timeout_s)
        attrs["status"] = result["status"]
    return {**result, "passed": result["status"] == "ok"}


async def code_reward(sample: Sample, sandbox: Any = None) -> dict[str, float]:
    """Code-execution reward: 1.0 iff the final turn's code passes the sample's tests in the sandbox."""
    tests = sample.metadata.get("tests") or sample.label
    if not tests:
        raise ValueError("code_reward: the sample has no tests (metadata['tests'] or label)")
    result = await run_tests(extract_code(final_text(sample)), str(tests), sandbox)
    sample.metadata["sandbox_status"] = result["status"]
    return {"score": float(result["passed"]), "timeout": float(result["timed_out"])}


def describe(result: dict[str, Any]) -> str:
    """A sandbox result as the `python` tool shows it to the model."""
    parts = [result["stdout"]] + ([f"stderr:\n{result['stderr']}"] if result["stderr"] else [])
    return "\n".join(parts + [f"[{result['status']}, exit code {result['exit_code']}]"])


async def python(code: str) -> str:
    """The `python` tool: run a snippet in the default sandbox; stdout, stderr and how it ended."""
    return describe(await _sandbox().run(str(code)))


class CodingEnvironment(ToolEnvironment):
    """Coding with an optional `python` tool; reward from the tests, run in the configured sandbox."""

    def __init__(self, config: EnvsConfig | None = None, tool_fn: Any = None):
        self.sandbox = build_sandbox(config) if config is not None else _sandbox()
        timeout_s = getattr(config, "timeout_s", 10.0)
        super().__init__({"python": self._python}, timeout_s=timeout_s + 5.0, tool_fn=tool_fn)

    async def _python(self, code: str) -> str:
        return describe(await self.sandbox.run(str(code), timeout_s=self.timeout_s - 5.0))

    async def reward(self, sample: Sample) -> dict[str, float]:
        return await code_reward(sample, self.sandbox)
