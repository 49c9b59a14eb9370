"""Code-execution reward: the response's program against the sample's test cases, in the sandbox.

`sample.metadata["test_cases"]` holds assert statements (`assert add(2, 3) == 5`); the program
(the last ```python block of the response, or the whole response) runs once in the sandbox with a
harness that runs each case apart and counts the passes, so one failing case does not hide the
others. The score is the fraction passed (1.0 = all); `sandbox_ok` says the program itself ran.
The sandbox is `envs/sandbox` (bubblewrap namespaces when available, else rlimits), with its
own time, memory and output limits.
"""

from __future__ import annotations

import json
import re
from typing import Any

from furlong.envs.coding import extract_code, run_tests

HARNESS = """
import json as _json
_cases = _json.loads({cases!r})
_passed = 0
for _case in _cases:
    try:
        exec(_case, globals())
        _passed += 1
    except BaseException:
        pass
print("FURLONG_TESTS_PASSED", _passed, len(_cases))
"""
PASSED = re.compile(r"FURLONG_TESTS_PASSED (\d+) (\d+)")


async def score_code(code: str, cases: list[str], sandbox: Any = None, timeout_s: float | None = None) -> dict:
    """{"score": passed / total, "passed", "total", "sandbox_ok"} for `code` against assert `cases`."""
    result = await run_tests(code, HARNESS.format(cases=json.dumps(list(cases))), sandbox, timeout_s)
    found = PASSED.findall(str(result.get("stdout", "")))
    passed, total = (int(found[-1][0]), int(found[-1][1])) if found else (0, len(cases))
    return {
        "score": passed / total if total else 0.0,
        "passed": float(passed),
        "total": float(total),
        "sandbox_ok": float(bool(found)),
    }


async def code_tests_reward(sample: Any) -> dict[str, float]:
    """The fraction of `sample.metadata["test_cases"]` the response's code passes."""
    cases = sample.metadata.get("test_cases")
    if not cases:
        raise ValueError("code_tests_reward: the sample has no metadata['test_cases'] (assert statements)")
    text = str(sample.metadata.get("response_text", ""))
    return await score_code(extract_code(text), list(cases))
