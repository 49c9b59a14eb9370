"""The coding environment: unit tests graded in the sandbox, and its `python` tool."""

from __future__ import annotations

import asyncio

from furlong.core.sample import Sample
from furlong.envs.coding import CodingEnvironment, code_reward, data_source, extract_code, make_prompts
from furlong.envs.sandbox.base import SandboxLimits
from furlong.envs.sandbox.local import LocalSandbox

BOX = LocalSandbox(SandboxLimits(timeout_s=3.0))


def sample_for(prompt, answer: str) -> Sample:
    return Sample(prompt=prompt.prompt, label=prompt.label, metadata={**prompt.metadata, "response_text": answer})


def test_prompts_are_deterministic_and_solvable():
    prompts = make_prompts(12, seed=3)
    assert [p.prompt for p in make_prompts(12, seed=3)] == [p.prompt for p in prompts]
    assert [p.prompt for p in make_prompts(12, seed=4)] != [p.prompt for p in prompts]
    assert len(data_source(seed=0).next_batch(4)) == 4

    async def go():
        for p in prompts:  # every reference solution passes its own tests in the sandbox
            r = await code_reward(sample_for(p, f"```python\n{p.metadata['solution']}```"), BOX)
            assert r["score"] == 1.0, (p.prompt, p.metadata["solution"])

    asyncio.run(go())


def test_wrong_hanging_and_hostile_code_score_zero():
    p = make_prompts(1, seed=0)[0]
    name = p.metadata["entry_point"]

    async def go():
        wrong = await code_reward(sample_for(p, f"def {name}(x):\n    return None"), BOX)
        hang = await code_reward(sample_for(p, "```python\nwhile True:\n    pass\n```"), BOX)
        hostile = sample_for(p, "```python\nimport shutil\nshutil.rmtree('/work', ignore_errors=False)\n```")
        escape = await code_reward(hostile, BOX)
        return wrong, hang, escape, hostile

    wrong, hang, escape, hostile = asyncio.run(go())
    assert wrong["score"] == 0.0 and hang == {"score": 0.0, "timeout": 1.0} and escape["score"] == 0.0
    assert hostile.metadata["sandbox_status"] == "error"


def test_extract_code_takes_the_last_block():
    assert extract_code("a\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("def f(): pass<|im_end|>") == "def f(): pass"


def test_coding_environment_runs_the_python_tool():
    env = CodingEnvironment()
    s = Sample(metadata={"env": "coding"})
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    messages, done = asyncio.run(env.step(s, call))
    assert not done and messages[0]["content"] == "42\n\n[ok, exit code 0]"
