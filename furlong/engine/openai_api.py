"""OpenAI-compatible `/v1/chat/completions`, `/v1/completions` and `/v1/models`.

So that any agent harness and the official `openai` client work unchanged.
Tool calls: with `tools` in the request, every `<tool_call>{json}</tool_call>`
block of the output (the chat template's tool-call format) becomes an entry of
`message.tool_calls` and the finish reason becomes `tool_calls`; a block whose
JSON does not parse stays in `content`, so nothing the model wrote is lost.

Token-in-token-out extensions (vLLM's names, read by NeMo Gym, Harbor and
verifiers): `return_token_ids` adds `prompt_token_ids` and per-choice
`token_ids`; `return_tokens_as_token_ids` writes each log-prob entry's token
as `token_id:N`, so a harness recovers exact ids without re-tokenising.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from furlong.core import api as P
from furlong.core.tool_calls import detect_tool_format, parse_tool_calls, tool_call_start
from furlong.engine import validate as V
from furlong.engine.engine import Engine
from furlong.engine.http import body_of, events, finished, sse
from furlong.engine.request import Request


def openai_tool_calls(text: str, fmt: str = "hermes") -> tuple[str, list[dict[str, Any]]]:
    """Split output text into (content, OpenAI `tool_calls` entries), with the one parser of `core.tool_calls`."""
    content, calls, _ = parse_tool_calls(text, fmt)
    return content, [c.openai() for c in calls]


def _finish(req: Request, tool_calls: bool = False) -> str:
    kind = (req.finish_reason or {}).get("type", "stop")
    return "tool_calls" if tool_calls and kind == "stop" else kind


def add_openai_routes(app: FastAPI, engine: Engine) -> None:
    routes = OpenAIRoutes(engine)
    app.get("/v1/models")(routes.models)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/completions")(routes.completions)


class OpenAIRoutes:
    """The OpenAI endpoints over one engine; a class so the shared pieces (sampling, log-probs) are methods."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tok = engine.tokenizer
        self.name = engine.model_path
        # The tool-call format the model's chat template writes (hermes, llama3, mistral).
        self.tool_format = detect_tool_format(getattr(engine.tokenizer, "chat_template", None))

    # ------------------------------------------------------------------ shared pieces
    def token_str(self, t: int, as_ids: bool) -> str:
        return f"token_id:{t}" if as_ids else self.tok.decode([t])

    def chat_logprobs(self, req: Request, lo: int, hi: int, top: int, as_ids: bool) -> dict[str, Any]:
        content = []
        for i in range(lo, hi):
            t = req.output_ids[i]
            s = self.token_str(t, as_ids)
            entry = {"token": s, "logprob": req.output_logprobs[i], "bytes": list(s.encode())}
            entry["top_logprobs"] = [
                {"token": self.token_str(tt, as_ids), "logprob": lp, "bytes": list(self.token_str(tt, as_ids).encode())}
                for lp, tt in (req.output_top_logprobs[i] if top else [])
            ]
            content.append(entry)
        return {"content": content}

    def sampling(self, body: P.OpenAICommon, max_tokens: int | None, prompt_len: int) -> P.SamplingParamsIn:
        engine = self.engine
        V.check_stop_ids(body.stop_token_ids, "stop_token_ids", engine.vocab_size)
        room = engine.max_context - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise P.BadRequest(
                "max_tokens", f"{max_tokens} exceeds the {room} tokens left in the {engine.max_context}-token context"
            )
        return P.SamplingParamsIn(
            max_new_tokens=max_tokens if max_tokens is not None else room,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=body.min_p or 0.0,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
            seed=body.seed,
        )

    def requests(
        self, prompt: list[int], field: str, body: P.OpenAICommon, sp: P.SamplingParamsIn, top: int
    ) -> list[Request]:
        engine = self.engine
        V.check_prompt(
            prompt, field, vocab=engine.vocab_size, max_context=engine.max_context, kv_tokens=engine.kv_capacity_tokens
        )
        out = []
        for j in range(body.n):
            params = V.to_sampling(
                sp, prompt_len=len(prompt), max_context=engine.max_context, default_max=sp.max_new_tokens
            )
            if params.seed is not None:
                params.seed += j  # n samples of one seeded request differ, yet the request is reproducible
            kw = {"rid": f"{body.rid}-{j}" if body.n > 1 else body.rid} if body.rid else {}
            out.append(Request(prompt, params, return_logprob=True, top_logprobs_num=top, **kw))
        return out

    def usage(self, prompt: list[int], reqs: list[Request]) -> dict[str, int]:
        c = sum(len(r.output_ids) for r in reqs)
        return {"prompt_tokens": len(prompt), "completion_tokens": c, "total_tokens": len(prompt) + c}

    def partial_text(self, r: Request, n: int, fin: bool) -> str:
        """The text of a streamed request's first `n` tokens (the final, stop-trimmed text once finished)."""
        if fin:
            return self.engine.result(r)["text"]
        return self.tok.decode(r.output_ids[:n], skip_special_tokens=r.params.skip_special_tokens)

    # ------------------------------------------------------------------ /v1/models
    async def models(self):
        return {
            "object": "list",
            "data": [
                {
                    "id": self.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "furlong",
                    "max_model_len": self.engine.max_context,
                }
            ],
        }

    # ------------------------------------------------------------------ /v1/chat/completions
    def chat_prompt(self, body: P.ChatIn) -> list[int]:
        msgs = []
        for m in body.messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(d.get("content"), list):
                d["content"] = "".join(p.get("text", "") for p in d["content"] if isinstance(p, dict))
            msgs.append(d)
        tools = None
        if body.tools and body.tool_choice != "none":
            tools = [t.get("function", t) for t in body.tools]
        try:
            ids = self.tok.apply_chat_template(
                msgs,
                tools=tools,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                tokenize=True,
                return_dict=False,
                **(body.chat_template_kwargs or {}),
            )
        except Exception as e:  # a template error is the client's messages' fault
            raise P.BadRequest("messages", f"chat template failed: {e}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    async def chat(self, request: HTTPRequest):
        body = P.parse(P.ChatIn, await body_of(request))
        prompt = self.chat_prompt(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = body.top_logprobs or 0
        reqs = self.requests(prompt, "messages", body, self.sampling(body, max_tokens, len(prompt)), top)
        use_tools = bool(body.tools) and body.tool_choice != "none"
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return StreamingResponse(
                self.stream_chat(body, reqs, cid, created, use_tools, prompt), media_type="text/event-stream"
            )
        await asyncio.gather(*(finished(self.engine, r) for r in reqs))
        choices = [self.chat_choice(body, i, r, use_tools) for i, r in enumerate(reqs)]
        resp = {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": body.model or self.name,
            "choices": choices,
            "usage": self.usage(prompt, reqs),
        }
        if body.return_token_ids:
            resp["prompt_token_ids"] = prompt
        return JSONResponse(resp)

    def chat_choice(self, body: P.ChatIn, i: int, r: Request, use_tools: bool) -> dict[str, Any]:
        text = self.engine.result(r)["text"]
        content, calls = openai_tool_calls(text, self.tool_format) if use_tools else (text, [])
        msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            msg["tool_calls"] = calls
        logprobs = None
        if body.logprobs:
            logprobs = self.chat_logprobs(
                r, 0, len(r.output_ids), body.top_logprobs or 0, body.return_tokens_as_token_ids
            )
        choice: dict[str, Any] = {
            "index": i,
            "message": msg,
            "finish_reason": _finish(r, bool(calls)),
            "logprobs": logprobs,
        }
        if body.return_token_ids:
            choice["token_ids"] = list(r.output_ids)
        version = r.output_versions[-1] if r.output_versions else self.engine.weight_version
        choice["meta_info"] = {"weight_version": version, "output_token_versions": list(r.output_versions)}
        return choice

    async def stream_chat(
        self, body: P.ChatIn, reqs: list[Request], cid: str, created: int, use_tools: bool, prompt: list[int]
    ) -> AsyncIterator[str]:
        def chunk(i: int, delta: dict, finish: str | None = None, **extra) -> str:
            return sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": body.model or self.name,
                    "choices": [{"index": i, "delta": delta, "finish_reason": finish, **extra}],
                }
            )

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, r: Request) -> None:
            async for n, fin in events(self.engine, r):
                await queue.put((i, n, fin))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        sent_tok = [0] * len(reqs)
        sent_txt = [""] * len(reqs)
        try:
            for i in range(len(reqs)):
                extra = {"prompt_token_ids": prompt} if body.return_token_ids else {}
                yield chunk(i, {"role": "assistant", "content": ""}, **extra)
            left = len(reqs)
            while left:
                i, n, fin = await queue.get()
                r = reqs[i]
                text = self.partial_text(r, n, fin)
                opener = tool_call_start(self.tool_format) if use_tools else None
                if opener and opener in text:
                    text = text[: text.find(opener)]  # tool calls are sent whole at the end
                if text.endswith("\ufffd") and not fin:
                    text = text[:-1]  # half a UTF-8 character: wait for the rest
                delta_txt = text[len(sent_txt[i]) :] if text.startswith(sent_txt[i]) else ""
                extra = {}
                if body.logprobs and n > sent_tok[i]:
                    extra["logprobs"] = self.chat_logprobs(
                        r, sent_tok[i], n, body.top_logprobs or 0, body.return_tokens_as_token_ids
                    )
                if body.return_token_ids:
                    extra["token_ids"] = r.output_ids[sent_tok[i] : n]
                if delta_txt or extra:
                    yield chunk(i, {"content": delta_txt}, **extra)
                sent_txt[i] = text if delta_txt or text == sent_txt[i] else sent_txt[i]
                sent_tok[i] = n
                if fin:
                    left -= 1
                    calls = openai_tool_calls(self.engine.result(r)["text"], self.tool_format)[1] if use_tools else []
                    if calls:
                        yield chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
                    yield chunk(i, {}, _finish(r, bool(calls)))
            if (body.stream_options or {}).get("include_usage"):
                yield sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": body.model or self.name,
                        "choices": [],
                        "usage": self.usage(prompt, reqs),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ /v1/completions
    def completion_prompts(self, body: P.CompletionIn) -> list[list[int]]:
        p = body.prompt
        if isinstance(p, str):
            prompts = [self.tok.encode(p)]
        elif p and isinstance(p[0], int):
            prompts = [p]
        elif p and isinstance(p[0], str):
            prompts = [self.tok.encode(s) for s in p]
        else:
            prompts = list(p)
        if not prompts:
            raise P.BadRequest("prompt", "empty")
        return prompts

    async def completions(self, request: HTTPRequest):
        body = P.parse(P.CompletionIn, await body_of(request))
        if body.echo or body.suffix:
            raise P.BadRequest("echo" if body.echo else "suffix", "not supported")
        prompts = self.completion_prompts(body)
        top = body.logprobs or 0
        reqs, owners = [], []
        for k, ids in enumerate(prompts):
            sp = self.sampling(body, 16 if body.max_tokens is None else body.max_tokens, len(ids))
            rs = self.requests(ids, f"prompt[{k}]" if len(prompts) > 1 else "prompt", body, sp, top)
            reqs += rs
            owners += [k] * len(rs)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            if len(reqs) > 1:
                raise P.BadRequest("stream", "streaming supports one prompt with n=1")
            return StreamingResponse(
                self.stream_completion(body, reqs[0], cid, created), media_type="text/event-stream"
            )
        await asyncio.gather(*(finished(self.engine, r) for r in reqs))
        choices = []
        for i, (r, k) in enumerate(zip(reqs, owners)):
            logprobs = None
            if body.logprobs is not None:
                logprobs = self.completion_logprobs(r, 0, len(r.output_ids), top, body)
            choice: dict[str, Any] = {
                "index": i,
                "text": self.engine.result(r)["text"],
                "finish_reason": _finish(r),
                "logprobs": logprobs,
            }
            if body.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = prompts[k], list(r.output_ids)
            choices.append(choice)
        c = sum(len(r.output_ids) for r in reqs)
        ptoks = sum(len(x) for x in prompts)
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": body.model or self.name,
                "choices": choices,
                "usage": {"prompt_tokens": ptoks, "completion_tokens": c, "total_tokens": ptoks + c},
            }
        )

    def completion_logprobs(self, r: Request, lo: int, hi: int, top: int, body: P.CompletionIn) -> dict[str, Any]:
        as_ids = body.return_tokens_as_token_ids
        ids = r.output_ids[lo:hi]
        tops = None
        if top:
            tops = [{self.token_str(t, as_ids): lp for lp, t in r.output_top_logprobs[i]} for i in range(lo, hi)]
        return {
            "tokens": [self.token_str(t, as_ids) for t in ids],
            "token_logprobs": r.output_logprobs[lo:hi],
            "top_logprobs": tops,
            "text_offset": [],
        }

    async def stream_completion(self, body: P.CompletionIn, r: Request, cid: str, created: int) -> AsyncIterator[str]:
        sent_tok, sent_txt = 0, ""
        async for n, fin in events(self.engine, r):
            text = self.partial_text(r, n, fin)
            if text.endswith("\ufffd") and not fin:
                text = text[:-1]
            delta = text[len(sent_txt) :] if text.startswith(sent_txt) else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs = self.completion_logprobs(r, sent_tok, n, body.logprobs or 0, body)
            choice: dict[str, Any] = {
                "index": 0,
                "text": delta,
                "finish_reason": _finish(r) if fin else None,
                "logprobs": logprobs,
            }
            if body.return_token_ids:
                choice["token_ids"] = r.output_ids[sent_tok:n]
            yield sse(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": body.model or self.name,
                    "choices": [choice],
                }
            )
            sent_txt = text if delta else sent_txt
            sent_tok = n
        yield "data: [DONE]\n\n"
