"""Hostile HTTP input to every endpoint of the engine, the router and the dashboard.

Engine and router run as real processes (as in a run), so a crash is a dead process,
not a swallowed exception; the dashboard serves a synthetic run. The rules:
never a 5xx, the process alive and healthy afterwards, its memory bounded; control
endpoints without the admin token are refused (401) whatever the body; oversized
bodies and token counts get a 4xx.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from furlong.core.api import CONTROL_PATHS
from furlong.core.net import free_port
from furlong.core.processes import ManagedProcess, furlong_argv, token_env
from furlong.models import create_model

TOKEN = "fuzz-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RSS_GROWTH_MB = 300  # a generous bound: a leak per request would pass it after a few hundred requests
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
COUNT: dict[str, int] = {}  # requests sent, per server (printed for docs/reliability.md)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=30),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=12,
)
VALID = {  # one valid body per POST endpoint; mutations of these reach deep into validation
    "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.5}},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
GET_PATHS = [
    "/health",
    "/health_generate",
    "/get_model_info",
    "/get_server_info",
    "/get_weight_version",
    "/metrics",
    "/v1/models",
]
SAFE_CONTROL = [
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/set_threads",
    "/flush_cache",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/get_weights_checksum",
    "/destroy_weights_update_group",
]  # with the token; the group rendezvous endpoints block by design


@st.composite
def mutated(draw, valid: dict) -> bytes:
    body = json.loads(json.dumps(valid))
    target = body
    if isinstance(body.get("sampling_params"), dict) and draw(st.booleans()):
        target = body["sampling_params"]
    how = draw(st.sampled_from(["replace", "add", "delete"]))
    if how == "replace" and target:
        target[draw(st.sampled_from(sorted(target)))] = draw(json_values)
    elif how == "delete" and target:
        del target[draw(st.sampled_from(sorted(target)))]
    else:
        target[
            draw(
                st.sampled_from(
                    [
                        "stream",
                        "n",
                        "max_new_tokens",
                        "stop",
                        "seed",
                        "logprobs",
                        "rid",
                        "top_k",
                        "routing_key",
                        "tools",
                        "return_logprob",
                        "x" * 20,
                    ]
                )
            )
        ] = draw(json_values)
    return json.dumps(body).encode()


def bodies(valid: dict | None = None):
    raw = st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=200),
        st.just(b""),
        st.just(b"{" * 500),
        st.just(b"[" * 500 + b"]" * 500),
    )
    return st.one_of(raw, mutated(valid)) if valid else raw


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def send(client: httpx.Client, who: str, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    COUNT[who] = COUNT.get(who, 0) + 1
    r = client.request(method, path, content=body, headers={"content-type": "application/json", **(headers or {})})
    assert r.status_code < 500, f"{method} {path} {body[:200]!r} -> {r.status_code}: {r.text[:300]}"
    return r


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz_logs")
    eport, rport = free_port(), free_port()
    engine = ManagedProcess(
        "engine",
        furlong_argv(
            "serve",
            "--model",
            str(create_model("qwen3", "tiny")),
            "--port",
            str(eport),
            "--threads",
            "1",
            "--kv-cache-mb",
            "8",
        ),
        f"http://127.0.0.1:{eport}",
        logs / "engine.log",
        threads=1,
        env=token_env(TOKEN),
    ).start(180)
    router = ManagedProcess(
        "router",
        furlong_argv(
            "router",
            "--engine",
            engine.url,
            "--port",
            str(rport),
            "--health-interval",
            "0.5",
            "--log-level",
            "warning",
        ),
        f"http://127.0.0.1:{rport}",
        logs / "router.log",
        threads=1,
        env=token_env(TOKEN),
    ).start(60)
    with httpx.Client(base_url=engine.url, timeout=60) as e, httpx.Client(base_url=router.url, timeout=60) as r:
        rss = {"engine": rss_mb(engine.pid), "router": rss_mb(router.pid)}
        yield SimpleNamespace(engine=engine, router=router, e=e, r=r, rss=rss)
        for name, proc, client in (("engine", engine, e), ("router", router, r)):
            assert proc.alive(), f"{name} died: {proc.log_tail()}"
            assert client.get("/health").status_code == 200
            growth = rss_mb(proc.pid) - rss[name]
            print(f"\nfuzz: {name}: {COUNT.get(name, 0)} requests, RSS growth {growth:.0f} MB")
            assert growth < RSS_GROWTH_MB, f"{name} RSS grew {growth:.0f} MB"
    router.stop()
    engine.stop()


# ---------------------------------------------------------------- binding
def listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on `port`, from the kernel's table (IPv4 and IPv6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                out.add(addr)
    return out


def test_engine_and_router_processes_listen_on_loopback_only(servers):
    """Started as a run starts them, with no --host: only 127.0.0.1 (0100007F in the kernel's byte order)."""
    for proc in (servers.engine, servers.router):
        assert listening_addresses(int(proc.url.rsplit(":", 1)[1])) == {"0100007F"}, proc.name


# ---------------------------------------------------------------- engine
@FUZZ
@given(data=st.data())
def test_engine_public_endpoints_never_5xx(servers, data):
    if data.draw(st.booleans()):
        path = data.draw(st.sampled_from(sorted(VALID)))
        send(servers.e, "engine", "POST", path, data.draw(bodies(VALID[path])))
    else:
        send(servers.e, "engine", "GET", data.draw(st.sampled_from(GET_PATHS)))


@FUZZ
@given(path=st.sampled_from(CONTROL_PATHS), body=bodies(), auth=st.sampled_from([None, "Bearer wrong", TOKEN, ""]))
def test_engine_control_endpoints_refuse_without_the_token(servers, path, body, auth):
    r = send(servers.e, "engine", "POST", path, body, {"Authorization": auth} if auth is not None else {})
    assert r.status_code == 401 and "admin token" in r.text


@FUZZ
@given(path=st.sampled_from(SAFE_CONTROL), data=st.data())
def test_engine_control_endpoints_with_the_token_never_5xx(servers, path, data):
    valid = {
        "/pause_generation": {"mode": "retract"},
        "/abort_request": {"rid": "x"},
        "/set_threads": {"threads": 1},
        "/update_weights_from_disk": {"model_path": "/nonexistent"},
        "/update_weights_from_tensor": {"shm": {"shm_name": "x", "tensors": []}},
    }.get(path)
    try:
        send(servers.e, "engine", "POST", path, data.draw(bodies(valid)), AUTH)
    finally:
        servers.e.post("/continue_generation", json={}, headers=AUTH)  # a fuzzed pause must not starve the next example


def test_engine_limits_body_size_and_tokens(servers):
    info = servers.e.get("/get_model_info").json()
    max_ctx = info.get("max_context") or info.get("max_model_len") or info.get("context_length") or 2048
    big = b'{"input_ids": [' + b"1," * (16 * 2**20) + b"1]}"  # 32 MiB
    r = send(servers.e, "engine", "POST", "/generate", big)
    assert 400 <= r.status_code < 500  # too many tokens (the body itself is read whole: see docs/reliability.md)
    r = send(
        servers.e,
        "engine",
        "POST",
        "/generate",
        json.dumps({"input_ids": [1] * (max_ctx + 1), "sampling_params": {"max_new_tokens": 1}}).encode(),
    )
    assert r.status_code == 400 and "input_ids" in r.text
    r = send(
        servers.e,
        "engine",
        "POST",
        "/generate",
        json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 10 * max_ctx}}).encode(),
    )
    assert r.status_code == 400 and "max_new_tokens" in r.text


def test_engine_deeply_nested_json_is_a_400(servers):
    r = servers.e.post("/detokenize", content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 400


# ---------------------------------------------------------------- router
URLS = st.one_of(
    st.sampled_from(
        [
            "http://127.0.0.1:1",
            "127.0.0.1:2",
            "http://localhost:3/x",
            "ftp://h:1",
            "http://:9",
            "http://127.0.0.1",
            "http://[::1:5",
            "",
        ]
    ),
    json_values,
)


@FUZZ
@given(data=st.data())
def test_router_every_endpoint_never_5xx(servers, data):
    kind = data.draw(st.sampled_from(["forward", "get", "control", "admin"]))
    if kind == "forward":
        path = data.draw(st.sampled_from(sorted(VALID)))
        key = data.draw(st.none() | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=20))
        send(servers.r, "router", "POST", path, data.draw(bodies(VALID[path])), {"X-Routing-Key": key} if key else {})
    elif kind == "get":
        send(
            servers.r, "router", "GET", data.draw(st.sampled_from(["/health", "/engines", "/metrics", *GET_PATHS[1:]]))
        )
    elif kind == "control":
        path = data.draw(st.sampled_from(SAFE_CONTROL))
        auth = data.draw(st.sampled_from([AUTH, {}]))
        query = data.draw(
            st.sampled_from(["", "?engine=" + servers.engine.url, "?engine=http://127.0.0.1:1", "?engine=%%"])
        )
        try:
            r = send(servers.r, "router", "POST", path + query, data.draw(bodies()), auth)
            if not auth:
                assert r.status_code == 401
        finally:
            servers.r.post("/continue_generation", json={}, headers=AUTH)
    else:
        path = data.draw(st.sampled_from(["/add_engine", "/remove_engine"]))
        url = data.draw(URLS)
        if url == servers.engine.url:
            return
        auth = data.draw(st.sampled_from([AUTH, {}]))
        r = send(servers.r, "router", "POST", path, json.dumps({"url": url}).encode(), auth)
        if not auth:
            assert r.status_code == 401
        for e in servers.r.get("/engines").json()["engines"]:  # keep only the real engine registered
            if e["url"] != servers.engine.url:
                servers.r.post("/remove_engine", json={"url": e["url"]}, headers=AUTH)


# ---------------------------------------------------------------- dashboard
@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    from furlong.dashboard.server import serve_in_thread
    from tests.fixtures.synthetic_run import write_synthetic_run

    run_dir = tmp_path_factory.mktemp("dash_run")
    write_synthetic_run(run_dir, steps=2)
    handle = serve_in_thread(run_dir, follow=False)
    with httpx.Client(base_url=handle.url, timeout=30) as c:
        yield c
    handle.stop()
    print(f"\nfuzz: dashboard: {COUNT.get('dashboard', 0)} requests")


DASH = [
    "/",
    "/api/summary",
    "/api/metrics",
    "/api/timeline",
    "/api/samples",
    "/api/groups",
    "/api/engines",
    "/api/advisories",
    "/api/samples/1",
    "/static/app.js",
]
PARAMS = ["names", "step_from", "step_to", "limit", "step", "status", "group", "q", "sort", "order", "offset", "x"]


@FUZZ
@given(
    path=st.one_of(
        st.sampled_from(DASH),
        st.text(max_size=30).map(lambda t: "/api/samples/" + urllib.parse.quote(t)),
        st.sampled_from(
            [
                "/static/../../../../etc/passwd",
                "/static/%2e%2e/%2e%2e/etc/passwd",
                "/static/..%2f..%2fserver.py",
                "/api/../../etc/passwd",
            ]
        ),
    ),
    params=st.dictionaries(
        st.sampled_from(PARAMS), st.one_of(st.text(max_size=30), st.integers().map(str)), max_size=4
    ),
)
def test_dashboard_every_endpoint_never_5xx_and_never_leaves_its_directory(dashboard, path, params):
    r = send(dashboard, "dashboard", "GET", path + ("?" + urllib.parse.urlencode(params) if params else ""))
    assert "root:" not in r.text and "def create_app" not in r.text  # no file outside the static directory


def test_dashboard_integer_beyond_64_bits_is_a_4xx(dashboard):
    assert dashboard.get("/api/timeline", params={"step_from": str(2**63)}).status_code < 500


def test_engine_refuses_an_oversized_body_with_413(servers):
    """A body over the engine's limit (64 MiB), sent chunked, is refused before it is parsed; the engine keeps serving."""
    from furlong.engine.http import MAX_BODY_BYTES

    def chunks():
        yield b'{"text": "'
        for _ in range(MAX_BODY_BYTES // 2**20 + 1):
            yield b"x" * 2**20
        yield b'"}'

    r = servers.e.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "body" in r.text
    assert servers.e.get("/health").status_code == 200
