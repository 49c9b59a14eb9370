"""Acceptance: two real `furlong serve` processes behind a real `furlong router` process.

Covers issue 3's router acceptance: the official `openai` client through the router,
metadata passed through unchanged, sticky sessions, control fan-out to every engine
(weight update included), and failover — an engine SIGKILLed with requests in flight:
they finish on the other engine, the dead one is quarantined, and once restarted on the
same port it is re-admitted. Requests are held in flight deterministically by pausing
the engine first (no timing assumptions).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from furlong.core.net import free_port

# slow: two engine processes start (~13 s each on a loaded 2-core machine) and one restarts
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("furlong.engine.cli") is None,
        reason="the built-in engine (furlong.engine.cli, `furlong serve`) is not there yet",
    ),
]

TOKEN = "router-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}: {proc.stdout.read().decode()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def wait_for(predicate, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def serve(model: str, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "furlong.cli", "serve", "--model", model, "--port", str(port)],
        env={**ENV, "FURLONG_ADMIN_TOKEN": TOKEN},  # never on a command line
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.fixture(scope="module")
def model():
    from furlong.models import create_model

    return str(create_model("qwen3", "tiny"))


@pytest.fixture(scope="module")
def fleet(model):
    """Two engines and a router, all real processes; yields (router url, engine urls, procs, ports)."""
    ports = [free_port(), free_port()]
    procs = [serve(model, p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    router_port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "furlong.cli",
            "router",
            "--port",
            str(router_port),
            "--health-interval",
            "0.3",
            "--log-level",
            "warning",
            *sum((["--engine", u] for u in urls), []),
        ],
        env={**ENV, "FURLONG_ADMIN_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    procs.append(router)
    router_url = f"http://127.0.0.1:{router_port}"
    try:
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc)
        wait_healthy(router_url, router)
        wait_for(lambda: all(e["state"] == "healthy" for e in engines(router_url)), "both engines admitted")
        yield router_url, urls, procs, ports
    finally:
        for p in procs:
            p.kill()
            p.wait()


def engines(router_url: str) -> list[dict]:
    return httpx.get(router_url + "/engines").json()["engines"]


def state_of(router_url: str, url: str) -> str:
    return {e["url"]: e["state"] for e in engines(router_url)}[url]


def generate(url: str, prompt: list[int], n: int = 8, **extra) -> httpx.Response:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        **extra,
    }
    return httpx.post(url + "/generate", json=body, timeout=120)


def test_generate_through_the_router_keeps_tokens_and_metadata(fleet):
    router_url, urls, _, _ = fleet
    r = generate(router_url, [5, 6, 7, 8], rid="via-router")
    assert r.status_code == 200, r.text
    engine = r.headers["x-furlong-engine"]
    assert engine in urls
    direct = generate(engine, [5, 6, 7, 8], rid="direct").json()
    got = r.json()
    assert got["meta_info"]["id"] == "via-router"
    assert got["output_ids"] == direct["output_ids"] and len(got["output_ids"]) == 8
    for key in ("output_token_logprobs", "weight_version", "output_token_versions", "finish_reason"):
        assert got["meta_info"][key] == direct["meta_info"][key], key
    bad = httpx.post(router_url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": -3}})
    assert bad.status_code == 400 and "max_new_tokens" in bad.text


def test_openai_client_through_the_router_with_sticky_sessions(fleet):
    import openai

    router_url, urls, _, _ = fleet
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)
    placed = {}
    for session in range(12):
        key = {"X-Routing-Key": f"session-{session}"}
        seen = set()
        for turn in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=[{"role": "user", "content": f"turn {turn}"}],
                max_tokens=4,
                logprobs=True,
                extra_headers=key,
            )
            completion = raw.parse()
            assert completion.choices[0].logprobs.content, "log-probs must pass through the router"
            seen.add(raw.headers["x-furlong-engine"])
        assert len(seen) == 1, f"session-{session} moved between engines: {seen}"
        placed[session] = seen.pop()
    assert set(placed.values()) == set(urls)  # sessions differ, so both engines get some
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c for c in stream]
    assert sum(len(c.choices[0].delta.content or "") > 0 for c in chunks if c.choices) >= 1
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason == "length"


def test_control_calls_fan_out_to_every_engine(fleet, model):
    router_url, urls, _, _ = fleet
    assert httpx.post(router_url + "/flush_cache", json={}).status_code == 401
    for path, body in [
        ("/pause_generation", {"mode": "in_place"}),
        ("/continue_generation", {}),
        ("/flush_cache", {}),
        ("/update_weights_from_disk", {"model_path": model, "weight_version": 7}),
    ]:
        r = httpx.post(router_url + path, json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200 and r.json()["ok"], r.text
        assert set(r.json()["results"]) == set(urls)
    for url in urls:  # every engine took the update: its new tokens carry the new version
        assert generate(url, [1, 2, 3], n=2).json()["meta_info"]["weight_version"] in ("7", 7)
    r = httpx.post(router_url + "/update_weights_from_disk", json={"model_path": "/nonexistent"}, headers=AUTH)
    assert r.status_code == 400 and not r.json()["ok"] and set(r.json()["results"]) == set(urls)


def test_killed_engine_requests_finish_elsewhere_and_it_rejoins_after_restart(fleet, model):
    router_url, urls, procs, ports = fleet
    victim, survivor = urls
    # Freeze the victim so requests routed to it stay in flight until it is killed.
    r = httpx.post(router_url + f"/pause_generation?engine={victim}", json={"mode": "retract"}, headers=AUTH)
    assert r.status_code == 200 and list(r.json()["results"]) == [victim]
    # Session keys placed (by the router's own hashing) three on each engine.
    from types import SimpleNamespace

    from furlong.router.policies import rendezvous_pick

    candidates = [SimpleNamespace(url=u, inflight=0) for u in urls]
    keys = [k for k in (f"s{i}" for i in range(100)) if rendezvous_pick(k, candidates).url == victim][:3]
    keys += [k for k in (f"s{i}" for i in range(100)) if rendezvous_pick(k, candidates).url == survivor][:3]
    prompts = [[10 + i, 20, 30] for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(generate, router_url, p, 6, rid=f"kill-{i}", routing_key=k)
            for i, (p, k) in enumerate(zip(prompts, keys))
        ]
        wait_for(
            lambda: {e["url"]: e["inflight"] for e in engines(router_url)}[victim] == 3,
            "three requests held on the paused engine",
        )
        procs[0].send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
    procs[0].wait()
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert {r.headers["x-furlong-engine"] for r in results} == {survivor}
    assert [r.json()["meta_info"]["id"] for r in results] == [f"kill-{i}" for i in range(6)]
    for p, r in zip(prompts, results):  # the retried request is the same request: same greedy output
        assert r.json()["output_ids"] == generate(survivor, p, 6).json()["output_ids"]
    assert state_of(router_url, victim) == "quarantined"
    assert generate(router_url, [3, 4]).headers["x-furlong-engine"] == survivor
    procs[0] = serve(model, ports[0])  # same port: the router re-admits it on its own
    wait_healthy(victim, procs[0])
    wait_for(lambda: state_of(router_url, victim) == "healthy", "re-admission after restart")
    info = {e["url"]: e for e in engines(router_url)}[victim]
    assert info["failures"] >= 1 and info["inflight"] == 0
