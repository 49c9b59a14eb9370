"""`examples/openai_client`: the official openai client through a real router to a real engine (tiny model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from furlong.engine.engine import Engine
from furlong.engine.server import ServerThread
from furlong.models import load_tokenizer
from furlong.router import serve_in_thread

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_client" / "chat.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("openai_client_chat", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def router_url(tiny_model_dir):
    engine = Engine(tiny_model_dir, kv_cache_mb=4).start()
    try:
        with ServerThread(engine, admin_token="T") as server, serve_in_thread([server.url]) as router:
            yield router.url
    finally:
        engine.stop()


def test_chat_through_the_router_returns_exact_ids_and_logprobs(example, router_url, tiny_model_dir):
    out = example.chat(router_url + "/v1", max_tokens=12, seed=3)
    n = out["completion_tokens"]
    assert 1 <= n <= 12 and out["finish_reason"] in ("stop", "length")
    assert len(out["logprobs"]) == len(out["token_ids"]) == n
    assert all(lp <= 0.0 for lp in out["logprobs"])
    tok = load_tokenizer(tiny_model_dir)
    want_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out["prompt_token_ids"] == list(want_prompt)
    assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)  # the text is those very ids
    assert example.chat(router_url + "/v1", max_tokens=12, seed=3) == out  # seeded sampling is reproducible
