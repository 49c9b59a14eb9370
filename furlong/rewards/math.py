"""Math rewards: `math-verify` equivalence of the final answer, and GSM8K's final-number match.

`math-verify` (Hugging Face) parses LaTeX, `\\boxed{}` answers and plain expressions into SymPy
and compares them (`1/2` = `0.5` = `\\frac{1}{2}`). Its own timeout uses `signal.alarm`, which
works only in a main thread, and a reward runs on the driver's event loop or in a thread pool;
so both of its timeouts are switched off (`parsing_timeout=None`, `timeout_seconds=None`) and
furlong enforces its own: the check runs in one spawned worker process, and a check that runs
past `MATH_TIMEOUT_S` scores 0 (`timeout: 1` in the reward) and the worker is killed and
replaced. A pathological expression can then cost seconds, never the run.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import re
from concurrent.futures import ProcessPoolExecutor
from typing import Any

MATH_TIMEOUT_S = 10.0  # per sample (worker start-up included on the first call)
_POOL: ProcessPoolExecutor | None = None
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _response(sample: Any) -> str:
    return str(sample.metadata.get("response_text", "")).split("<|", 1)[0]


def verify_answer(gold: str, answer: str) -> bool:
    """math-verify's verdict (run in the worker): does `answer` hold an answer equal to `gold`?"""
    from math_verify import parse, verify

    g = parse(gold if "$" in gold else f"${gold}$", parsing_timeout=None)
    a = parse(answer, parsing_timeout=None)
    return bool(g) and bool(a) and bool(verify(g, a, timeout_seconds=None))


def _pool() -> ProcessPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
    return _POOL


def _kill_pool() -> None:
    """The worker is stuck in SymPy: kill it (threads cannot be stopped; processes can); the next call starts one."""
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None:
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)


async def check(gold: str, answer: str, timeout_s: float = MATH_TIMEOUT_S) -> tuple[bool, bool]:
    """(equal, timed out) for one answer against its gold, under furlong's timeout."""
    fut = asyncio.get_running_loop().run_in_executor(_pool(), verify_answer, str(gold), answer)
    try:
        return await asyncio.wait_for(fut, timeout_s), False
    except TimeoutError:
        _kill_pool()
        return False, True


async def math_verify_reward(sample: Any) -> dict[str, float]:
    """1.0 when the response's answer (`\\boxed{}` first, else the last expression) equals `sample.label`."""
    ok, timed_out = await check(str(sample.label), _response(sample))
    return {"score": float(ok), "timeout": float(timed_out)}


def final_number(text: str) -> float | None:
    """GSM8K's convention: the number after `####`, else the last number in the text (`1,234` = 1234)."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    found = NUMBER.findall(tail if "####" in text else text)
    if not found:
        return None
    pick = found[0] if "####" in text else found[-1]
    try:
        return float(pick.replace(",", ""))
    except ValueError:
        return None


def gsm8k_reward(sample: Any) -> float:
    """1.0 when the response's final number equals the label's (the label may be `#### 42` or `42`)."""
    want = final_number(str(sample.label))
    got = final_number(_response(sample))
    return float(want is not None and got is not None and abs(want - got) < 1e-6)
