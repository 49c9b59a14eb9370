"""The TITO session server: an OpenAI-compatible endpoint per session that records exact Samples.

The exact-token bookkeeping (why, and how a request is matched to a trajectory) is
`session_store.py`'s; this module parses requests, calls the engine and serves:

    POST   /sessions                           {"metadata"?, "label"?, "sampling"?, "max_new_tokens"?} -> {"id"}
    POST   /sessions/{id}/v1/chat/completions  OpenAI chat API; use .../sessions/{id}/v1 as base_url
    POST   /v1/chat/completions                the same, the session named by the `X-Furlong-Session`
                                               header or `metadata.furlong_session` in the body
    POST   /sessions/{id}/tokenize, /tokenize  token ids of `messages` (+ `tools`) or of `prompt` text
    GET    /sessions/{id}/samples              the session's Samples (one per trajectory), as JSON
    DELETE /sessions/{id}                      end the session; returns its Samples
    GET    /metrics                            counters (Prometheus text)

A session may carry defaults the agent cannot see: `sampling` (temperature, top_p,
top_k, stop, seed — what the agent's request leaves out; a seed gives each turn its
own derived seed) and a token budget `max_new_tokens` for the whole trajectory (model
turns plus appended messages, as in `multiturn.generate`): each turn's `max_tokens` is
capped at what is left, and a turn with nothing left is refused (HTTP 400,
`param: max_tokens`) and flagged `metadata["budget_exhausted"]`. This is how
`agent.generate` makes a black-box agent sample with the rollout's settings and fit
the trainer's sequence budget. `metadata["last_turn"]` numbers the session's turns,
so the trajectory served last is known.

Sessions are bounded (`session_store`): idle ones expire after `session_ttl_s` (404 naming
the session afterwards), at most `max_sessions` are open (429 naming the cap), and a
request body over `max_body_bytes` (default 64 MiB, the engine's limit) is refused (413).

Every engine call of a session carries `X-Routing-Key: <session id>`, so behind the
router the whole session stays on one engine (and reuses its prefix cache).

A harness whose model endpoint is fixed when it starts (one base URL for all its
episodes, as NeMo Gym's model server has) uses the session-less route and names the
session per request, in OpenAI's `metadata` map (which such harnesses pass through)
or a header. A harness that records tokens itself, vLLM-style (`logprobs` with
`return_tokens_as_token_ids`, then `/tokenize` on the same messages), gets `token_id:N`
log-probs, and from `/tokenize` the ids a served turn sent to the engine when the
messages are that turn's prompt (in the named session, else in any open one); other
messages go through the chat template. So its own record agrees with the session's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from furlong.core.aio_transport import AiohttpTransport
from furlong.core.app_thread import AppThread
from furlong.core.client import EngineError
from furlong.core.net import tls_context
from furlong.core.sample import Sample
from furlong.core.tool_calls import detect_tool_format, parse_tool_calls
from furlong.data.chat import encode_prompt
from furlong.envs.session_store import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_TTL_S,
    SAMPLING_KEYS,
    RequestError,
    Session,
    SessionStore,
    clean,
    normalise,
    template_tools,
)
from furlong.rollout.generate import apply_response, derive_seed
from furlong.router.bodies import MAX_BODY_BYTES, BodyTooLarge, check_limit, read_body

ROUTING_HEADER = "X-Routing-Key"
SESSION_HEADER = "X-Furlong-Session"  # names the session on the session-less routes
SESSION_METADATA = "furlong_session"  # ... or this key of the body's OpenAI `metadata`


class SessionServer:
    """Sessions over one engine URL (an engine server or the router); see the module docstring."""

    def __init__(
        self,
        engine_url: str,
        tokenizer: Any = None,
        *,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        session_ttl_s: float | None = DEFAULT_TTL_S,
        max_sessions: int | None = DEFAULT_MAX_SESSIONS,
        max_body_bytes: int = MAX_BODY_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine_url = engine_url.rstrip("/")
        self.transport = transport
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.max_body_bytes = check_limit(max_body_bytes)
        self.store = SessionStore(session_ttl_s, max_sessions, clock)
        self._http: httpx.AsyncClient | None = None

    # ---- the Python API (also what the HTTP routes call) -------------------------
    def create(
        self,
        metadata: dict[str, Any] | None = None,
        label: Any = None,
        *,
        sampling: dict[str, Any] | None = None,
        max_new_tokens: int | None = None,
    ) -> str:
        return self.store.create(metadata, label, sampling=sampling, max_new_tokens=max_new_tokens)

    def samples(self, sid: str) -> list[Sample]:
        return self.store.samples(sid)

    def delete(self, sid: str) -> list[Sample]:
        return self.store.delete(sid)

    def stats(self) -> dict[str, int]:
        return self.store.stats()

    @property
    def sessions(self) -> dict[str, Session]:
        return self.store.sessions

    @property
    def counts(self) -> Counter[str]:
        return self.store.counts

    async def _tok(self) -> Any:
        if self.tokenizer is None:  # the engine knows its local model directory
            info = (await self._client().get("/get_model_info")).json()
            from furlong.models import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, info["tokenizer_path"])
        return self.tokenizer

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.engine_url,
                timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                transport=self.transport or AiohttpTransport(),
                verify=tls_context(),
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # ---- one chat turn --------------------------------------------------------------
    async def chat(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        """Serve one `/v1/chat/completions` body on session `sid`; returns the OpenAI response."""
        session = self.store.get(sid)
        messages, tools = self._check(body)
        tok = await self._tok()
        async with session.lock:
            turn = self.store.open_turn(session, messages, tools, tok)
            sample = turn.sample
            try:
                out = await self._generate(session, sample, body)
            except BaseException as e:  # the turn did not happen: leave the trajectory as it was
                exhausted = isinstance(e, RequestError) and e.param == "max_tokens"
                self.store.undo_turn(session, turn, budget_exhausted=exhausted)
                raise
            reply_ids = sample.tokens[len(sample.tokens) - len(out["output_ids"]) :]
            text = tok.decode(reply_ids, skip_special_tokens=True)
            use_tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
            fmt = detect_tool_format(getattr(tok, "chat_template", None))  # the format the template writes
            content, calls, _ = parse_tool_calls(text, fmt) if use_tools else (text, [], [])
            message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
            self.store.close_turn(session, turn, message, reply_ids, tok)
        return self._response(body, out, message, reply_ids, sample, tok)

    @staticmethod
    def session_named(headers: Any, body: Any, required: bool = True) -> str | None:
        """The session a session-less request names: the `X-Furlong-Session` header, else `metadata.furlong_session`."""
        sid = headers.get(SESSION_HEADER)
        if not sid and isinstance(body, dict) and isinstance(body.get("metadata"), dict):
            sid = body["metadata"].get(SESSION_METADATA)
        if not sid and required:
            raise RequestError(
                f"metadata.{SESSION_METADATA}",
                f"no session named: send the {SESSION_HEADER} header or metadata.{SESSION_METADATA}, "
                "or use /sessions/{id}/v1 as the base URL",
            )
        return str(sid) if sid else None

    async def tokenize(self, sid: str | None, body: Any) -> dict[str, Any]:
        """`/tokenize`: ids of `messages` (+ `tools`; with the generation prompt) or of `prompt` text.

        Messages that are the prompt of a turn already served — in session `sid`, or in
        any open session when none is named — get the ids that turn sent to the engine
        (the latest such turn's), so a harness that records tokens itself agrees with the
        session; other messages go through the chat template, as the engine's would.
        """
        if not isinstance(body, dict):
            raise RequestError("body", "must be a JSON object")
        tok = await self._tok()
        messages, text = body.get("messages"), body.get("prompt", body.get("text"))
        if messages is None:
            if not isinstance(text, str):
                raise RequestError("prompt", "give `messages` (a list) or `prompt` (text)")
            ids = list(tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", True))))
            return {"tokens": ids, "count": len(ids)}
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("messages", "must be a list of objects with a 'role'")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools", "must be a list")
        tools = template_tools(tools) if tools else None
        session = self.store.get(sid) if sid else None
        ids = self.store.served_prompt(session, [normalise(m) for m in messages], tools)
        if ids is None:
            ids = encode_prompt(tok, [clean(m) for m in messages], tools)
        return {"tokens": ids, "count": len(ids)}

    def _check(self, body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        if not isinstance(body, dict):
            raise RequestError("body", "must be a JSON object")
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            raise RequestError("messages", "must be a non-empty list of objects with a 'role'")
        if body.get("n", 1) != 1:
            raise RequestError(
                "n", "a session serves one choice per request (n=1); branch by sending the history again"
            )
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools", "must be a list")
        if tools and body.get("tool_choice") != "none":
            return messages, template_tools(tools)
        return messages, None

    def _params(self, session: Session, sample: Sample, body: dict[str, Any]) -> dict[str, Any]:
        """The engine's sampling params: the request's, the session's defaults for the rest, the budget's cap."""
        params = {ours: body[theirs] for theirs, ours in SAMPLING_KEYS.items() if body.get(theirs) is not None}
        defaults = {k: v for k, v in session.sampling.items() if k not in params}
        if "seed" in defaults:  # one seed per turn, from what the turn is, never from timing
            defaults["seed"] = derive_seed(defaults["seed"], session.turns, len(sample.tokens))
        params = {**defaults, **params}
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if session.budget is not None:
            left = session.budget - sample.response_length
            if left <= 0:
                self.counts["budget_refusals"] += 1
                # OpenAI's code and wording for a full context: clients (litellm, Harbor, verifiers) stop
                # at once instead of retrying a refusal that cannot succeed.
                raise RequestError(
                    "max_tokens",
                    f"the session's token budget is used up (This model's maximum context "
                    f"length is {session.budget} tokens)",
                    code="context_length_exceeded",
                )
            max_tokens = left if max_tokens is None else min(int(max_tokens), left)
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        return params

    async def _generate(self, session: Session, sample: Sample, body: dict[str, Any]) -> dict[str, Any]:
        payload = {
            "input_ids": sample.tokens,
            "sampling_params": self._params(session, sample, body),
            "return_logprob": True,
        }
        try:
            resp = await self._client().post("/generate", json=payload, headers={ROUTING_HEADER: session.id})
        except httpx.TransportError as e:
            self.counts["engine_errors"] += 1
            raise RequestError("engine", f"{self.engine_url}/generate: {type(e).__name__}: {e}", 502) from e
        if resp.status_code != 200:
            self.counts["engine_errors"] += 1
            try:
                err = resp.json()["error"]
                param, message = err.get("param") or "engine", err.get("message") or resp.text[:300]
            except (ValueError, KeyError, TypeError, AttributeError):
                param, message = "engine", resp.text[:300]
            raise RequestError(param, message, resp.status_code)
        out = resp.json()
        try:
            apply_response(sample, out)
        except EngineError as e:
            raise RequestError("engine", str(e), 502) from e
        return out

    def _response(
        self,
        body: dict[str, Any],
        out: dict[str, Any],
        message: dict[str, Any],
        reply_ids: list[int],
        sample: Sample,
        tok: Any,
    ) -> dict[str, Any]:
        reason = ((out.get("meta_info") or {}).get("finish_reason") or {}).get("type", "stop")
        finish = "tool_calls" if message.get("tool_calls") and reason == "stop" else reason
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            lps = sample.rollout_logprobs[len(sample.rollout_logprobs) - len(reply_ids) :]
            as_ids = body.get("return_tokens_as_token_ids")
            entries = []
            for t, lp in zip(reply_ids, lps):
                s = f"token_id:{t}" if as_ids else tok.decode([t])
                entries.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
            choice["logprobs"] = {"content": entries}
        if body.get("return_token_ids"):
            choice["token_ids"] = list(reply_ids)
        versions = sample.token_versions[len(sample.token_versions) - len(reply_ids) :]
        choice["meta_info"] = {"output_token_versions": versions}
        prompt_tokens = len(sample.tokens) - len(reply_ids)
        resp = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or "furlong",
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(reply_ids),
                "total_tokens": prompt_tokens + len(reply_ids),
            },
        }
        if body.get("return_token_ids"):
            resp["prompt_token_ids"] = sample.tokens[:prompt_tokens]
        return resp

    # ---- HTTP --------------------------------------------------------------------------
    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            yield
            await self.aclose()

        app = FastAPI(title="furlong sessions", docs_url=None, redoc_url=None, lifespan=lifespan)
        app.exception_handler(RequestError)(_error_response)

        @app.post("/sessions")
        async def create(request: Request):
            body = await _body_of(request, self.max_body_bytes)
            if not isinstance(body, dict):
                raise RequestError("body", "must be a JSON object")
            for key in ("metadata", "sampling"):
                if not isinstance(body.get(key) or {}, dict):
                    raise RequestError(key, "must be an object")
            return {
                "id": self.create(
                    body.get("metadata"),
                    body.get("label"),
                    sampling=body.get("sampling"),
                    max_new_tokens=body.get("max_new_tokens"),
                )
            }

        async def serve_chat(sid: str, body: Any):
            resp = await self.chat(sid, body)
            if isinstance(body, dict) and body.get("stream"):
                return StreamingResponse(_stream(resp, body), media_type="text/event-stream")
            return resp

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(sid: str, request: Request):
            return await serve_chat(sid, await _body_of(request, self.max_body_bytes))

        @app.post("/v1/chat/completions")
        async def chat_named(request: Request):
            body = await _body_of(request, self.max_body_bytes)
            return await serve_chat(self.session_named(request.headers, body), body)

        @app.post("/sessions/{sid}/tokenize")
        async def tokenize(sid: str, request: Request):
            return await self.tokenize(sid, await _body_of(request, self.max_body_bytes))

        @app.post("/tokenize")
        async def tokenize_any(request: Request):
            body = await _body_of(request, self.max_body_bytes)
            return await self.tokenize(self.session_named(request.headers, body, required=False), body)

        @app.get("/v1/models")
        async def models_any():
            model = {"id": "furlong", "object": "model", "created": 0, "owned_by": "furlong"}
            return {"object": "list", "data": [model]}

        @app.get("/sessions/{sid}/v1/models")
        async def models(sid: str):
            self.store.get(sid)
            return await models_any()

        @app.get("/sessions/{sid}/samples")
        async def samples(sid: str):
            return [s.to_dict() for s in self.samples(sid)]

        @app.delete("/sessions/{sid}")
        async def delete(sid: str):
            return {"id": sid, "deleted": True, "samples": [s.to_dict() for s in self.delete(sid)]}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(_metrics_text(self.stats()))

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        return app


async def _error_response(request: Request, e: RequestError) -> JSONResponse:
    """A refused request in OpenAI's error shape, naming the field (`param`)."""
    kind = "NotFoundError" if e.status == 404 else "BadRequestError" if e.status < 500 else "APIError"
    return JSONResponse(
        {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code or e.status}}, status_code=e.status
    )


async def _body_of(request: Request, limit: int) -> Any:
    try:
        raw = await read_body(request, limit)
    except BodyTooLarge as e:
        raise RequestError("body", str(e).removeprefix("body: "), 413) from None
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise RequestError("body", f"malformed JSON: {e}") from None


def _metrics_text(stats: dict[str, int]) -> str:
    lines = []
    for name, v in sorted(stats.items()):
        lines += [
            f"# TYPE furlong_sessions_{name} {'gauge' if name == 'sessions_open' else 'counter'}",
            f"furlong_sessions_{name} {v}",
        ]
    return "\n".join(lines) + "\n"


async def _stream(resp: dict[str, Any], body: dict[str, Any]):
    """The finished turn as OpenAI chat-completion chunks (role, content, tool calls, finish, usage)."""
    choice = resp["choices"][0]
    msg = choice["message"]
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]
        return f"data: {json.dumps({**base, 'choices': choices})}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    extra = {k: choice[k] for k in ("logprobs", "token_ids") if choice.get(k) is not None}
    if msg.get("content") or extra:
        yield chunk({"content": msg.get("content") or ""}, **extra)
    if msg.get("tool_calls"):
        yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]})
    yield chunk({}, choice["finish_reason"])
    if (body.get("stream_options") or {}).get("include_usage"):
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': resp['usage']})}\n\n"
    yield "data: [DONE]\n\n"


class ServerThread(AppThread):
    """Serve a `SessionServer` from a thread of this process (tests, an in-process driver)."""

    def __init__(self, server: SessionServer, host: str = "127.0.0.1", port: int = 0):
        super().__init__(server.app(), host, port, name="furlong-sessions")
        self.server = server

    def session_url(self, sid: str) -> str:
        """The `base_url` an OpenAI client uses for session `sid`."""
        return f"{self.url}/sessions/{sid}/v1"
