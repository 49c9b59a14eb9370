"""LLM-judge reward: a served model reads the question, the reference and the response, and says yes or no.

The judge is any engine serving the OpenAI chat API (`furlong serve` does, at `/v1/chat/completions`;
so do SGLang and vLLM), at the URL in `$FURLONG_JUDGE_URL` (a plug point receives only the sample,
so its settings travel in the environment; `FURLONG_JUDGE_MODEL` names the model when the server
wants one). It answers at temperature 0 in at most a few tokens; the score is 1.0 when its reply
starts with "yes". A judge that is down makes the reward raise: the sample is marked failed with
the reason and its group dropped (`reward_error`), as for any reward.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from furlong.core.net import tls_context

PROMPT = (
    "You grade answers. Question:\n{question}\n\nReference answer:\n{reference}\n\n"
    "Response to grade:\n{response}\n\nIs the response's final answer correct? Reply with yes or no."
)
TIMEOUT_S = 60.0


def judge_url() -> str:
    url = os.environ.get("FURLONG_JUDGE_URL")
    if not url:
        raise ValueError("llm_judge_reward: set FURLONG_JUDGE_URL to the judge engine's base URL")
    return url.rstrip("/")


async def judge(question: str, reference: str, response: str, *, url: str | None = None) -> str:
    """The judge's reply text to one grading request."""
    body = {
        "messages": [
            {"role": "user", "content": PROMPT.format(question=question, reference=reference, response=response)}
        ],
        "temperature": 0.0,
        "max_tokens": 4,
    }
    if os.environ.get("FURLONG_JUDGE_MODEL"):
        body["model"] = os.environ["FURLONG_JUDGE_MODEL"]
    async with httpx.AsyncClient(timeout=TIMEOUT_S, verify=tls_context()) as http:
        r = await http.post(f"{url or judge_url()}/v1/chat/completions", json=body)
        r.raise_for_status()
        return str(r.json()["choices"][0]["message"]["content"] or "")


async def llm_judge_reward(sample: Any) -> dict[str, float]:
    """1.0 when the judge says the response's answer matches `sample.label`."""
    question = sample.metadata.get("question") or (
        sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt[-1].get("content", ""))
    )
    reply = await judge(str(question), str(sample.label), str(sample.metadata.get("response_text", "")))
    return {"score": float(reply.strip().lower().startswith("yes"))}
