"""A local stand-in for E2B: the control-plane REST calls and the envd calls the `e2b` SDK makes.

Run as `python tests/fakes/e2b_fake.py --port P --api-key K`, then point the SDK at it
with `E2B_API_URL=E2B_SANDBOX_URL=http://127.0.0.1:P` and `E2B_HTTP_VERSION=1.1`
(uvicorn speaks HTTP/1.1; Connect streaming works over it as over HTTP/2).

What it implements, as the SDK (e2b 2.x) calls it:
- `POST /v2/sandboxes` (X-API-KEY checked, 401 otherwise) → 201 with sandboxID,
  envdVersion and envdAccessToken; each sandbox gets its own directory;
- `DELETE /sandboxes/{id}` → 204 (404 when unknown): kills the sandbox's processes
  and removes its directory; `GET /sandboxes/{id}` for the SDK's health probes;
- envd `POST /process.Process/Start` (Connect server stream, JSON codec, served by
  the SDK's own generated `ProcessASGIApplication`): runs the command for real
  (`/bin/bash -l -c ...`) in a new process group and streams start, stdout/stderr
  data and end events; `SendSignal` kills a process group; every envd call checks
  `E2b-Sandbox-Id` and `X-Access-Token` against the created sandbox;
- envd `POST /files?path=` (multipart `file` or octet-stream), `GET /health`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.client_shared import ENVD_JSON_CODEC
from e2b.envd.process import process_connect, process_pb
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from protobuf import Oneof

ENVD_VERSION = "0.6.4"


@dataclass
class Box:
    id: str
    token: str
    root: Path
    allow_internet: bool
    pids: set[int] = field(default_factory=set)
    written: list[str] = field(default_factory=list)


class Fake:
    def __init__(self, api_key: str):
        self.api_key = api_key
        self.boxes: dict[str, Box] = {}

    def box(self, headers) -> Box:
        box = self.boxes.get(headers.get("e2b-sandbox-id", ""))
        if box is None:
            raise ConnectError(Code.NOT_FOUND, "sandbox not found")
        if headers.get("x-access-token") != box.token:
            raise ConnectError(Code.UNAUTHENTICATED, "invalid access token")
        return box

    def kill(self, box: Box) -> None:
        for pid in box.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        for path in box.written:
            Path(path).unlink(missing_ok=True)
        shutil.rmtree(box.root, ignore_errors=True)


def event(**kw) -> process_pb.StartResponse:
    ((name, value),) = kw.items()
    return process_pb.StartResponse(event=process_pb.ProcessEvent(event=Oneof(name, value)))


class Process(process_connect.Process):
    """envd's process service: Start runs the command for real and streams its output; calls the SDK
    does not make here answer UNIMPLEMENTED (the generated base class)."""

    def __init__(self, fake: Fake):
        self.fake = fake

    async def start(self, request: process_pb.StartRequest, ctx) -> AsyncIterator[process_pb.StartResponse]:
        box = self.fake.box(ctx.request_headers)
        cfg = request.process
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(box.root),
            "TMPDIR": str(box.root),
            "LANG": "C.UTF-8",
            **dict(cfg.envs or {}),
        }
        proc = await asyncio.create_subprocess_exec(
            cfg.cmd,
            *cfg.args,
            cwd=cfg.cwd or str(box.root),
            env=env,
            start_new_session=True,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        box.pids.add(proc.pid)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(stream, name):
            while chunk := await stream.read(32768):
                await queue.put((name, chunk))
            await queue.put(None)

        pumps = [asyncio.create_task(pump(proc.stdout, "stdout")), asyncio.create_task(pump(proc.stderr, "stderr"))]
        try:
            yield event(start=process_pb.ProcessEvent.StartEvent(pid=proc.pid))
            open_streams = 2
            while open_streams:
                item = await queue.get()
                if item is None:
                    open_streams -= 1
                else:
                    yield event(data=process_pb.ProcessEvent.DataEvent(output=Oneof(item[0], item[1])))
            code = await proc.wait()
            yield event(end=process_pb.ProcessEvent.EndEvent(exit_code=code, exited=True, status=f"exit status {code}"))
        finally:  # the client went away (deadline, kill) or the command ended: nothing of it may outlive the call
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            for p in pumps:
                p.cancel()
            box.pids.discard(proc.pid)

    async def send_signal(self, request: process_pb.SendSignalRequest, ctx) -> process_pb.SendSignalResponse:
        box = self.fake.box(ctx.request_headers)
        pid = request.process.selector.value
        if pid not in box.pids:
            raise ConnectError(Code.NOT_FOUND, f"process {pid} not found")
        os.killpg(pid, signal.SIGKILL if request.signal == process_pb.Signal.SIGKILL else signal.SIGTERM)
        return process_pb.SendSignalResponse()


def make_app(api_key: str):
    fake = Fake(api_key)
    api = FastAPI()
    rpc = process_connect.ProcessASGIApplication(Process(fake), codecs=[ENVD_JSON_CODEC])

    @api.get("/health")
    async def health():
        return {"ok": True, "sandboxes": len(fake.boxes)}

    @api.post("/v2/sandboxes")
    async def create(request: Request):
        if request.headers.get("x-api-key") != fake.api_key:
            return JSONResponse({"code": 401, "message": "Invalid API key"}, status_code=401)
        body = await request.json()
        box = Box(
            id="fake" + uuid.uuid4().hex[:12],
            token=uuid.uuid4().hex,
            root=Path(tempfile.mkdtemp(prefix="e2b-fake-")),
            allow_internet=body.get("allowInternetAccess", True),
        )
        fake.boxes[box.id] = box
        return JSONResponse(
            {
                "templateID": body["templateID"],
                "sandboxID": box.id,
                "clientID": "fake",
                "envdVersion": ENVD_VERSION,
                "envdAccessToken": box.token,
                "domain": None,
            },
            201,
        )

    @api.get("/sandboxes/{sandbox_id}")
    async def info(sandbox_id: str, request: Request):
        if sandbox_id not in fake.boxes:
            return JSONResponse({"code": 404, "message": f"sandbox {sandbox_id} not found"}, 404)
        return {"sandboxID": sandbox_id, "state": "running"}

    @api.delete("/sandboxes/{sandbox_id}")
    async def kill(sandbox_id: str, request: Request):
        if request.headers.get("x-api-key") != fake.api_key:
            return JSONResponse({"code": 401, "message": "Invalid API key"}, status_code=401)
        box = fake.boxes.pop(sandbox_id, None)
        if box is None:
            return JSONResponse({"code": 404, "message": f"sandbox {sandbox_id} not found"}, 404)
        fake.kill(box)
        return Response(status_code=204)

    @api.post("/files")
    async def write(request: Request, path: str):
        try:
            box = fake.box(request.headers)
        except ConnectError as e:
            return JSONResponse({"code": 404, "message": e.message}, 404 if e.code == Code.NOT_FOUND else 401)
        if request.headers.get("content-type", "").startswith("multipart/"):  # older envd; needs python-multipart
            data = await (await request.form())["file"].read()
        else:  # application/octet-stream
            data = await request.body()
        target = Path(path)
        if not target.is_absolute() or not str(target).startswith("/tmp/"):
            return JSONResponse({"code": 400, "message": f"the fake only writes under /tmp, not {path}"}, 400)
        target.write_bytes(data)
        box.written.append(str(target))
        return [{"name": target.name, "type": "file", "path": str(target)}]

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/process.Process/"):
            return await rpc(scope, receive, send)
        return await api(scope, receive, send)

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", required=True)
    args = ap.parse_args()
    uvicorn.run(make_app(args.api_key), host="127.0.0.1", port=args.port, log_level="warning")
