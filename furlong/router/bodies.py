"""Bounded request bodies for the router and the session server.

A server that reads a whole request body before looking at it can be made to hold any
amount of memory by one client. The engine refuses a body over its limit (`engine.http`,
64 MiB) before parsing it; the servers in front of it do the same, with the same default,
so nothing the engine would refuse is buffered on the way: a declared ``Content-Length``
over the limit is refused at once, and a chunked upload as soon as it passes the limit.
"""

from __future__ import annotations

from starlette.requests import Request

MAX_BODY_BYTES = 64 * 2**20  # the engine's limit (furlong.engine.http.MAX_BODY_BYTES), which it never needs to exceed


class BodyTooLarge(ValueError):
    """A request body over the server's limit; its message names the limit (HTTP 413)."""

    def __init__(self, limit: int):
        mib = f" ({limit / 2**20:g} MiB)" if limit >= 2**20 else ""
        super().__init__(f"body: request body over the limit of {limit} bytes{mib}")
        self.limit = limit


def check_limit(limit: int) -> int:
    """`limit` if it is a usable body limit, else ValueError naming `max_body_bytes`."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_body_bytes: must be a positive integer, got {limit!r}")
    return limit


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, read in chunks; BodyTooLarge as soon as it is (or says it will be) over `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)
