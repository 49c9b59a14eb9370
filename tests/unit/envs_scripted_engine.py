"""A scripted `/generate` for the envs tests: replays model turns given as text, records every request.

Each turn's text is encoded with the real tokenizer (plus `<|im_end|>` unless
`end=False`), so tests can check token by token what a Sample holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import httpx

from furlong.core.client import EngineClient
from furlong.rollout.generate import RolloutContext


@dataclass
class Turn:
    text: str
    version: int = 0
    finish: str = "stop"
    end: bool = True  # the model wrote <|im_end|>


class Script:
    """A `/generate` that replays scripted turns and records every request."""

    def __init__(self, tok, turns: list[Turn]):
        self.tok, self.turns, self.requests = tok, list(turns), []
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def outputs(self, turn: Turn) -> list[int]:
        return list(self.tok.encode(turn.text, add_special_tokens=False)) + ([self.im_end] if turn.end else [])

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        body["headers"] = dict(request.headers)
        self.requests.append(body)
        turn = self.turns.pop(0)
        limit = body["sampling_params"].get("max_new_tokens", 128)
        ids = self.outputs(turn)[:limit]
        finish = turn.finish if len(ids) < limit or turn.finish != "stop" else "length"
        meta = {
            "finish_reason": {"type": finish},
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "output_token_versions": [turn.version] * len(ids),
            "weight_version": turn.version,
        }
        return httpx.Response(200, json={"output_ids": ids, "text": "", "meta_info": meta})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)

    def ctx(self, **rollout) -> RolloutContext:
        client = EngineClient("http://engine", transport=httpx.MockTransport(self.handler))
        cfg = SimpleNamespace(**{"max_turns": 4, "reward_fn": None, "group_reward_fn": None, **rollout})
        return RolloutContext(client=client, tokenizer=self.tok, config=cfg)
