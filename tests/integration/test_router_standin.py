"""Router behaviour against stand-in engines: deterministic, strict, fast to start.

The stand-in speaks the engine HTTP contract (DESIGN §3) with canned outputs, so every
router property — byte-exact passthrough, stickiness, balancing, health, failover,
fan-out, bad input — is checked here in seconds; `test_router_engines.py` repeats the
acceptance checks with real `furlong serve` processes. Run this file as a script
(`python test_router_standin.py PORT`) to serve one stand-in in its own process: the
failover test SIGKILLs such processes mid-request.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CONTROL = (
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
)
GENERATE_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream"}
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "seed"}


def _bad(field: str, why: str) -> JSONResponse:
    return JSONResponse({"error": {"message": f"{field}: {why}", "code": 400}}, status_code=400)


def make_engine(name: str, admin_token: str | None = None) -> Starlette:
    """A stand-in engine: strict validation, deterministic outputs, a record of control calls."""
    state = {"healthy": True, "fail_control": False, "version": 0, "calls": []}

    async def body_of(request: Request) -> dict | JSONResponse:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _bad("body", "not valid JSON")
        return body if isinstance(body, dict) else _bad("body", "expected a JSON object")

    async def delay(request: Request) -> None:
        await asyncio.sleep(float(request.headers.get("x-test-delay", "0")))

    def tokens(prompt: list[int], n: int) -> list[int]:
        return [(sum(prompt) + i) % 97 for i in range(n)]

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True}) if state["healthy"] else JSONResponse({"ok": False}, status_code=503)

    async def generate(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        for k in body:
            if k not in GENERATE_FIELDS:
                return _bad(k, "unknown field")
        ids = body.get("input_ids")
        if ids is None:
            text = body.get("text")
            if not isinstance(text, str):
                return _bad("input_ids", "give input_ids (list of ints) or text (string)")
            ids = list(text.encode())
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < 256 for i in ids):
            return _bad("input_ids", "expected a list of token ids in [0, 256)")
        sp = body.get("sampling_params", {})
        if not isinstance(sp, dict):
            return _bad("sampling_params", "expected an object")
        for k in sp:
            if k not in SAMPLING_FIELDS:
                return _bad(f"sampling_params.{k}", "unknown field")
        n = sp.get("max_new_tokens", 8)
        if type(n) is not int or not 0 <= n <= 256:
            return _bad("sampling_params.max_new_tokens", "expected an int in [0, 256]")
        rid = body.get("rid", "r")
        if not isinstance(rid, str):
            return _bad("rid", "expected a string")
        await delay(request)
        out = tokens(ids, n)
        v = str(state["version"])
        meta = {
            "id": rid,
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(ids),
            "completion_tokens": n,
            "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(out)],
            "weight_version": v,
            "output_token_versions": [v] * n,
        }
        return JSONResponse({"text": " ".join(map(str, out)), "output_ids": out, "meta_info": meta})

    async def chat(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _bad("messages", "expected a non-empty list")
        n = body.get("max_tokens", 4)
        if type(n) is not int or not 0 <= n <= 64:
            return _bad("max_tokens", "expected an int in [0, 64]")
        await delay(request)
        words = [f"w{t}" for t in tokens([len(json.dumps(messages))], n)]
        base = {"id": "chatcmpl-1", "created": 1, "model": "standin", "system_fingerprint": name}
        if body.get("stream"):

            async def events():
                for w in words:
                    chunk = {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                    await asyncio.sleep(float(request.headers.get("x-test-chunk-delay", "0")))
                done = {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                }
                yield f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(
            {
                **base,
                "object": "chat.completion",
                "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
                "choices": [
                    {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "".join(words)}}
                ],
            }
        )

    async def tokenize(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        if not isinstance(body.get("prompt"), str):
            return _bad("prompt", "expected a string")
        return JSONResponse({"tokens": list(body["prompt"].encode()), "count": len(body["prompt"].encode())})

    async def control(request: Request) -> Response:
        if admin_token and request.headers.get("authorization") != f"Bearer {admin_token}":
            return JSONResponse({"error": {"message": "admin token", "code": 401}}, status_code=401)
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        path = request.url.path
        state["calls"].append([path, body])
        if state["fail_control"]:
            return JSONResponse({"error": {"message": "broken", "code": 500}}, status_code=500)
        if path == "/pause_generation" and body.get("mode", "retract") not in ("retract", "in_place", "abort"):
            return _bad("mode", "expected retract, in_place or abort")
        if path == "/update_weights_from_disk":
            if not isinstance(body.get("model_path"), str):
                return _bad("model_path", "expected a string")
            state["version"] += 1
        return JSONResponse({"success": True, "message": name, "weight_version": str(state["version"])})

    async def model_info(request: Request) -> Response:
        return JSONResponse({"model_path": "standin", "name": name})

    async def test_state(request: Request) -> Response:  # test-only: read and flip the stand-in's state
        if request.method == "POST":
            state.update(json.loads(await request.body()))
        return JSONResponse(state)

    routes = [
        Route("/health", health),
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/get_model_info", model_info),
        Route("/_test/state", test_state, methods=["GET", "POST"]),
    ]
    routes += [Route(p, control, methods=["POST"]) for p in CONTROL]
    return Starlette(routes=routes)


class ThreadServer:
    """A stand-in engine served by uvicorn in a thread of the test process."""

    def __init__(self, name: str, port: int | None = None, admin_token: str | None = None) -> None:
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                make_engine(name, admin_token), host="127.0.0.1", port=self.port, log_level="error", access_log=False
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "stand-in engine failed to start"
            time.sleep(0.01)

    def set(self, **state) -> None:
        httpx.post(self.url + "/_test/state", json=state).raise_for_status()

    def calls(self) -> list:
        return httpx.get(self.url + "/_test/state").json()["calls"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def spawn_standin(port: int) -> subprocess.Popen:
    """A stand-in engine in its own process (so it can be SIGKILLed); returns once healthy."""
    proc = subprocess.Popen([sys.executable, __file__, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def wait_for(predicate, timeout: float = 20, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def states(router_url: str) -> dict[str, str]:
    return {e["url"]: e["state"] for e in httpx.get(router_url + "/engines").json()["engines"]}


# ------------------------------------------------------------------------------ fixtures

from furlong.core.net import free_port  # noqa: E402  (the stand-in above must not need furlong)
from furlong.router import serve_in_thread  # noqa: E402


@pytest.fixture(scope="module")
def engines():
    servers = [ThreadServer("a"), ThreadServer("b")]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def router(engines):
    for s in engines:
        s.set(healthy=True, fail_control=False, calls=[])
    with serve_in_thread([s.url for s in engines], health_interval=0.2) as handle:
        yield handle


GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}, "return_logprob": True, "rid": "x1"}


# ------------------------------------------------------------------------------ tests


def test_generate_passes_bytes_and_metadata_through(router, engines):
    r = httpx.post(router.url + "/generate", json=GEN)
    assert r.status_code == 200
    served_by = r.headers["x-furlong-engine"]
    assert served_by in {s.url for s in engines}
    direct = httpx.post(served_by + "/generate", json=GEN)
    assert r.content == direct.content
    assert r.json()["meta_info"]["output_token_versions"] == ["0"] * 5


def test_engine_errors_pass_through_as_4xx(router):
    r = httpx.post(router.url + "/generate", json={**GEN, "sampling_params": {"max_new_tokens": -1}})
    assert r.status_code == 400
    assert "max_new_tokens" in r.json()["error"]["message"]
    r = httpx.post(router.url + "/tokenize", json={"prompt": "hé"})
    assert r.json() == {"tokens": list("hé".encode()), "count": 3}


def test_streaming_is_relayed_unchanged(router, engines):
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=req) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        via_router = r.read()
        engine = r.headers["x-furlong-engine"]
    direct = httpx.post(engine + "/v1/chat/completions", json=req).content
    assert via_router == direct
    assert via_router.endswith(b"data: [DONE]\n\n") and via_router.count(b"data: ") == 8


def test_routing_key_is_sticky_and_body_key_is_stripped(router, engines):
    for key in ("alpha", "beta", "gamma", "delta"):
        header_routed = [
            httpx.post(router.url + "/generate", json=GEN, headers={"X-Routing-Key": key}) for _ in range(4)
        ]
        seen = {r.headers["x-furlong-engine"] for r in header_routed}
        # the stand-in rejects unknown fields: a 200 here means routing_key was removed before forwarding
        body_routed = [httpx.post(router.url + "/generate", json={**GEN, "routing_key": key}) for _ in range(4)]
        assert all(r.status_code == 200 for r in body_routed)
        assert len(seen | {r.headers["x-furlong-engine"] for r in body_routed}) == 1
    r = httpx.post(router.url + "/generate", json={**GEN, "routing_key": 7})
    assert r.status_code == 400 and "routing_key" in r.json()["error"]["message"]


def test_least_inflight_spreads_concurrent_requests(router, engines):
    with ThreadPoolExecutor(8) as pool:
        rs = list(
            pool.map(
                lambda _: httpx.post(router.url + "/generate", json=GEN, headers={"x-test-delay": "0.3"}, timeout=30),
                range(8),
            )
        )
    by_engine = [r.headers["x-furlong-engine"] for r in rs]
    assert {by_engine.count(s.url) for s in engines} == {4}
    assert all(e["inflight"] == 0 for e in httpx.get(router.url + "/engines").json()["engines"])


def test_round_robin_alternates(engines):
    with serve_in_thread([s.url for s in engines], policy="round_robin") as handle:
        order = [httpx.post(handle.url + "/generate", json=GEN).headers["x-furlong-engine"] for _ in range(6)]
    assert order[0] != order[1] and order[:2] * 3 == order


def test_session_affinity_groups_by_prompt_prefix(engines):
    with serve_in_thread([s.url for s in engines], policy="session_affinity") as handle:
        placed = {}
        for prompt in range(20):
            ids = [prompt, 5, 5]
            where = {
                httpx.post(handle.url + "/generate", json={**GEN, "input_ids": ids}).headers["x-furlong-engine"]
                for _ in range(2)
            }
            assert len(where) == 1
            placed[prompt] = where.pop()
    assert len(set(placed.values())) == 2  # different prompts still use both engines


def test_unhealthy_engine_is_quarantined_then_readmitted(router, engines):
    a, b = engines
    a.set(healthy=False)
    wait_for(lambda: states(router.url)[a.url] == "quarantined", what="quarantine")
    assert all(httpx.post(router.url + "/generate", json=GEN).headers["x-furlong-engine"] == b.url for _ in range(5))
    info = {e["url"]: e for e in httpx.get(router.url + "/engines").json()["engines"]}
    assert info[a.url]["failed_probes"] >= 2 and "503" in info[a.url]["last_error"]  # unhealthy_after=2
    a.set(healthy=True)
    wait_for(lambda: states(router.url)[a.url] == "healthy", what="re-admission")


def test_no_engine_gives_clear_503(engines):
    with serve_in_thread([], health_interval=0.2) as handle:
        r = httpx.post(handle.url + "/generate", json=GEN)
        assert r.status_code == 503 and "no engine is registered" in r.json()["error"]["message"]
        assert httpx.get(handle.url + "/health").status_code == 503
    dead = f"http://127.0.0.1:{free_port()}"
    with serve_in_thread([dead], health_interval=0.2) as handle:
        r = httpx.post(handle.url + "/generate", json=GEN)
        assert r.status_code == 503 and "quarantined" in r.json()["error"]["message"]


def test_add_and_remove_engines_at_run_time_with_admin_token(engines):
    a, b = engines
    with serve_in_thread([a.url], admin_token="s3cret") as handle:
        assert httpx.post(handle.url + "/add_engine", json={"url": b.url}).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        r = httpx.post(handle.url + "/add_engine", json={"url": b.url + "/"}, headers=auth)
        assert r.status_code == 200 and r.json()["state"] == "healthy"
        assert states(handle.url) == {a.url: "healthy", b.url: "healthy"}
        r = httpx.post(handle.url + "/add_engine", json={"uri": b.url}, headers=auth)
        assert r.status_code == 400 and "url" in r.json()["error"]["message"]
        r = httpx.post(handle.url + "/add_engine", json={"url": "http://nohost"}, headers=auth)
        assert r.status_code == 400 and "port" in r.json()["error"]["message"]
        assert httpx.post(handle.url + f"/remove_engine?url={a.url}", headers=auth).status_code == 200
        assert httpx.post(handle.url + "/remove_engine", json={"url": a.url}, headers=auth).status_code == 404
        assert {httpx.post(handle.url + "/generate", json=GEN).headers["x-furlong-engine"] for _ in range(4)} == {b.url}


def test_control_fans_out_and_reports_each_engine(engines):
    a, b = [ThreadServer(n, admin_token="tok") for n in "ab"]
    try:
        with serve_in_thread([a.url, b.url], admin_token="tok") as handle:
            auth = {"Authorization": "Bearer tok"}
            r = httpx.post(handle.url + "/pause_generation", json={"mode": "in_place"})
            assert r.status_code == 401 and a.calls() == []
            for path, body in [
                ("/pause_generation", {"mode": "retract"}),
                ("/flush_cache", {}),
                ("/update_weights_from_disk", {"model_path": "/m"}),
                ("/continue_generation", {}),
            ]:
                r = httpx.post(handle.url + path, json=body, headers=auth)
                assert r.status_code == 200 and r.json()["ok"], r.text
                assert set(r.json()["results"]) == {a.url, b.url}
            assert a.calls() == b.calls() and [c[0] for c in a.calls()] == [
                "/pause_generation",
                "/flush_cache",
                "/update_weights_from_disk",
                "/continue_generation",
            ]
            # all engines reject the same bad request: the caller's 4xx, naming the field
            r = httpx.post(handle.url + "/pause_generation", json={"mode": "sideways"}, headers=auth)
            assert r.status_code == 400 and not r.json()["ok"]
            assert all("mode" in v["body"]["error"]["message"] for v in r.json()["results"].values())
            # one engine broken: reported, not hidden
            b.set(fail_control=True)
            r = httpx.post(handle.url + "/abort_request", json={"abort_all": True}, headers=auth)
            assert r.status_code == 502 and not r.json()["ok"]
            assert r.json()["error"]["message"].startswith("/abort_request failed on 1 of 2 engines: " + b.url)
            assert r.json()["results"][a.url]["ok"] and not r.json()["results"][b.url]["ok"]
            # one engine targeted
            r = httpx.post(handle.url + f"/flush_cache?engine={a.url}", json={}, headers=auth)
            assert r.status_code == 200 and list(r.json()["results"]) == [a.url]
    finally:
        a.stop()
        b.stop()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
fields = st.sampled_from(sorted(GENERATE_FIELDS | {"routing_key", "messages", "prompt", "max_tokens", "stream"}))
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(fields, json_values, max_size=6).map(lambda d: json.dumps({**GEN, **d}).encode()),
)
router_paths = st.sampled_from(
    [
        "/generate",
        "/v1/chat/completions",
        "/v1/completions",
        "/tokenize",
        "/detokenize",
        "/add_engine",
        "/remove_engine",
        "/pause_generation",
        "/abort_request",
    ]
)


@pytest.fixture(scope="module")
def http():
    with httpx.Client() as client:
        yield client


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=router_paths,
    body=bodies,
    key=st.none() | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30),
)
def test_fuzzed_requests_never_get_a_5xx(router, engines, http, path, body, key):
    headers = {"content-type": "application/json"} | ({"X-Routing-Key": key} if key is not None else {})
    if path in ("/add_engine", "/remove_engine") and b"url" in body:
        return  # a random but valid url would really be added; bad urls are covered above
    r = http.post(router.url + path, content=body, headers=headers)
    assert r.status_code < 500, (path, body, r.text)
    assert r.status_code in (200, 404) or "message" in r.json()["error"]
    assert {e["url"]: e["state"] for e in http.get(router.url + "/engines").json()["engines"]} == {
        s.url: "healthy" for s in engines
    }


def test_failover_when_an_engine_process_is_killed_mid_request():
    ports = [free_port(), free_port()]
    procs = [spawn_standin(p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        with serve_in_thread(urls, health_interval=0.2) as handle:
            with ThreadPoolExecutor(6) as pool:
                futures = [
                    pool.submit(
                        httpx.post,
                        handle.url + "/generate",
                        json={**GEN, "rid": f"k{i}"},
                        headers={"x-test-delay": "1.0"},
                        timeout=30,
                    )
                    for i in range(6)
                ]
                wait_for(
                    lambda: all(e["inflight"] == 3 for e in httpx.get(handle.url + "/engines").json()["engines"]),
                    what="requests in flight on both engines",
                )
                procs[0].send_signal(signal.SIGKILL)
                rs = [f.result() for f in futures]
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            assert {r.headers["x-furlong-engine"] for r in rs} == {urls[1]}
            assert sorted(r.json()["meta_info"]["id"] for r in rs) == [f"k{i}" for i in range(6)]
            assert states(handle.url)[urls[0]] == "quarantined"
            assert "retries_total 3" in httpx.get(handle.url + "/metrics").text
            procs[0].wait()
            procs[0] = spawn_standin(ports[0])
            wait_for(lambda: states(handle.url)[urls[0]] == "healthy", what="re-admission after restart")
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_broken_stream_ends_with_an_error_event():
    port = free_port()
    proc = spawn_standin(port)
    try:
        with serve_in_thread([f"http://127.0.0.1:{port}"], health_interval=0.2) as handle:
            req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}
            with httpx.stream(
                "POST", handle.url + "/v1/chat/completions", json=req, headers={"x-test-chunk-delay": "0.1"}
            ) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                proc.send_signal(signal.SIGKILL)
                rest = [line for line in lines if line]
            assert "failed mid-stream" in rest[-1] and "[DONE]" not in rest[-1]
            assert states(handle.url)[f"http://127.0.0.1:{port}"] == "quarantined"
    finally:
        proc.kill()
        proc.wait()


def test_cli_starts_a_router_process(engines):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "furlong.cli",
            "router",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            *sum((["--engine", s.url] for s in engines), []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        seen = {httpx.post(url + "/generate", json=GEN).headers["x-furlong-engine"] for _ in range(4)}
        assert seen == {s.url for s in engines}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    bad = subprocess.run(
        [sys.executable, "-m", "furlong.cli", "router", "--engine", "localhost"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--engine" in bad.stderr and "no port" in bad.stderr


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(make_engine(f"standin:{sys.argv[1]}"), host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
