"""Bad requests get a 400 naming the field; fuzzed requests never get a 5xx; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from furlong.engine.engine import Engine
from furlong.engine.server import ServerThread
from furlong.models import create_model


@pytest.fixture(scope="module")
def url():
    eng = Engine(create_model("qwen3", "tiny"), kv_cache_mb=1).start()
    with ServerThread(eng) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c
    eng.stop()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CASES = [
    ("/generate", b"{not json", "body"),
    ("/generate", [1, 2], "body"),
    ("/generate", {"input_ids": [1], "bogus": 1}, "bogus"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temprature": 1}}, "sampling_params.temprature"),
    ("/generate", {"input_ids": "12"}, "input_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**12}}, "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1, 512]}, "input_ids"),
    ("/generate", {"input_ids": [-1]}, "input_ids"),
    ("/generate", {"input_ids": [5] * 2048}, "input_ids"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [1], "text": "a"}, "input_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 17}}, "sampling_params.n"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [9999]}}, "sampling_params.stop_token_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"seed": -4}}, "sampling_params.seed"),
    ("/generate", {"input_ids": [1], "return_routed_experts": True}, "return_routed_experts"),
    ("/v1/chat/completions", {**CHAT, "n": 100}, "n"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": True}, "frobnicate"),
    ("/v1/completions", {"prompt": [1, 2, 600], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("/detokenize", {"tokens": [99999]}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/abort_request", {}, "rid"),
]


@pytest.mark.parametrize(("path", "body", "field"), CASES, ids=[f"{p}:{f}" for p, _, f in CASES])
def test_bad_request_is_400_naming_the_field(url, path, body, field):
    r = url.post(path, content=body) if isinstance(body, bytes) else url.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or err["message"].startswith(field), err
    ok = url.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
small_tokens = st.one_of(json_value, st.integers(-3, 8))
generate_body = st.fixed_dictionaries(
    {"input_ids": st.one_of(json_value, st.lists(st.integers(-2, 600), max_size=6))},
    optional={
        "text": json_value,
        "rid": json_value,
        "return_logprob": json_value,
        "logprob_start_len": json_value,
        "top_logprobs_num": json_value,
        "stream": json_value,
        "sampling_params": st.one_of(
            json_value,
            st.fixed_dictionaries(
                {"max_new_tokens": small_tokens},
                optional={
                    k: json_value
                    for k in (
                        "temperature",
                        "top_p",
                        "top_k",
                        "min_p",
                        "stop",
                        "stop_token_ids",
                        "seed",
                        "n",
                        "ignore_eos",
                    )
                },
            ),
        ),
    },
)
chat_body = st.fixed_dictionaries(
    {
        "messages": st.one_of(
            json_value,
            st.lists(
                st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]), "content": json_value}),
                max_size=2,
            ),
        ),
        "max_tokens": small_tokens,
    },
    optional={
        k: json_value
        for k in (
            "n",
            "temperature",
            "top_p",
            "logprobs",
            "top_logprobs",
            "tools",
            "stop",
            "seed",
            "stream",
            "return_token_ids",
        )
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    st.one_of(
        st.tuples(st.just("/generate"), generate_body),
        st.tuples(st.just("/v1/chat/completions"), chat_body),
        st.tuples(st.sampled_from(["/v1/completions", "/tokenize", "/detokenize", "/abort_request"]), json_value),
        st.tuples(st.just("/generate"), st.binary(max_size=20)),
    )
)
def test_fuzzed_requests_never_5xx(url, case):
    path, body = case
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN / Infinity included on purpose
    r = url.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    assert r.status_code in (200, 400, 401), (path, body, r.text)
