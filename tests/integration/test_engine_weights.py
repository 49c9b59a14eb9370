"""Weight updates over HTTP: shared memory, torch.distributed (gloo), disk — atomic and versioned."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.core.net import free_port
from furlong.engine.engine import Engine
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams
from furlong.engine.server import ServerThread
from furlong.models import create_model
from furlong.weights.tensors import write_shm

TOKEN = "adm"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def greedy_body(ids: list[int], n: int = 12) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


def outputs(url: str) -> list[dict]:
    return [httpx.post(url + "/generate", json=greedy_body(p)).json() for p in PROMPTS]


@pytest.fixture(scope="module")
def world():
    old, new = create_model("qwen3", "tiny"), create_model("qwen3", "tiny", seed=1)
    fresh = Engine(new, kv_cache_mb=1).start()
    want_new = [
        r.output_ids
        for r in fresh.generate(
            [Request(p, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)) for p in PROMPTS], timeout=60
        )
    ]
    fresh.stop()
    eng = Engine(old, kv_cache_mb=1).start()
    with ServerThread(eng, admin_token=TOKEN) as srv:
        yield {
            "url": srv.url,
            "engine": eng,
            "old": old,
            "new": new,
            "want_new": want_new,
            "new_sd": AutoModelForCausalLM.from_pretrained(new).state_dict(),
        }
    eng.stop()


def post_shm(url: str, named: dict, **kw) -> httpx.Response:
    shm, handle = write_shm(named)
    try:
        return httpx.post(url + "/update_weights_from_tensor", json={"shm": handle, **kw}, headers=AUTH, timeout=60)
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.timeout(360)
def test_update_from_shared_memory_then_disk(world):
    url = world["url"]
    before = outputs(url)
    assert [o["meta_info"]["weight_version"] for o in before] == [0, 0]
    assert [o["output_ids"] for o in before] != world["want_new"]
    # Bad name / bad shape: 400 naming the tensor, nothing changes.
    bad_name = {**world["new_sd"], "model.layers.0.mlp.bogus.weight": torch.zeros(2)}
    r = post_shm(url, bad_name)
    assert r.status_code == 400 and "model.layers.0.mlp.bogus.weight" in r.json()["error"]["message"]
    bad_shape = {**world["new_sd"], "lm_head.weight": torch.zeros(3, 3)}
    r = post_shm(url, bad_shape)
    assert r.status_code == 400 and "lm_head.weight" in r.json()["error"]["message"]
    assert (
        httpx.post(url + "/update_weights_from_tensor", json={"shm": {"shm_name": "nope"}}, headers=AUTH).status_code
        == 400
    )
    assert httpx.post(url + "/update_weights_from_tensor", json={"shm": {}}).status_code == 401
    assert [o["output_ids"] for o in outputs(url)] == [o["output_ids"] for o in before]
    assert httpx.get(url + "/get_weight_version").json()["weight_version"] == 0
    # Good update: version rises, tokens carry it, outputs equal a fresh engine on the new weights.
    r = post_shm(url, world["new_sd"])
    assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
    after = outputs(url)
    assert [o["output_ids"] for o in after] == world["want_new"]
    assert all(o["meta_info"]["output_token_versions"] == [1] * 12 for o in after)
    assert httpx.post(url + "/get_weights_checksum", json={}).status_code == 401  # weights are not public
    sums = httpx.post(url + "/get_weights_checksum", json={"names": ["lm_head.weight"]}, headers=AUTH).json()
    from furlong.weights.tensors import checksum

    assert sums["tensors"]["lm_head.weight"]["crc32"] == checksum(world["new_sd"]["lm_head.weight"])
    assert sums["weight_version"] == 1
    # Back to the old weights from disk, with an explicit version.
    r = httpx.post(
        url + "/update_weights_from_disk",
        json={"model_path": str(world["old"]), "weight_version": 7},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["weight_version"] == 7, r.text
    assert [o["output_ids"] for o in outputs(url)] == [o["output_ids"] for o in before]
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": "/no/such/dir"}, headers=AUTH)
    assert r.status_code == 400 and "model_path" in r.text


def test_update_from_distributed_group(world):
    url = world["url"]
    from furlong.weights.dist import broadcast, init_group

    port = free_port()
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "init",
            httpx.post(
                url + "/init_weights_update_group",
                headers=AUTH,
                timeout=60,
                json={
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": "g",
                },
            ),
        )
    )
    t.start()
    group = init_group("127.0.0.1", port, 2, 0)
    t.join(60)
    assert result["init"].status_code == 200, result["init"].text
    sd = world["new_sd"]
    names = list(sd)
    body = {
        "names": names,
        "dtypes": ["float32"] * len(names),
        "shapes": [list(sd[n].shape) for n in names],
        "group_name": "g",
    }
    t = threading.Thread(
        target=lambda: result.setdefault(
            "upd", httpx.post(url + "/update_weights_from_distributed", json=body, headers=AUTH, timeout=60)
        )
    )
    t.start()
    for n in names:
        broadcast(group, sd[n].contiguous(), 0)
    t.join(60)
    assert result["upd"].status_code == 200, result["upd"].text
    version = result["upd"].json()["weight_version"]
    after = outputs(url)
    assert [o["output_ids"] for o in after] == world["want_new"]
    assert all(o["meta_info"]["weight_version"] == version for o in after)
    # A wrong shape announced over the group: still received (sender never hangs), then refused.
    bad = {**body, "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[2, 2]]}
    t = threading.Thread(
        target=lambda: result.__setitem__(
            "bad", httpx.post(url + "/update_weights_from_distributed", json=bad, headers=AUTH, timeout=60)
        )
    )
    t.start()
    broadcast(group, torch.ones(2, 2), 0)
    t.join(60)
    assert result["bad"].status_code == 400 and "lm_head.weight" in result["bad"].text
    assert httpx.post(url + "/destroy_weights_update_group", json={"group_name": "g"}, headers=AUTH).status_code == 200


def test_retract_update_continue_stamps_versions(world):
    """Tokens before the sync carry the old version, tokens after it the new one."""
    url, eng = world["url"], world["engine"]
    v0 = eng.weight_version
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "r", httpx.post(url + "/generate", json=greedy_body(PROMPTS[0], 1500), timeout=120)
        )
    )
    t.start()
    while not eng.running:
        time.sleep(0.005)
    while eng.running and len(eng.running[0].output_ids) < 5:
        time.sleep(0.002)
    assert httpx.post(url + "/pause_generation", json={"mode": "retract"}, headers=AUTH).status_code == 200
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(world["new"])}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["weight_version"] == v0 + 1
    assert httpx.post(url + "/continue_generation", headers=AUTH).status_code == 200
    t.join(120)
    versions = result["r"].json()["meta_info"]["output_token_versions"]
    assert versions[0] == v0 and versions[-1] == v0 + 1 and sorted(versions) == versions


def test_abort_by_rid_over_http(world):
    url = world["url"]
    result: dict = {}
    body = {**greedy_body(PROMPTS[1], 1500), "rid": "long-one"}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(url + "/generate", json=body, timeout=120)))
    t.start()
    eng = world["engine"]
    while not any(r.rid == "long-one" for r in eng.running):
        time.sleep(0.005)
    r = httpx.post(url + "/abort_request", json={"rid": "long-one"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["aborted"] == 1
    t.join(60)
    meta = result["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1500


def test_router_fans_out_weights_checksum_behind_the_admin_token(world):
    """/get_weights_checksum exposes the weights' fingerprint: control-only on the engine and on the router."""
    import uvicorn

    from furlong.router.server import Router

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(Router([world["url"]], admin_token=TOKEN).app, host="127.0.0.1", port=port, log_level="warning")
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        while not server.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        body = {"names": ["model.norm.weight"]}
        assert httpx.post(url + "/get_weights_checksum", json=body).status_code == 401
        r = httpx.post(url + "/get_weights_checksum", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        (res,) = r.json()["results"].values()
        want = httpx.post(world["url"] + "/get_weights_checksum", json=body, headers=AUTH).json()
        assert res["body"]["tensors"] == want["tensors"]
    finally:
        server.should_exit = True
        t.join(10)
