"""A stand-in engine for the rollout tests: the `/generate` contract, deterministic, in-process.

Each token is a pure function of (seed, weight version, context length, last
token), drawn one at a time with an `await` between tokens, so requests interleave,
can be aborted mid-way and cross a weight-version bump like a real engine. Each
token is stamped with the version current when it was made. Greedy requests
(temperature 0) ignore the seed. Served through `httpx.ASGITransport`, so the real
`EngineClient` speaks HTTP/JSON to it without a socket.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request

EOS = 0
VOCAB = 40


def _h(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest(), "big")


class FakeEngine:
    def __init__(self, *, token_delay_s: float = 0.0, admin_token: str = "T"):
        self.version = 0
        self.token_delay_s = token_delay_s
        self.admin_token = admin_token
        self.aborted: set[str] = set()
        self.active: dict[str, list[int]] = {}  # rid -> tokens generated so far
        self.max_active = 0
        self.log: list[dict[str, Any]] = []  # every finished request: rid, input_ids, output, versions, finish
        self.fail_prefix: set[int] = set()  # first prompt token ids whose requests get 503
        self._running = asyncio.Event()
        self._running.set()
        self.app = self._build()

    def transport(self) -> httpx.ASGITransport:
        return httpx.ASGITransport(app=self.app)

    def next_token(self, params: dict[str, Any], version: int, context: list[int]) -> tuple[int, float]:
        if float(params.get("temperature", 1.0)) == 0.0:
            h = _h("greedy", version, len(context), context[-1])
        else:
            h = _h(params.get("seed"), version, len(context), context[-1])
        token = EOS if h % 9 == 0 else 1 + (h >> 8) % (VOCAB - 1)
        return token, -((h >> 20) % 1000 + 1) / 1000.0

    def _check_admin(self, request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {self.admin_token}":
            raise HTTPException(401, "admin token required")

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(body: dict[str, Any]) -> dict[str, Any]:
            ids, params, rid = list(body["input_ids"]), body["sampling_params"], body["rid"]
            if ids and ids[0] in self.fail_prefix:
                raise HTTPException(503, "no healthy engine")
            max_new = int(params["max_new_tokens"])
            if max_new < 0:
                raise HTTPException(400, "sampling_params.max_new_tokens must be >= 0")
            out, lps, versions = [], [], []
            self.active[rid] = out
            self.max_active = max(self.max_active, len(self.active))
            finish = "length"
            try:
                while len(out) < max_new:
                    await asyncio.sleep(self.token_delay_s)
                    await self._running.wait()
                    if rid in self.aborted:
                        finish = "abort"
                        break
                    tok, lp = self.next_token(params, self.version, ids + out)
                    out.append(tok)
                    lps.append(lp)
                    versions.append(self.version)
                    if tok == EOS:
                        finish = "stop"
                        break
                if rid in self.aborted:  # an abort after the last token still reports abort
                    finish = "abort"
            finally:
                self.active.pop(rid, None)
                self.aborted.discard(rid)
            self.log.append(
                {
                    "rid": rid,
                    "input_ids": ids,
                    "output_ids": out,
                    "logprobs": lps,
                    "versions": versions,
                    "finish": finish,
                }
            )
            return {
                "text": " ".join(f"t{t}" for t in out),
                "output_ids": out,
                "meta_info": {
                    "id": rid,
                    "finish_reason": {"type": finish},
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out),
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)],
                    "weight_version": versions[-1] if versions else self.version,
                    "output_token_versions": versions,
                },
            }

        @app.post("/abort_request")
        async def abort(request: Request, body: dict[str, Any]) -> dict[str, Any]:
            self._check_admin(request)
            rids = list(self.active) if body.get("abort_all") else [body["rid"]]
            self.aborted.update(r for r in rids if r in self.active)
            return {"success": True}

        @app.post("/pause_generation")
        async def pause(request: Request, body: dict[str, Any]) -> dict[str, Any]:
            self._check_admin(request)
            self._running.clear()
            return {"success": True}

        @app.post("/continue_generation")
        async def resume(request: Request) -> dict[str, Any]:
            self._check_admin(request)
            self._running.set()
            return {"success": True}

        return app


class FlakyTransport(httpx.AsyncBaseTransport):
    """Raises a connection error for the first `fail_first` requests to /generate."""

    def __init__(self, inner: httpx.AsyncBaseTransport, fail_first: int):
        self.inner, self.remaining, self.failures = inner, fail_first, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate" and self.remaining > 0:
            self.remaining -= 1
            self.failures += 1
            raise httpx.ConnectError("connection refused (injected)", request=request)
        return await self.inner.handle_async_request(request)


class CharTokenizer:
    """Enough of a tokenizer for the manager: text <-> small ids, no special tokens."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [VOCAB + ord(c) % 50 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"t{t}" for t in ids if not (skip_special_tokens and t == EOS))
