"""HTTP helpers every engine route shares: error bodies, bounded JSON bodies, waiting on and streaming a request.

They sit apart from the routes so that the native routes (`server`) and the OpenAI routes
(`openai_api`) both import them, and neither imports the other.

The event loop never touches engine state: a request goes to the scheduler thread through
`Engine.submit`, and its progress comes back through a listener that hops onto the loop
with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from furlong.core import api as P
from furlong.engine.engine import Engine
from furlong.engine.request import Request

MAX_BODY_BYTES = 64 * 2**20  # a request body above this is refused (413) before it is parsed


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error body both OpenAI clients (`error.message`) and SGLang-style clients (`success`, `message`) read."""
    kind = "BadRequestError" if status == 400 else "UnauthorizedError" if status == 401 else "InternalServerError"
    return JSONResponse(
        {
            "error": {"message": message, "type": kind, "param": param, "code": status},
            "success": False,
            "message": message,
        },
        status_code=status,
    )


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


async def finished_all(engine: Engine, reqs: list[Request]) -> list[Request]:
    """`finished` for several requests submitted in one engine command, so they are admitted in the same
    step and the ones with the same prompt (`sampling_params.n`) share one prefill."""
    if len(reqs) == 1:
        return [await finished(engine, reqs[0])]
    loop = asyncio.get_running_loop()
    dones = [loop.create_future() for _ in reqs]

    def listener(done: asyncio.Future) -> Callable[[Request, int, bool], None]:
        def on_event(r: Request, n: int, fin: bool) -> None:
            if fin:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        return on_event

    for r, done in zip(reqs, dones):
        r.listener = listener(done)
    engine.submit_many(reqs)
    try:
        await asyncio.gather(*dones)
    except asyncio.CancelledError:
        for r in reqs:
            engine.abort(r.rid)
        raise
    return reqs


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
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
