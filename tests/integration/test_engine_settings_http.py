"""`engine.max_context` and `engine.prefix_cache` change what a served engine does (in process and via the CLI)."""

from __future__ import annotations

import re

import httpx
import pytest

from furlong.engine.engine import Engine
from furlong.engine.server import ServerThread
from furlong.models import create_model
from tests.helpers import engine_process

PROMPT = list(range(10, 50))  # 40 tokens: two full 16-token KV blocks to reuse
GREEDY = {"max_new_tokens": 2, "temperature": 0}


def serve(**kw):
    eng = Engine(create_model("qwen3", "tiny"), kv_cache_mb=1, **kw).start()
    return eng, ServerThread(eng)


def cached(c: httpx.Client) -> list[int]:
    """`meta_info.cached_tokens` of the same prompt sent twice."""
    out = []
    for _ in range(2):
        r = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        out.append(r.json()["meta_info"]["cached_tokens"])
    return out


def hit_tokens(c: httpx.Client) -> int:
    return int(
        re.search(r"^furlong_engine_prefix_cache_hit_tokens_total (\d+)$", c.get("/metrics").text, re.MULTILINE)[1]
    )


@pytest.mark.parametrize("prefix_cache, want", [(True, [0, 32]), (False, [0, 0])])
def test_prefix_cache_setting_decides_whether_a_repeat_is_served_from_cache(prefix_cache, want):
    eng, srv = serve(prefix_cache=prefix_cache)
    with srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert cached(c) == want
        assert hit_tokens(c) == want[1]
    eng.stop()


def test_max_context_refuses_a_longer_prompt_naming_the_context():
    eng, srv = serve(max_context=32)
    with srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/generate", json={"input_ids": PROMPT})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "input_ids" and "the context holds 32" in r.json()["message"]
        r = c.post("/generate", json={"input_ids": PROMPT[:20], "sampling_params": {"max_new_tokens": 20}})
        assert r.status_code == 400 and "32-token context" in r.json()["message"]
        r = c.post("/v1/completions", json={"prompt": PROMPT[:20], "max_tokens": 20})
        assert r.status_code == 400 and "32-token context" in r.json()["message"]
        r = c.post(
            "/generate", json={"input_ids": PROMPT[:20], "sampling_params": {"ignore_eos": True, "temperature": 0}}
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 12  # default fills the window
        assert c.get("/get_model_info").json()["max_context"] == 32
    eng.stop()
    eng, srv = serve()  # without the setting the same prompt is served: the setting is what refused it
    with srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).status_code == 200
    eng.stop()


def test_max_context_over_the_model_is_refused_at_start():
    with pytest.raises(ValueError, match=r"^engine.max_context \(--max-context\): 4096 exceeds the model's 2048"):
        Engine(create_model("qwen3", "tiny"), kv_cache_mb=1, max_context=4096)


def test_furlong_serve_flags_reach_the_engine():
    with (
        engine_process("tok", "--max-context", "32", "--no-prefix-cache") as (url, _),
        httpx.Client(base_url=url, timeout=60) as c,
    ):
        assert c.get("/get_model_info").json()["max_context"] == 32
        assert c.post("/generate", json={"input_ids": PROMPT}).status_code == 400
        prompt = PROMPT[:20]  # one full 16-token block: a repeat would reuse it with the cache on
        got = [
            c.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY}).json()["meta_info"][
                "cached_tokens"
            ]
            for _ in range(2)
        ]
        assert got == [0, 0] and hit_tokens(c) == 0
