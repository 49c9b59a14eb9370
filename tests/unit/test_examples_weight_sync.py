"""`examples/weight_sync`: pushing a second checkpoint into a running engine changes its output to that
checkpoint's, stamps the new version, and verifies checksums — over shared memory, delta and disk."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest

from furlong.engine.engine import Engine
from furlong.engine.server import ServerThread
from furlong.models import create_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "weight_sync" / "push_weights.py"
GREEDY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}


def greedy(url: str) -> tuple[list[int], int]:
    out = httpx.post(url + "/generate", json=GREEDY, timeout=60).json()
    return out["output_ids"], out["meta_info"]["weight_version"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("push_weights", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("transport", ["shm", "delta", "disk"])
def test_push_switches_the_engine_to_the_new_checkpoint(example, transport, tmp_path):
    old, new = create_model("qwen3", "tiny"), create_model("qwen3", "tiny", seed=1)
    reference = Engine(new, kv_cache_mb=1).start()
    engine = Engine(old, kv_cache_mb=1).start()
    try:
        with ServerThread(reference) as ref, ServerThread(engine, admin_token="T") as server:
            want, _ = greedy(ref.url)
            before, v0 = greedy(server.url)
            assert before != want and v0 == 0  # the two checkpoints really differ
            opts = {"directory": tmp_path / "weights"} if transport == "disk" else {}
            report = example.push([server.url], "T", str(new), version=3, transport=transport, **opts)
            assert report.ok and report.verified and report.version == 3
            assert greedy(server.url) == (want, 3)
            with pytest.raises(Exception, match="admin token"):  # control endpoints need the token
                example.push([server.url], "wrong", str(new), version=4, transport=transport, **opts)
            assert greedy(server.url) == (want, 3)
    finally:
        engine.stop()
        reference.stop()
