"""The TITO session server: an OpenAI-compatible endpoint per session that records exact Samples.

A black-box agent harness only speaks the OpenAI chat API, and sends the whole
conversation back every turn. Re-tokenising that conversation for training would
train on tokens the model never produced (a decode/re-encode round trip is not the
identity: a different BPE split, a re-serialised tool call, a stripped space). The
session server instead keeps, per trajectory, the exact token ids the engine saw and
produced, and on each turn tokenises *only the messages the agent appended*
(`chat.suffix_ids`); earlier model output is never re-tokenised.

    POST   /sessions                           {"metadata"?, "label"?, "sampling"?, "max_new_tokens"?} -> {"id"}
    POST   /sessions/{id}/v1/chat/completions  OpenAI chat API; use .../sessions/{id}/v1 as base_url
    POST   /v1/chat/completions                the same, the session named by the `X-Furlong-Session`
                                               header or `metadata.furlong_session` in the body
    POST   /sessions/{id}/tokenize, /tokenize  token ids of `messages` (+ `tools`) or of `prompt` text
    GET    /sessions/{id}/samples              the session's Samples (one per trajectory), as JSON
    DELETE /sessions/{id}                      end the session; returns its Samples
    GET    /metrics                            counters (Prometheus text)

Matching a request to a trajectory (messages compared by role, content and tool
calls — ids, spacing of argument JSON and `None` vs `""` do not matter):

- the request extends a trajectory's whole history -> append to that Sample;
- it extends a trajectory only up to an earlier model turn (a retry, or an agent that
  rewound) -> a *branch*: a new Sample holding the shared tokens, then the new turn;
- it shares no model turn with any trajectory -> a new Sample from its messages.

If the agent sends back one of the model's replies *changed* (edited, summarised,
re-formatted beyond the comparison above), the recorded history no longer matches
what the client claims: that is a template mismatch. The request is served on a
branch (so the engine sees what the client sent), `metadata["template_mismatch"]` is
set on that Sample and the `template_mismatches` counter goes up.

A session may carry defaults the agent cannot see: `sampling` (temperature, top_p,
top_k, stop, seed — what the agent's request leaves out; a seed gives each turn its
own derived seed) and a token budget `max_new_tokens` for the whole trajectory (model
turns plus appended messages, as in `multiturn.generate`): each turn's `max_tokens` is
capped at what is left, and a turn with nothing left is refused (HTTP 400,
`param: max_tokens`) and flagged `metadata["budget_exhausted"]`. This is how
`agent.generate` makes a black-box agent sample with the rollout's settings and fit
the trainer's sequence budget. `metadata["last_turn"]` numbers the session's turns,
so the trajectory served last is known.

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
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from furlong.app_thread import AppThread
from furlong.envs.chat import append_runs, suffix_ids
from furlong.envs.tools import parse_tool_calls
from furlong.rollout.client import EngineError
from furlong.rollout.generate import apply_response, derive_seed, encode_prompt
from furlong.rollout.sample import Sample

ROUTING_HEADER = "X-Routing-Key"
SESSION_HEADER = "X-Furlong-Session"  # names the session on the session-less routes
SESSION_METADATA = "furlong_session"  # ... or this key of the body's OpenAI `metadata`
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                 "stop": "stop", "stop_token_ids": "stop_token_ids"}


class RequestError(ValueError):
    def __init__(self, param: str, message: str, status: int = 400, code: str | None = None):
        super().__init__(f"{param}: {message}")
        self.param, self.status, self.code = param, status, code


def normalise(m: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a message in a history: role, content, and tool calls (name, decoded arguments)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for c in m.get("tool_calls") or []:
        f = c.get("function", c)
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        calls.append((f.get("name"), json.dumps(args, sort_keys=True)))
    return (m.get("role"), (content or "").strip(), tuple(calls))


def template_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools as a session hands them to the chat template: each OpenAI `{"type": "function", "function": f}` as `f`.

    Warm-up demonstrations meant for session rollouts render their tools the same way
    (`calculator.write_demonstrations`), so their prompts are the rollout's token for token.
    """
    return [t.get("function", t) for t in tools]


def clean(m: dict[str, Any]) -> dict[str, Any]:
    """A client message as the chat template reads it (content as text, null fields dropped)."""
    out = {k: v for k, v in m.items() if v is not None and k in ("role", "content", "tool_calls", "tool_call_id", "name")}
    if isinstance(out.get("content"), list):
        out["content"] = "".join(p.get("text", "") for p in out["content"] if isinstance(p, dict))
    return out


@dataclass
class Trajectory:
    sample: Sample
    tools: list[dict[str, Any]] | None
    history: list[tuple[Any, ...]] = field(default_factory=list)  # normalised messages, replies included
    points: list[tuple[int, int, str]] = field(default_factory=list)  # after each reply: (messages, tokens, its text)
    prompts: list[tuple[int, int]] = field(default_factory=list)  # each turn's prompt: (messages, tokens)


@dataclass
class Session:
    id: str
    metadata: dict[str, Any]
    label: Any = None
    sampling: dict[str, Any] = field(default_factory=dict)  # defaults for what a request leaves out
    budget: int | None = None  # response tokens per trajectory, appended messages included
    turns: int = 0
    trajectories: list[Trajectory] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionServer:
    """Sessions over one engine URL (an engine server or the router); see the module docstring."""

    def __init__(self, engine_url: str, tokenizer: Any = None, *, timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.engine_url = engine_url.rstrip("/")
        self.transport = transport
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.sessions: dict[str, Session] = {}
        self.counts: Counter[str] = Counter()
        self._http: httpx.AsyncClient | None = None

    # ---- the Python API (also what the HTTP routes call) -------------------------
    def create(self, metadata: dict[str, Any] | None = None, label: Any = None, *,
               sampling: dict[str, Any] | None = None, max_new_tokens: int | None = None) -> str:
        unknown = sorted(set(sampling or {}) - set(SAMPLING_KEYS.values()))
        if unknown:
            raise RequestError("sampling", f"unknown key(s) {unknown}; known: {sorted(SAMPLING_KEYS.values())}")
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens < 1):
            raise RequestError("max_new_tokens", f"must be a positive integer, got {max_new_tokens!r}")
        sid = uuid.uuid4().hex
        self.sessions[sid] = Session(sid, dict(metadata or {}), label, dict(sampling or {}), max_new_tokens)
        self.counts["sessions_created"] += 1
        return sid

    def samples(self, sid: str) -> list[Sample]:
        return [t.sample for t in self._get(sid).trajectories]

    def delete(self, sid: str) -> list[Sample]:
        out = self.samples(sid)
        del self.sessions[sid]
        return out

    def stats(self) -> dict[str, int]:
        return {**self.counts, "sessions_open": len(self.sessions)}

    def _get(self, sid: str) -> Session:
        if sid not in self.sessions:
            raise RequestError("session", f"no session {sid!r} (create one with POST /sessions)", 404)
        return self.sessions[sid]

    async def _tok(self) -> Any:
        if self.tokenizer is None:  # the engine knows its local model directory
            info = (await self._client().get("/get_model_info")).json()
            from furlong.models import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, info["tokenizer_path"])
        return self.tokenizer

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self.engine_url, timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                                           transport=self.transport)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # ---- one chat turn --------------------------------------------------------------
    async def chat(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        """Serve one `/v1/chat/completions` body on session `sid`; returns the OpenAI response."""
        session = self._get(sid)
        messages, tools = self._check(body)
        tok = await self._tok()
        async with session.lock:
            existing = len(session.trajectories)
            traj, new, after = self._place(session, messages, tools, tok)
            sample = traj.sample
            undo = (len(sample.tokens), len(traj.history), len(sample.metadata["messages"]))
            try:
                if new:
                    ids, sources = suffix_ids(tok, [clean(m) for m in new], tools=tools, after_output=after)
                    append_runs(sample, ids, sources)
                    traj.history.extend(normalise(m) for m in new)
                    sample.metadata["messages"].extend(clean(m) for m in new)
                out = await self._generate(session, sample, body)
            except BaseException as e:  # the turn did not happen: leave the trajectory as it was
                if traj.sample.index >= existing:  # created for this turn
                    session.trajectories.remove(traj)
                _truncate(sample, undo[0])
                del traj.history[undo[1] :], sample.metadata["messages"][undo[2] :]
                if isinstance(e, RequestError) and e.param == "max_tokens":
                    sample.metadata["budget_exhausted"] = True
                raise
            reply_ids = sample.tokens[len(sample.tokens) - len(out["output_ids"]) :]
            text = tok.decode(reply_ids, skip_special_tokens=True)
            use_tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
            content, calls, _ = parse_tool_calls(text) if use_tools else (text, [], [])
            message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
            traj.history.append(normalise(message))
            sample.metadata["messages"].append(clean(message))
            traj.points.append((len(traj.history), len(sample.tokens), tok.decode(reply_ids, skip_special_tokens=False)))
            traj.prompts.append((len(traj.history) - 1, len(sample.tokens) - len(reply_ids)))
            sample.metadata["turns"] = len(traj.points)
            session.turns += 1
            sample.metadata["last_turn"] = session.turns
            self.counts["turns"] += 1
        return self._response(body, out, message, reply_ids, sample, tok)

    @staticmethod
    def session_named(headers: Any, body: Any, required: bool = True) -> str | None:
        """The session a session-less request names: the `X-Furlong-Session` header, else `metadata.furlong_session`."""
        sid = headers.get(SESSION_HEADER)
        if not sid and isinstance(body, dict) and isinstance(body.get("metadata"), dict):
            sid = body["metadata"].get(SESSION_METADATA)
        if not sid and required:
            raise RequestError(f"metadata.{SESSION_METADATA}",
                               f"no session named: send the {SESSION_HEADER} header or metadata.{SESSION_METADATA}, "
                               "or use /sessions/{id}/v1 as the base URL")
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
        ids = self._served_prompt(self._get(sid) if sid else None, [normalise(m) for m in messages], tools)
        if ids is None:
            ids = encode_prompt(tok, [clean(m) for m in messages], tools)
        return {"tokens": ids, "count": len(ids)}

    def _served_prompt(self, session: Session | None, keys: list[tuple[Any, ...]], tools: Any) -> list[int] | None:
        best: tuple[int, list[int] | None] = (-1, None)
        for s in [session] if session else list(self.sessions.values()):
            for traj in s.trajectories:
                last = traj.sample.metadata.get("last_turn", 0)
                if traj.tools != tools or last <= best[0]:
                    continue
                for n_messages, n_tokens in traj.prompts:
                    if n_messages == len(keys) and traj.history[:n_messages] == keys:
                        best = (last, traj.sample.tokens[:n_tokens])
        return None if best[1] is None else list(best[1])

    def _check(self, body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        if not isinstance(body, dict):
            raise RequestError("body", "must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("messages", "must be a non-empty list of objects with a 'role'")
        if body.get("n", 1) != 1:
            raise RequestError("n", "a session serves one choice per request (n=1); branch by sending the history again")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools", "must be a list")
        if tools and body.get("tool_choice") != "none":
            return messages, template_tools(tools)
        return messages, None

    def _place(self, session: Session, messages: list[dict[str, Any]], tools: Any, tok: Any
               ) -> tuple[Trajectory, list[dict[str, Any]], str | None]:
        """(trajectory to continue, messages to append, text of the reply they follow); see the module docstring.

        The trajectory is the one sharing the longest history with the request up to
        one of the model's replies; its tokens up to that reply are reused as they are.
        """
        keys = [normalise(m) for m in messages]
        best: tuple[int, Trajectory | None, int] = (0, None, -1)  # (messages shared, trajectory, point index)
        mismatch = False
        for traj in session.trajectories:
            if traj.tools != tools:
                continue
            common = next((i for i, (a, b) in enumerate(zip(keys, traj.history)) if a != b), min(len(keys), len(traj.history)))
            replies = {m - 1 for m, _, _ in traj.points}  # where the model's own replies sit in the history
            if common in replies and common < len(keys) and keys[common][0] == "assistant":
                mismatch = True  # the client sent back one of the model's replies changed
            for k, (m, _, _) in enumerate(traj.points):
                if best[0] < m <= common and m < len(keys):
                    best = (m, traj, k)
        if mismatch:
            self.counts["template_mismatches"] += 1
        shared, parent, k = best
        if parent is not None and shared == len(parent.history):
            return parent, messages[shared:], parent.points[k][2]
        if parent is not None:  # a branch at an earlier reply: the shared tokens are kept as they are
            m, t, after = parent.points[k]
            sample = _truncate(Sample.from_dict(json.loads(parent.sample.to_json())), t)
            traj = self._new_trajectory(session, sample, tools, parent.sample.metadata["messages"][:m],
                                        branch_of=session.trajectories.index(parent))
            traj.history, traj.points, traj.prompts = parent.history[:m], parent.points[: k + 1], parent.prompts[: k + 1]
        else:
            prompt = [clean(m) for m in messages]
            sample = Sample(prompt=prompt, tokens=encode_prompt(tok, prompt, tools), label=session.label)
            traj = self._new_trajectory(session, sample, tools, list(prompt), branch_of=None)
            traj.history, shared, after = keys, len(messages), None
        if len(session.trajectories) > 1:
            self.counts["branches"] += 1
        traj.sample.metadata["template_mismatch"] = mismatch
        return traj, messages[shared:], after

    def _new_trajectory(self, session: Session, sample: Sample, tools: Any, messages: list[dict[str, Any]],
                        branch_of: int | None) -> Trajectory:
        sample.index = len(session.trajectories)
        sample.metadata = {**session.metadata, "session_id": session.id, "trajectory": sample.index,
                           "branch_of": branch_of, "tools": tools, "messages": list(messages), "turns": 0}
        traj = Trajectory(sample, tools)
        session.trajectories.append(traj)
        return traj

    async def _generate(self, session: Session, sample: Sample, body: dict[str, Any]) -> dict[str, Any]:
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
                raise RequestError("max_tokens", f"the session's token budget is used up (This model's maximum context "
                                   f"length is {session.budget} tokens)", code="context_length_exceeded")
            max_tokens = left if max_tokens is None else min(int(max_tokens), left)
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        payload = {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True}
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

    def _response(self, body: dict[str, Any], out: dict[str, Any], message: dict[str, Any], reply_ids: list[int],
                  sample: Sample, tok: Any) -> dict[str, Any]:
        reason = ((out.get("meta_info") or {}).get("finish_reason") or {}).get("type", "stop")
        choice: dict[str, Any] = {"index": 0, "message": message,
                                  "finish_reason": "tool_calls" if message.get("tool_calls") and reason == "stop" else reason,
                                  "logprobs": None}
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
        choice["meta_info"] = {"output_token_versions": sample.token_versions[len(sample.token_versions) - len(reply_ids) :]}
        prompt_tokens = len(sample.tokens) - len(reply_ids)
        resp = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or "furlong", "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(reply_ids),
                          "total_tokens": prompt_tokens + len(reply_ids)}}
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

        @app.exception_handler(RequestError)
        async def bad(request: Request, e: RequestError):
            kind = "NotFoundError" if e.status == 404 else "BadRequestError" if e.status < 500 else "APIError"
            return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param,
                                          "code": e.code or e.status}},
                                status_code=e.status)

        async def body_of(request: Request) -> Any:
            raw = await request.body()
            try:
                return json.loads(raw) if raw else {}
            except json.JSONDecodeError as e:
                raise RequestError("body", f"malformed JSON: {e}") from None

        @app.post("/sessions")
        async def create(request: Request):
            body = await body_of(request)
            if not isinstance(body, dict):
                raise RequestError("body", "must be a JSON object")
            for key in ("metadata", "sampling"):
                if not isinstance(body.get(key) or {}, dict):
                    raise RequestError(key, "must be an object")
            return {"id": self.create(body.get("metadata"), body.get("label"), sampling=body.get("sampling"),
                                      max_new_tokens=body.get("max_new_tokens"))}

        async def serve_chat(sid: str, body: Any):
            resp = await self.chat(sid, body)
            if isinstance(body, dict) and body.get("stream"):
                return StreamingResponse(_stream(resp, body), media_type="text/event-stream")
            return resp

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(sid: str, request: Request):
            return await serve_chat(sid, await body_of(request))

        @app.post("/v1/chat/completions")
        async def chat_named(request: Request):
            body = await body_of(request)
            return await serve_chat(self.session_named(request.headers, body), body)

        @app.post("/sessions/{sid}/tokenize")
        async def tokenize(sid: str, request: Request):
            return await self.tokenize(sid, await body_of(request))

        @app.post("/tokenize")
        async def tokenize_any(request: Request):
            body = await body_of(request)
            return await self.tokenize(self.session_named(request.headers, body, required=False), body)

        @app.get("/v1/models")
        async def models_any():
            return {"object": "list", "data": [{"id": "furlong", "object": "model", "created": 0, "owned_by": "furlong"}]}

        @app.get("/sessions/{sid}/v1/models")
        async def models(sid: str):
            self._get(sid)
            return await models_any()

        @app.get("/sessions/{sid}/samples")
        async def samples(sid: str):
            return [s.to_dict() for s in self.samples(sid)]

        @app.delete("/sessions/{sid}")
        async def delete(sid: str):
            return {"id": sid, "deleted": True, "samples": [s.to_dict() for s in self.delete(sid)]}

        @app.get("/metrics")
        async def metrics():
            lines = []
            for name, v in sorted(self.stats().items()):
                lines += [f"# TYPE furlong_sessions_{name} {'gauge' if name == 'sessions_open' else 'counter'}",
                          f"furlong_sessions_{name} {v}"]
            return PlainTextResponse("\n".join(lines) + "\n")

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        return app


def _truncate(sample: Sample, n_tokens: int) -> Sample:
    """Cut `sample` in place after its first `n_tokens` tokens (per-token data cut alike)."""
    r = n_tokens - sample.prompt_length
    del sample.tokens[n_tokens:]
    for per_token in (sample.loss_mask, sample.rollout_logprobs, sample.token_versions, sample.token_sources):
        del per_token[r:]
    sample.response_length = r
    sample.reward, sample.teacher_logprobs, sample.routed_experts = None, None, None
    return sample


async def _stream(resp: dict[str, Any], body: dict[str, Any]):
    """The finished turn as OpenAI chat-completion chunks (role, content, tool calls, finish, usage)."""
    choice = resp["choices"][0]
    msg = choice["message"]
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish, **extra}]})}\n\n"

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
