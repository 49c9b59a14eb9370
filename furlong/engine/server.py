"""The engine's HTTP server: SGLang-native endpoints and control (OpenAI routes in `openai_api`).

The event loop never touches engine state: requests go to the scheduler
thread through `Engine.submit` / `Engine.call` (helpers in `engine.http`).
Every client error is a 400 naming the field (`BadRequest`); anything
unexpected is a 500 for that request only — the server keeps serving.

Routes come in groups, one function each, so each stays readable: generation,
tokenizer, health and info, control, weights; then the OpenAI routes.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from furlong.core import api as P
from furlong.core import omp, spans
from furlong.core.api import CONTROL_PATHS
from furlong.core.app_thread import AppThread
from furlong.engine import validate as V
from furlong.engine.adapters import apply_weights
from furlong.engine.engine import Engine
from furlong.engine.http import body_of, error, events, finished, finished_all, sse
from furlong.engine.openai_api import add_openai_routes
from furlong.engine.request import Request
from furlong.engine.weight_update import WeightUpdateError

log = logging.getLogger("furlong.engine.server")
DEFAULT_MAX_NEW_TOKENS = 128


def create_app(engine: Engine, admin_token: str | None = None) -> FastAPI:
    admin_token = admin_token or os.environ.get("FURLONG_ADMIN_TOKEN") or None
    app = FastAPI(title="furlong engine", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.groups = {}
    app.state.started = time.time()
    add_guards(app, admin_token)
    add_generation_routes(app, engine)
    add_tokenizer_routes(app, engine)
    add_info_routes(app, engine)
    add_control_routes(app, engine)
    add_weight_routes(app, engine)
    add_lora_routes(app, engine)
    add_openai_routes(app, engine)
    return app


def add_guards(app: FastAPI, admin_token: str | None) -> None:
    """The admin-token check on control paths, and errors rendered as JSON (400 naming the field, 500 for one)."""
    app.add_middleware(Guard, admin_token=admin_token)

    @app.exception_handler(P.BadRequest)
    async def bad_request(request: HTTPRequest, e: P.BadRequest):
        return error(e.status, str(e), e.param)

    @app.exception_handler(WeightUpdateError)
    async def bad_weights(request: HTTPRequest, e: WeightUpdateError):
        return error(400, str(e), "weights")


class Guard:
    """ASGI middleware: the admin token on control paths, and a 500 for one request that raises.

    Why plain ASGI, not `@app.middleware("http")`: Starlette's `BaseHTTPMiddleware` wraps every request in a
    task group and memory streams, ~0.5 ms of the event loop's CPU a request; an agent rollout sends hundreds
    of short `/generate` calls a second, and on 2 cores that CPU is taken from the engine's own forward."""

    def __init__(self, app: Callable, admin_token: str | None = None):
        self.app, self.expected = app, f"Bearer {admin_token}".encode() if admin_token else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.expected and scope["path"] in CONTROL_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                msg = "control endpoint: missing or wrong admin token (Authorization: Bearer ...)"
                return await error(401, msg, "Authorization")(scope, receive, send)
        started = False

        async def watch(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # one bad request never takes the server down
            log.exception("unhandled error on %s", scope["path"])
            if started:  # a streamed response already under way: nothing more can be said on it
                raise
            await error(500, f"internal error: {type(e).__name__}: {e}")(scope, receive, send)


def add_generation_routes(app: FastAPI, engine: Engine) -> None:
    """`POST /generate`: SGLang's native generation, one prompt or a batch, whole or streamed."""

    def build(
        prompt: list[int], field: str, body: P.GenerateIn, sp: P.SamplingParamsIn | None, rid: str | None
    ) -> Request:
        V.check_prompt(
            prompt, field, vocab=engine.vocab_size, max_context=engine.max_context, kv_tokens=engine.kv_capacity_tokens
        )
        V.check_stop_ids(sp.stop_token_ids if sp else None, "sampling_params.stop_token_ids", engine.vocab_size)
        params = V.to_sampling(
            sp, prompt_len=len(prompt), max_context=engine.max_context, default_max=DEFAULT_MAX_NEW_TOKENS
        )
        kw = {"rid": rid} if rid else {}
        return Request(
            prompt,
            params,
            return_logprob=body.return_logprob,
            logprob_start_len=body.logprob_start_len,
            top_logprobs_num=body.top_logprobs_num,
            return_routed_experts=body.return_routed_experts,
            lora=body.lora_path,
            priority=body.priority or 0,
            **kw,
        )

    def generate_requests(body: P.GenerateIn) -> tuple[list[Request], bool]:
        if body.lora_path is not None:
            check_adapter(engine, body.lora_path)
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

    @app.post(P.GENERATE)
    async def generate(request: HTTPRequest):
        body = P.parse(P.GenerateIn, await body_of(request))
        reqs, batched = generate_requests(body)
        if body.stream:
            if len(reqs) > 1:
                raise P.BadRequest("stream", "streaming supports one prompt with n=1")
            return StreamingResponse(stream_generate(reqs[0]), media_type="text/event-stream")
        await finished_all(engine, reqs)  # one engine command: the n samples of a prompt share one prefill
        out = [engine.result(r) for r in reqs]
        return JSONResponse(out if batched else out[0])

    async def stream_generate(req: Request) -> AsyncIterator[str]:
        async for n, fin in events(engine, req):
            if fin:
                out = engine.result(req)
            else:
                out = {
                    "text": engine.decode(req.output_ids[:n], req.params.skip_special_tokens),
                    "output_ids": req.output_ids[:n],
                    "meta_info": {"id": req.rid, "finish_reason": None, "completion_tokens": n},
                }
            yield sse(out)
        yield "data: [DONE]\n\n"


def add_tokenizer_routes(app: FastAPI, engine: Engine) -> None:
    """`/tokenize` and `/detokenize` with the served model's tokenizer and chat template."""

    @app.post(P.TOKENIZE)
    async def tokenize(request: HTTPRequest):
        body = P.parse(P.TokenizeIn, await body_of(request))
        if body.messages is not None:
            msgs = [m.model_dump(exclude_none=True) for m in body.messages]
            ids = engine.tokenizer.apply_chat_template(
                msgs,
                tools=body.tools,
                tokenize=True,
                return_dict=False,
                add_generation_prompt=body.add_generation_prompt,
            )
        else:
            text = body.prompt if body.prompt is not None else body.text
            if text is None:
                raise P.BadRequest("prompt", "give prompt (or text) or messages")
            ids = engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_context}

    @app.post(P.DETOKENIZE)
    async def detokenize(request: HTTPRequest):
        body = P.parse(P.DetokenizeIn, await body_of(request))
        V.check_stop_ids(body.tokens, "tokens", engine.vocab_size)
        text = engine.decode(body.tokens, body.skip_special_tokens)
        return {"prompt": text, "text": text}


def add_info_routes(app: FastAPI, engine: Engine) -> None:
    """Health, model and server info, weight version and Prometheus `/metrics`: read-only, no token needed."""

    @app.get(P.HEALTH)
    async def health():
        return {"status": "ok"}

    @app.get(P.HEALTH_GENERATE)
    async def health_generate():
        sp = V.to_sampling(
            P.SamplingParamsIn(max_new_tokens=1), prompt_len=1, max_context=engine.max_context, default_max=1
        )
        req = Request([engine.eos_ids and min(engine.eos_ids) or 0], sp)
        await asyncio.wait_for(finished(engine, req), timeout=60)
        return {"status": "ok", "weight_version": engine.weight_version}

    def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "architecture": engine.hf.config.model_type,
            "backend": engine.backend,
            "dtype": engine.dtype,
            "max_context": engine.max_context,
            "vocab_size": engine.vocab_size,
            "weight_version": engine.weight_version,
            "kv_cache_tokens": engine.kv_capacity_tokens,
            "max_running": engine.max_running,
            "is_moe": engine.model.is_moe,
            "lora_adapters": sorted(adapters.loaded) if (adapters := getattr(engine.model, "adapters", None)) else None,
        }

    app.get(P.MODEL_INFO)(model_info)
    app.get(P.SERVER_INFO)(
        lambda: {
            **model_info(),
            "paused": engine.paused,
            "threads": engine.threads,
            "uptime_s": time.time() - app.state.started,
        }
    )
    app.get(P.WEIGHT_VERSION)(lambda: {"weight_version": engine.weight_version})

    @app.get(spans.SPANS_PATH)
    def timeline_spans(since: int = 0) -> dict[str, Any]:
        """This process's spans after `since` (read-only, like /metrics): the driver pulls them each step."""
        return spans.RECORDER.since(since)

    @app.get(P.METRICS)
    async def metrics():
        g = {
            "running_requests": len(engine.running),
            "waiting_requests": len(engine.waiting),
            "kv_cache_usage": engine.pool.used / engine.pool.num_blocks,
            "kv_cache_blocks": engine.pool.num_blocks,
            "prefix_cache_hit_tokens_total": engine.pool.hit_tokens,
            "weight_version": engine.weight_version,
            "paused": int(engine.paused is not None),
        }
        lines = []
        for name, v in list(engine.stats.items()) + list(g.items()):
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# TYPE furlong_engine_{name} {kind}", f"furlong_engine_{name} {v}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def add_control_routes(app: FastAPI, engine: Engine) -> None:
    """Abort, pause, continue, threads and flush: what changes what an engine is doing (admin token required)."""

    @app.post(P.ABORT)
    async def abort_request(request: HTTPRequest):
        body = P.parse(P.AbortIn, await body_of(request))
        if not body.abort_all and not body.rid:
            raise P.BadRequest("rid", "give rid or abort_all=true")
        n = await asyncio.wrap_future(engine.abort(None if body.abort_all else body.rid))
        return {"success": True, "aborted": n}

    @app.post(P.PAUSE)
    async def pause_generation(request: HTTPRequest):
        body = P.parse(P.PauseIn, await body_of(request))
        await asyncio.wrap_future(engine.pause(body.mode))
        return {"success": True, "mode": body.mode}

    @app.post(P.CONTINUE)
    async def continue_generation(request: HTTPRequest):
        await asyncio.wrap_future(engine.resume())
        return {"success": True}

    @app.post(P.SET_THREADS)
    async def set_threads(request: HTTPRequest):
        body = P.parse(P.SetThreadsIn, await body_of(request))
        if body.threads > (cpus := os.cpu_count() or 1):
            raise P.BadRequest("threads", f"must be at most this machine's {cpus} CPUs, got {body.threads}")
        return {"success": True, "threads": await asyncio.wrap_future(engine.set_threads(body.threads))}

    @app.api_route(P.FLUSH_CACHE, methods=["GET", "POST"])
    async def flush_cache():
        await asyncio.wrap_future(engine.flush_cache())
        return {"success": True}


def add_weight_routes(app: FastAPI, engine: Engine) -> None:
    """Weight updates (shared memory, disk, a torch.distributed group) and checksums (admin token required)."""

    async def apply(named: dict, version: Any) -> JSONResponse:
        v = P.version(version)
        new = await asyncio.wrap_future(engine.call(lambda: apply_weights(engine, named, v)))
        return JSONResponse({"success": True, "message": f"updated {len(named)} tensors", "weight_version": new})

    @app.post(P.UPDATE_FROM_TENSOR)
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

    @app.post(P.UPDATE_FROM_DISK)
    async def update_from_disk(request: HTTPRequest):
        from furlong.engine.weight_update import load_disk

        body = P.parse(P.UpdateFromDiskIn, await body_of(request))
        named = await asyncio.to_thread(omp.released, load_disk, engine.hf, body.model_path)
        return await apply(named, body.weight_version)

    @app.post(P.WEIGHT_CHECKSUMS)
    async def weights_checksum(request: HTTPRequest):
        """Shape, dtype and CRC32 of every (or each named) parameter: lets a sender verify a sync or skip
        unchanged tensors."""
        from furlong.engine.quantized import held_state_dict
        from furlong.weights.tensors import checksum, dtype_name

        body = await body_of(request)
        names = body.get("names") if isinstance(body, dict) else None
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise P.BadRequest("names", "must be a list of parameter names")

        def snapshot() -> dict:
            sd = held_state_dict(engine.hf, engine.model)  # quantised weights: their codes + scales
            if getattr(engine.model, "adapters", None) is not None:
                sd.update(engine.model.adapters.tensors())  # adapter-only sync's tensors, by their sync names
            unknown = [n for n in names or [] if n not in sd]
            if unknown:
                raise P.BadRequest("names", f"no such parameter {unknown[0]!r}")
            return {
                "weight_version": engine.weight_version,
                "tensors": {
                    n: {"shape": list(sd[n].shape), "dtype": dtype_name(sd[n].dtype), "crc32": checksum(sd[n])}
                    for n in (names or sd)
                },
            }

        return await asyncio.wrap_future(engine.call(snapshot))

    add_group_routes(app, engine, apply)


def add_group_routes(app: FastAPI, engine: Engine, apply: Callable[[dict, Any], Awaitable[JSONResponse]]) -> None:
    """Joining, leaving and receiving over a torch.distributed weight-update group (SGLang's broadcast sync)."""

    @app.post(P.INIT_GROUP)
    async def init_group(request: HTTPRequest):
        from furlong.weights.dist import init_group as join

        body = P.parse(P.InitGroupIn, await body_of(request))
        if body.rank_offset >= body.world_size:
            raise P.BadRequest("rank_offset", f"{body.rank_offset} is not a rank of a {body.world_size}-rank group")
        try:
            group = await asyncio.to_thread(
                join,
                body.master_address,
                body.master_port,
                body.world_size,
                body.rank_offset,
                body.backend,
                body.timeout_s,
            )
        except ValueError as e:
            raise P.BadRequest("backend", str(e)) from None
        except Exception as e:
            raise P.BadRequest("master_address", f"cannot join group: {e}") from None
        app.state.groups[body.group_name] = group
        return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}

    @app.post(P.DESTROY_GROUP)
    async def destroy_group(request: HTTPRequest):
        body = await body_of(request)
        name = body.get("group_name", "weight_update_group") if isinstance(body, dict) else None
        if app.state.groups.pop(name, None) is None:
            raise P.BadRequest("group_name", f"no group {name!r}")
        return {"success": True}

    @app.post(P.UPDATE_FROM_DISTRIBUTED)
    async def update_from_distributed(request: HTTPRequest):
        from furlong.engine.weight_update import receive_distributed

        body = P.parse(P.UpdateFromDistributedIn, await body_of(request))
        group = app.state.groups.get(body.group_name)
        if group is None:
            raise P.BadRequest("group_name", f"no group {body.group_name!r}; call /init_weights_update_group first")
        device = next(engine.hf.parameters()).device
        named = await asyncio.to_thread(
            omp.released, receive_distributed, group, body.names, body.dtypes, body.shapes, device=device
        )
        return await apply(named, body.weight_version)


def check_adapter(engine: Engine, name: str | None = None, field: str = "lora_path") -> None:
    """The engine must serve adapters and `name` (when given) be loaded; else a 400 naming `field`."""
    adapters = getattr(engine.model, "adapters", None)
    if adapters is None:
        raise P.BadRequest(field, f"the {engine.backend} backend serves no LoRA adapters (native backend only)")
    if name is not None and name not in adapters.loaded:
        raise P.BadRequest(
            field, f"no adapter {name!r} loaded (loaded: {sorted(adapters.loaded)}); load it with {P.LOAD_LORA}"
        )


def add_lora_routes(app: FastAPI, engine: Engine) -> None:
    """SGLang's `/load_lora_adapter` and `/unload_lora_adapter` (admin token required): adapters by name."""

    def answer() -> JSONResponse:
        return JSONResponse({"success": True, "error_message": "", "loaded_adapters": engine.model.adapters.listing()})

    def as_bad_request(e: WeightUpdateError) -> P.BadRequest:
        field, _, msg = str(e).partition(": ")
        return P.BadRequest(field, msg)

    @app.post(P.LOAD_LORA)
    async def load_lora_adapter(request: HTTPRequest):
        body = P.parse(P.LoadLoraIn, await body_of(request))
        check_adapter(engine)
        try:
            adapter = await asyncio.to_thread(
                omp.released, engine.model.adapters.load_dir, body.lora_name, body.lora_path
            )
            await asyncio.wrap_future(engine.call(lambda: engine.model.adapters.install(adapter)))
        except WeightUpdateError as e:
            raise as_bad_request(e) from None
        return answer()

    @app.post(P.UNLOAD_LORA)
    async def unload_lora_adapter(request: HTTPRequest):
        body = P.parse(P.UnloadLoraIn, await body_of(request))
        check_adapter(engine, field="lora_name")

        def unload() -> None:
            users = sum(r.lora == body.lora_name for r in list(engine.running) + list(engine.waiting))
            if users:
                raise P.BadRequest("lora_name", f"adapter {body.lora_name!r} serves {users} requests in flight")
            try:
                engine.model.adapters.unload(body.lora_name)
            except WeightUpdateError as e:
                raise as_bad_request(e) from None

        await asyncio.wrap_future(engine.call(unload))
        return answer()


class ServerThread(AppThread):
    """The engine's HTTP server in a thread of this process (tests, benchmarks, colocated engines).

    The engine must already be started; the server starts on `start()` or `with`.
    """

    def __init__(self, engine: Engine, admin_token: str | None = None, host: str = "127.0.0.1", port: int = 0):
        super().__init__(create_app(engine, admin_token), host, port, name="furlong-engine")
