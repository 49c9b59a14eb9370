"""The engine's HTTP server: SGLang-native endpoints and control (OpenAI routes in `openai_api`).

The event loop never touches engine state: requests go to the scheduler
thread through `Engine.submit` / `Engine.call`, and results come back through
a listener that hops onto the loop with `call_soon_threadsafe`. Every client
error is a 400 naming the field (`BadRequest`); anything unexpected is a 500
for that request only — the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from contextlib import ExitStack
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from furlong.app_thread import AppThread
from furlong.engine import protocol as P
from furlong.engine.request import Request
from furlong.engine.scheduler import Engine
from furlong.engine.weight_update import WeightUpdateError

log = logging.getLogger("furlong.engine.server")
CONTROL_PATHS = ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
                 "/update_weights_from_tensor", "/update_weights_from_disk", "/update_weights_from_distributed",
                 "/init_weights_update_group", "/destroy_weights_update_group", "/get_weights_checksum")
DEFAULT_MAX_NEW_TOKENS = 128


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "UnauthorizedError" if status == 401 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status},
                         "success": False, "message": message}, status_code=status)


MAX_BODY_BYTES = 64 * 2**20  # a request body above this is refused (413) before it is parsed


async def body_of(request: HTTPRequest) -> Any:
    """The JSON body, read in chunks up to MAX_BODY_BYTES (chunked uploads included)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise P.BadRequest("body", f"request body over {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.BadRequest("body", f"malformed JSON: {e}") from None
    except RecursionError:
        raise P.BadRequest("body", "JSON nested too deeply") from None


async def finished(engine: Engine, req: Request) -> Request:
    """Submit and wait for the request to finish; aborts it if the caller goes away."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_event(r: Request, n: int, fin: bool) -> None:
        if fin:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    req.listener = on_event
    engine.submit(req)
    try:
        await done
    except asyncio.CancelledError:
        engine.abort(req.rid)
        raise
    return req


async def events(engine: Engine, req: Request) -> AsyncIterator[tuple[int, bool]]:
    """Yield (tokens so far, finished) as the scheduler produces tokens."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
    req.stream = True
    req.listener = lambda r, n, fin: loop.call_soon_threadsafe(q.put_nowait, (len(r.output_ids), fin))
    engine.submit(req)
    try:
        while True:
            n, fin = await q.get()
            while not fin and not q.empty():  # coalesce what piled up
                n, fin = q.get_nowait()
            yield n, fin
            if fin:
                return
    finally:
        if not req.finished:
            engine.abort(req.rid)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine: Engine, admin_token: str | None = None) -> FastAPI:
    admin_token = admin_token or os.environ.get("FURLONG_ADMIN_TOKEN") or None
    app = FastAPI(title="furlong engine", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.groups = {}
    app.state.started = time.time()

    @app.middleware("http")
    async def guard(request: HTTPRequest, call_next):
        if admin_token and request.url.path in CONTROL_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {admin_token}".encode()):
                return error(401, "control endpoint: missing or wrong admin token (Authorization: Bearer ...)", "Authorization")
        try:
            return await call_next(request)
        except Exception as e:  # one bad request never takes the server down
            log.exception("unhandled error on %s", request.url.path)
            return error(500, f"internal error: {type(e).__name__}: {e}")

    @app.exception_handler(P.BadRequest)
    async def bad_request(request: HTTPRequest, e: P.BadRequest):
        return error(e.status, str(e), e.param)

    @app.exception_handler(WeightUpdateError)
    async def bad_weights(request: HTTPRequest, e: WeightUpdateError):
        return error(400, str(e), "weights")

    # ------------------------------------------------------------------ generation
    def build(prompt: list[int], field: str, body: P.GenerateIn, sp: P.SamplingParamsIn | None, rid: str | None) -> Request:
        P.check_prompt(prompt, field, vocab=engine.vocab_size, max_context=engine.max_context, kv_tokens=engine.kv_capacity_tokens)
        P.check_stop_ids(sp.stop_token_ids if sp else None, "sampling_params.stop_token_ids", engine.vocab_size)
        params = P.to_sampling(sp, prompt_len=len(prompt), max_context=engine.max_context, default_max=DEFAULT_MAX_NEW_TOKENS)
        kw = {"rid": rid} if rid else {}
        return Request(prompt, params, return_logprob=body.return_logprob, logprob_start_len=body.logprob_start_len,
                       top_logprobs_num=body.top_logprobs_num, return_routed_experts=body.return_routed_experts, **kw)

    def generate_requests(body: P.GenerateIn) -> tuple[list[Request], bool]:
        if body.lora_path:
            raise P.BadRequest("lora_path", "the built-in engine serves no LoRA adapters yet")
        if (body.text is None) == (body.input_ids is None):
            raise P.BadRequest("input_ids", "give exactly one of input_ids or text")
        if body.input_ids is not None:
            batched = bool(body.input_ids) and isinstance(body.input_ids[0], list)
            prompts = body.input_ids if batched else [body.input_ids]
            field = "input_ids"
        else:
            batched = isinstance(body.text, list)
            texts = body.text if batched else [body.text]
            prompts = [engine.tokenizer.encode(t) for t in texts]
            field = "text"
        if batched and not prompts:
            raise P.BadRequest(field, "empty batch")
        n = body.sampling_params.n if body.sampling_params else 1
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
        if len(rids) != len(prompts):
            raise P.BadRequest("rid", f"{len(rids)} rids for {len(prompts)} prompts")
        if body.return_routed_experts and not engine.model.is_moe:
            raise P.BadRequest("return_routed_experts", "the model has no routed experts")
        reqs = []
        for i, (prompt, rid) in enumerate(zip(prompts, rids)):
            for j in range(n):
                r_id = (f"{rid}-{j}" if n > 1 else rid) if rid else None
                reqs.append(build(prompt, f"{field}[{i}]" if batched else field, body, body.sampling_params, r_id))
        return reqs, batched or n > 1

    @app.post("/generate")
    async def generate(request: HTTPRequest):
        body = P.parse(P.GenerateIn, await body_of(request))
        reqs, batched = generate_requests(body)
        if body.stream:
            if len(reqs) > 1:
                raise P.BadRequest("stream", "streaming supports one prompt with n=1")
            return StreamingResponse(stream_generate(reqs[0]), media_type="text/event-stream")
        await asyncio.gather(*(finished(engine, r) for r in reqs))
        out = [engine.result(r) for r in reqs]
        return JSONResponse(out if batched else out[0])

    async def stream_generate(req: Request) -> AsyncIterator[str]:
        async for n, fin in events(engine, req):
            out = engine.result(req) if fin else {"text": engine.decode(req.output_ids[:n], req.params.skip_special_tokens),
                                                 "output_ids": req.output_ids[:n],
                                                 "meta_info": {"id": req.rid, "finish_reason": None, "completion_tokens": n}}
            yield sse(out)
        yield "data: [DONE]\n\n"

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        body = P.parse(P.TokenizeIn, await body_of(request))
        if body.messages is not None:
            msgs = [m.model_dump(exclude_none=True) for m in body.messages]
            ids = engine.tokenizer.apply_chat_template(msgs, tools=body.tools, add_generation_prompt=body.add_generation_prompt, tokenize=True, return_dict=False)
        else:
            text = body.prompt if body.prompt is not None else body.text
            if text is None:
                raise P.BadRequest("prompt", "give prompt (or text) or messages")
            ids = engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_context}

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        body = P.parse(P.DetokenizeIn, await body_of(request))
        P.check_stop_ids(body.tokens, "tokens", engine.vocab_size)
        text = engine.decode(body.tokens, body.skip_special_tokens)
        return {"prompt": text, "text": text}

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        req = Request([engine.eos_ids and min(engine.eos_ids) or 0], P.to_sampling(P.SamplingParamsIn(max_new_tokens=1), prompt_len=1, max_context=engine.max_context, default_max=1))
        await asyncio.wait_for(finished(engine, req), timeout=60)
        return {"status": "ok", "weight_version": engine.weight_version}

    def model_info() -> dict[str, Any]:
        return {"model_path": engine.model_path, "tokenizer_path": engine.model_path, "is_generation": True,
                "architecture": engine.hf.config.model_type, "backend": engine.backend, "dtype": engine.dtype,
                "max_context": engine.max_context, "vocab_size": engine.vocab_size, "weight_version": engine.weight_version,
                "kv_cache_tokens": engine.kv_capacity_tokens, "max_running": engine.max_running, "is_moe": engine.model.is_moe}

    app.get("/get_model_info")(model_info)
    app.get("/get_server_info")(lambda: {**model_info(), "paused": engine.paused, "uptime_s": time.time() - app.state.started})
    app.get("/get_weight_version")(lambda: {"weight_version": engine.weight_version})

    @app.get("/metrics")
    async def metrics():
        g = {"running_requests": len(engine.running), "waiting_requests": len(engine.waiting),
             "kv_cache_usage": engine.pool.used / engine.pool.num_blocks, "kv_cache_blocks": engine.pool.num_blocks,
             "prefix_cache_hit_tokens_total": engine.pool.hit_tokens, "weight_version": engine.weight_version,
             "paused": int(engine.paused is not None)}
        lines = []
        for name, v in list(engine.stats.items()) + list(g.items()):
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# TYPE furlong_engine_{name} {kind}", f"furlong_engine_{name} {v}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ control
    @app.post("/abort_request")
    async def abort_request(request: HTTPRequest):
        body = P.parse(P.AbortIn, await body_of(request))
        if not body.abort_all and not body.rid:
            raise P.BadRequest("rid", "give rid or abort_all=true")
        n = await asyncio.wrap_future(engine.abort(None if body.abort_all else body.rid))
        return {"success": True, "aborted": n}

    @app.post("/pause_generation")
    async def pause_generation(request: HTTPRequest):
        body = P.parse(P.PauseIn, await body_of(request))
        await asyncio.wrap_future(engine.pause(body.mode))
        return {"success": True, "mode": body.mode}

    @app.post("/continue_generation")
    async def continue_generation(request: HTTPRequest):
        await asyncio.wrap_future(engine.resume())
        return {"success": True}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        await asyncio.wrap_future(engine.flush_cache())
        return {"success": True}

    async def apply(named: dict, version: Any) -> JSONResponse:
        v = P.version(version)
        new = await asyncio.wrap_future(engine.call(lambda: engine.apply_weights(named, v)))
        return JSONResponse({"success": True, "message": f"updated {len(named)} tensors", "weight_version": new})

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: HTTPRequest):
        """Copy straight from the sender's shared memory into the parameters (one copy, no staging buffer).

        The views are opened and checked off the event loop (mapping and CRC32 take
        time); only those errors are the handle's fault (400 `shm`). The apply runs
        on the scheduler thread while the views are alive, and keeps its own
        all-or-nothing check (400 naming the tensor, old weights kept).
        """
        from furlong.weights.tensors import shm_views

        body = P.parse(P.UpdateFromTensorIn, await body_of(request))
        with ExitStack() as stack:
            try:
                named = await asyncio.to_thread(stack.enter_context, shm_views(body.shm))
            except (ValueError, TypeError) as e:
                raise P.BadRequest("shm", str(e)) from None
            return await apply(named, body.weight_version)

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: HTTPRequest):
        from furlong.engine.weight_update import load_disk

        body = P.parse(P.UpdateFromDiskIn, await body_of(request))
        named = await asyncio.to_thread(load_disk, engine.hf, body.model_path)
        return await apply(named, body.weight_version)

    @app.post("/get_weights_checksum")
    async def weights_checksum(request: HTTPRequest):
        """Shape, dtype and CRC32 of every (or each named) parameter: lets a sender verify a sync or skip unchanged tensors."""
        from furlong.weights.tensors import checksum, dtype_name

        body = await body_of(request)
        names = body.get("names") if isinstance(body, dict) else None
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise P.BadRequest("names", "must be a list of parameter names")

        def snapshot() -> dict:
            sd = engine.hf.state_dict()
            unknown = [n for n in names or [] if n not in sd]
            if unknown:
                raise P.BadRequest("names", f"no such parameter {unknown[0]!r}")
            return {"weight_version": engine.weight_version, "tensors": {
                n: {"shape": list(sd[n].shape), "dtype": dtype_name(sd[n].dtype), "crc32": checksum(sd[n])} for n in (names or sd)}}

        return await asyncio.wrap_future(engine.call(snapshot))

    @app.post("/init_weights_update_group")
    async def init_group(request: HTTPRequest):
        from furlong.weights.dist import init_group as join

        body = P.parse(P.InitGroupIn, await body_of(request))
        if body.rank_offset >= body.world_size:
            raise P.BadRequest("rank_offset", f"{body.rank_offset} is not a rank of a {body.world_size}-rank group")
        try:
            group = await asyncio.to_thread(join, body.master_address, body.master_port, body.world_size,
                                            body.rank_offset, body.backend, body.timeout_s)
        except ValueError as e:
            raise P.BadRequest("backend", str(e)) from None
        except Exception as e:
            raise P.BadRequest("master_address", f"cannot join group: {e}") from None
        app.state.groups[body.group_name] = group
        return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: HTTPRequest):
        body = await body_of(request)
        name = body.get("group_name", "weight_update_group") if isinstance(body, dict) else None
        if app.state.groups.pop(name, None) is None:
            raise P.BadRequest("group_name", f"no group {name!r}")
        return {"success": True}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: HTTPRequest):
        from furlong.engine.weight_update import receive_distributed

        body = P.parse(P.UpdateFromDistributedIn, await body_of(request))
        group = app.state.groups.get(body.group_name)
        if group is None:
            raise P.BadRequest("group_name", f"no group {body.group_name!r}; call /init_weights_update_group first")
        device = next(engine.hf.parameters()).device
        named = await asyncio.to_thread(receive_distributed, group, body.names, body.dtypes, body.shapes, device=device)
        return await apply(named, body.weight_version)

    from furlong.engine.openai_api import add_openai_routes

    add_openai_routes(app, engine)
    return app


class ServerThread(AppThread):
    """The engine's HTTP server in a thread of this process (tests, benchmarks, colocated engines).

    The engine must already be started; the server starts on `start()` or `with`.
    """

    def __init__(self, engine: Engine, admin_token: str | None = None, host: str = "127.0.0.1", port: int = 0):
        super().__init__(create_app(engine, admin_token), host, port, name="furlong-engine")
