"""A local stand-in for Daytona: the API and toolbox calls the `daytona` SDK makes to run code.

Run as `python tests/fakes/daytona_fake.py --port P --api-key K`, then point the SDK at
it with `DAYTONA_API_URL=http://127.0.0.1:P/api`.

What it implements, as the SDK (daytona 0.2xx, async client) calls it:
- `POST /api/sandbox` (Bearer key checked, 401 otherwise) → a started Sandbox whose
  `toolboxProxyUrl` is this server's `/toolbox`; each sandbox gets its own directory;
- `GET /api/sandbox/{id}`, `DELETE /api/sandbox/{id}` (kills the sandbox's
  processes, removes its directory; 404 when unknown);
- toolbox `POST /toolbox/{id}/process/execute`: runs the command for real with
  `bash -c` in a new process group, stdout and stderr merged as the daemon does,
  `timeout` enforced (408 when it fires); toolbox `POST /toolbox/{id}/files/bulk-upload`
  (multipart `files[i].path` / `files[i].file`);
- `GET /health`. The SDK's Socket.IO event stream (`/api/socket.io/`) is not
  implemented: the SDK falls back to polling, and a started sandbox needs no events.
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


@dataclass
class Box:
    id: str
    dto: dict
    root: Path
    pids: set[int] = field(default_factory=set)
    written: list[str] = field(default_factory=list)


def make_app(api_key: str, port: int) -> FastAPI:
    app = FastAPI()
    boxes: dict[str, Box] = {}

    def denied(request: Request) -> JSONResponse | None:
        if request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"statusCode": 401, "message": "Invalid API key"}, 401)
        return None

    def missing(sandbox_id: str) -> JSONResponse:
        return JSONResponse({"statusCode": 404, "message": f"Sandbox with ID {sandbox_id} not found"}, 404)

    @app.get("/health")
    async def health():
        return {"ok": True, "sandboxes": len(boxes)}

    @app.post("/api/sandbox")
    async def create(request: Request):
        if (err := denied(request)) is not None:
            return err
        body = await request.json()
        sid = "fake-" + uuid.uuid4().hex[:12]
        now = datetime.now(UTC).isoformat()
        dto = {
            "id": sid,
            "organizationId": "fake-org",
            "name": body.get("name") or sid,
            "user": "daytona",
            "env": body.get("env") or {},
            "labels": body.get("labels") or {},
            "public": False,
            "networkBlockAll": bool(body.get("networkBlockAll")),
            "kvm": False,
            "target": "local",
            "cpu": 1,
            "gpu": 0,
            "memory": 1,
            "disk": 3,
            "state": "started",
            "desiredState": "started",
            "autoStopInterval": body.get("autoStopInterval", 15),
            "autoDeleteInterval": body.get("autoDeleteInterval", -1),
            "createdAt": now,
            "updatedAt": now,
            "toolboxProxyUrl": f"http://127.0.0.1:{port}/toolbox",
        }
        boxes[sid] = Box(sid, dto, Path(tempfile.mkdtemp(prefix="daytona-fake-")))
        return dto

    @app.get("/api/sandbox/{sandbox_id}")
    async def get(sandbox_id: str, request: Request):
        if (err := denied(request)) is not None:
            return err
        return boxes[sandbox_id].dto if sandbox_id in boxes else missing(sandbox_id)

    @app.delete("/api/sandbox/{sandbox_id}")
    async def delete(sandbox_id: str, request: Request):
        if (err := denied(request)) is not None:
            return err
        box = boxes.pop(sandbox_id, None)
        if box is None:
            return missing(sandbox_id)
        for pid in box.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        for path in box.written:
            Path(path).unlink(missing_ok=True)
        shutil.rmtree(box.root, ignore_errors=True)
        return {**box.dto, "state": "destroyed"}

    @app.post("/toolbox/{sandbox_id}/process/execute")
    async def execute(sandbox_id: str, request: Request):
        if (err := denied(request)) is not None:
            return err
        if (box := boxes.get(sandbox_id)) is None:
            return missing(sandbox_id)
        body = await request.json()
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(box.root),
            "TMPDIR": str(box.root),
            "LANG": "C.UTF-8",
            **(body.get("envs") or {}),
        }
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash",
            "-c",
            body["command"],
            cwd=body.get("cwd") or str(box.root),
            env=env,
            start_new_session=True,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        box.pids.add(proc.pid)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), body.get("timeout") or 10)
        except TimeoutError:
            return JSONResponse({"statusCode": 408, "message": "command execution timeout"}, 408)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            box.pids.discard(proc.pid)
        return {"exitCode": proc.returncode, "result": out.decode(errors="replace")}

    @app.post("/toolbox/{sandbox_id}/files/bulk-upload")
    async def upload(sandbox_id: str, request: Request):
        if (err := denied(request)) is not None:
            return err
        if (box := boxes.get(sandbox_id)) is None:
            return missing(sandbox_id)
        form = await request.form()
        i = 0
        while f"files[{i}].path" in form:
            path = Path(str(form[f"files[{i}].path"]))
            if not path.is_absolute() or not str(path).startswith("/tmp/"):
                return JSONResponse({"statusCode": 400, "message": f"the fake only writes under /tmp, not {path}"}, 400)
            path.write_bytes(await form[f"files[{i}].file"].read())
            box.written.append(str(path))
            i += 1
        return None

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", required=True)
    args = ap.parse_args()
    uvicorn.run(make_app(args.api_key, args.port), host="127.0.0.1", port=args.port, log_level="warning")
