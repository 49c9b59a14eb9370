"""The official `openai` client against a furlong engine or router, unchanged.

The engine's `/v1/chat/completions` is OpenAI-compatible, and the router forwards it
byte for byte, so any OpenAI-speaking code can drive furlong's engines. On top of the
standard response, the engine answers two token-in-token-out extensions (vLLM's names):
`return_token_ids` adds `prompt_token_ids` and each choice's `token_ids`, so a harness
keeps the exact ids the engine produced instead of re-tokenising the text.

    furlong models create --arch qwen3 --size tiny           # prints the model directory
    furlong serve --model DIR --port 30001 &
    furlong router --engine http://127.0.0.1:30001 --port 30000 &
    python examples/openai_client/chat.py --base-url http://127.0.0.1:30000/v1

A tiny random-init model writes gibberish; what matters here is the shape of the answer:
text, one log-prob per generated token, and the token ids.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openai import OpenAI


def chat(base_url: str, question: str = "What is 2 + 3?", max_tokens: int = 16, seed: int = 0) -> dict[str, Any]:
    """One chat completion with log-probs and exact token ids; returns what an RL harness records."""
    client = OpenAI(base_url=base_url, api_key="unused")  # the engine checks no key on generation endpoints
    response = client.chat.completions.create(
        model="furlong",  # any name: one engine serves one model
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    extra = choice.model_extra or {}
    return {
        "text": choice.message.content,
        "finish_reason": choice.finish_reason,
        "logprobs": [t.logprob for t in choice.logprobs.content],
        "token_ids": extra.get("token_ids"),
        "prompt_token_ids": (response.model_extra or {}).get("prompt_token_ids"),
        "completion_tokens": response.usage.completion_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000/v1", help="engine or router URL ending in /v1")
    p.add_argument("--question", default="What is 2 + 3?")
    args = p.parse_args()
    print(json.dumps(chat(args.base_url, args.question), indent=2))


if __name__ == "__main__":
    main()
