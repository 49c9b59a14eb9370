"""Every weight-sync transport against two real engine servers (in-process, so their weights can be read).

What is checked, per transport: engine weights end bit-identical to the pushed
tensors (CRC32 of every tensor), the version is stamped exactly once per sync
and never before the last bucket landed, a bad name or shape is refused naming
the tensor with every engine left on its old weights, delta sends only what
changed, and greedy output equals a fresh engine loaded with the new weights.
"""

from __future__ import annotations

import contextlib
import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.engine.engine import Engine
from furlong.engine.quantized import held_state_dict
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams
from furlong.engine.server import ServerThread
from furlong.models import create_model
from furlong.weights.factory import make_sender
from furlong.weights.report import WeightSyncError
from furlong.weights.tensors import checksum

TOKEN = "adm"
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
TRANSPORTS = ["shm", "delta", "broadcast", "disk", "p2p"]  # p2p with one rank here; two ranks: test_weights_p2p.py
SMALL_BUCKET_MB = 0.05  # ~50 kB: the tiny model (0.6 MB) travels in ~10 buckets


def greedy(ids: list[int], n: int = 12) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


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
    engines = [Engine(old, kv_cache_mb=1).start() for _ in range(2)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(e, admin_token=TOKEN)).url for e in engines]
        yield {
            "engines": engines,
            "urls": urls,
            "want_new": want_new,
            "old_sd": dict(AutoModelForCausalLM.from_pretrained(old).state_dict()),
            "new_sd": dict(AutoModelForCausalLM.from_pretrained(new).state_dict()),
        }
    for e in engines:
        e.stop()


def reset(world) -> None:
    """Put every engine back on the old weights at version 0, outside the code under test."""
    for e in world["engines"]:
        e.call(lambda e=e: e.apply_weights(world["old_sd"], 0)).result(timeout=60)


def engine_sums(engine: Engine) -> dict[str, int]:
    """CRC32 of what the engine holds (packed projections read back: their HF parameters are placeholders)."""
    sd = engine.call(lambda: held_state_dict(engine.hf, engine.model)).result(timeout=60)
    return {n: checksum(t) for n, t in sd.items()}


def sender(transport: str, tmp_path, **kw):
    opts = {"bucket_mb": SMALL_BUCKET_MB, **kw}
    if transport == "disk":
        opts["directory"] = tmp_path / "weights"
    return make_sender(transport, **opts)


class VersionWatch:
    """Snapshots (version, updates applied) on an engine's scheduler thread while a push runs."""

    def __init__(self, engine: Engine):
        self.engine, self.seen, self.stop = engine, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        e = self.engine
        while not self.stop.is_set():
            self.seen.append(e.call(lambda: (e.weight_version, e.stats["weight_updates_total"])).result(timeout=60))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)
        e = self.engine
        self.seen.append((e.weight_version, e.stats["weight_updates_total"]))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transport_leaves_identical_weights_and_one_version_bump(world, transport, tmp_path):
    reset(world)
    new_sd = world["new_sd"]
    before = [e.stats["weight_updates_total"] for e in world["engines"]]
    s = sender(transport, tmp_path)
    s.connect(world["urls"], TOKEN)
    try:
        with VersionWatch(world["engines"][0]) as watch:
            report = s.push(new_sd.items(), 5)
    finally:
        s.close()
    # delta: the engines' checksums seed its baseline, so tensors equal in both models (the norms) stay put
    sent = [n for n, t in new_sd.items() if transport != "delta" or checksum(t) != checksum(world["old_sd"][n])]
    assert report.ok and report.tensors == len(sent) and report.tensors + report.unchanged == len(new_sd)
    assert report.bytes == sum(new_sd[n].numel() * 4 for n in sent) and 0 < len(sent) <= len(new_sd)
    want = {n: checksum(t) for n, t in new_sd.items()}
    for e, n0 in zip(world["engines"], before):
        sums = engine_sums(e)
        assert {n: sums[n] for n in want} == want
        assert e.weight_version == 5
        assert e.stats["weight_updates_total"] - n0 == (1 if transport == "disk" else report.buckets)
    assert report.buckets > 3  # disk: files of one request; others: requests
    # Version 5 appears only once every request of the sync was applied.
    final_updates = watch.seen[-1][1]
    assert {v for v, _ in watch.seen} <= {0, 5}
    assert all(n == final_updates for v, n in watch.seen if v == 5)
    assert [r.weight_version for r in report.engines.values()] == [5, 5]


def test_shm_output_equals_fresh_engine_on_new_weights(world, tmp_path):
    reset(world)
    s = sender("shm", tmp_path, verify=True)
    s.connect(world["urls"], TOKEN)
    with contextlib.closing(s):
        assert s.push(world["new_sd"].items(), 3).verified
    for url in world["urls"]:
        outs = [httpx.post(url + "/generate", json=greedy(p), timeout=60).json() for p in PROMPTS]
        assert [o["output_ids"] for o in outs] == world["want_new"]
        assert all(o["meta_info"]["output_token_versions"] == [3] * 12 for o in outs)


@pytest.mark.parametrize("transport", ["shm", "broadcast", "disk"])
@pytest.mark.parametrize("bad", ["name", "shape"])
def test_bad_tensor_is_named_and_engines_keep_old_weights(world, transport, bad, tmp_path):
    reset(world)
    old = [engine_sums(e) for e in world["engines"]]
    named = list(world["new_sd"].items())
    if bad == "name":  # at the end, so earlier buckets would already have landed without the up-front check
        named.append(("model.layers.1.mlp.bogus.weight", torch.zeros(4)))
        culprit = "model.layers.1.mlp.bogus.weight"
    else:
        culprit = "model.norm.weight"
        named = [(n, torch.zeros(3) if n == culprit else t) for n, t in named]
    s = sender(transport, tmp_path)
    s.connect(world["urls"], TOKEN)
    with contextlib.closing(s), pytest.raises(WeightSyncError, match=culprit.replace(".", r"\.")):
        s.push(named, 9)
    assert [engine_sums(e) for e in world["engines"]] == old
    assert [e.weight_version for e in world["engines"]] == [0, 0]


def test_engine_refusal_is_reported_per_engine_without_schema(world, tmp_path):
    """With no up-front schema (e.g. a remote engine), the engine's own atomic refusal is reported."""
    reset(world)
    old = [engine_sums(e) for e in world["engines"]]
    rest = [(n, t) for n, t in world["new_sd"].items() if n != "lm_head.weight"]
    named = [("lm_head.weight", torch.zeros(2, 2)), *rest]  # refused in bucket 1
    s = sender("shm", tmp_path, check_schema=False)
    s.connect(world["urls"], TOKEN)
    with contextlib.closing(s), pytest.raises(WeightSyncError) as err:
        s.push(named, 9)
    report = err.value.report
    assert report is not None and not report.ok
    assert all("lm_head.weight" in r.error and r.requests == 0 for r in report.engines.values())
    assert [engine_sums(e) for e in world["engines"]] == old


def test_delta_sends_only_changed_tensors_with_checksums(world, tmp_path):
    reset(world)
    s = sender("delta", tmp_path)
    s.connect(world["urls"], TOKEN)  # baseline: the engines' own checksums (they hold the old weights)
    sd = dict(world["old_sd"])
    key = "model.layers.0.mlp.up_proj.weight"
    with contextlib.closing(s):
        sd[key] = sd[key] + 1
        first = s.push(sd.items(), 1)
        assert first.tensors == 1 and first.unchanged == len(sd) - 1 and first.bytes == sd[key].numel() * 4
        same = s.push(sd.items(), 2)  # nothing changed: one small tensor still carries the version
        assert same.tensors == 1 and same.unchanged == len(sd) - 1
        sd = dict(world["new_sd"])
        changed = [n for n, t in sd.items() if checksum(t) != checksum(world["old_sd"][n])]
        nxt = s.push(sd.items(), 3)
        assert nxt.tensors == len(changed) and 0 < nxt.unchanged < len(sd)
    want = {n: checksum(t) for n, t in sd.items()}
    for e in world["engines"]:
        assert {n: v for n, v in engine_sums(e).items() if n in want} == want and e.weight_version == 3


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_modes_stamp_old_then_new_and_retract_alone_recomputes(world, tmp_path, mode):
    """A request in flight through a weight sync: its tokens carry the old version, then the new, in either
    mode; `retract` recomputes its KV on the new weights (one prefill more), `in_place` keeps it (none)."""
    reset(world)
    eng, url = world["engines"][0], world["urls"][0]
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.setdefault("r", httpx.post(url + "/generate", json=greedy(PROMPTS[0], 600), timeout=120))
    )
    t.start()
    while not (eng.running and len(eng.running[0].output_ids) >= 3):
        pass
    prefills = eng.stats["prefills_total"]
    s = sender("shm", tmp_path)
    s.connect(world["urls"], TOKEN)
    with contextlib.closing(s):
        s.push(world["new_sd"].items(), 4, pause_mode=mode)
    assert all(e.paused is None for e in world["engines"])
    t.join(120)
    versions = result["r"].json()["meta_info"]["output_token_versions"]
    assert versions[0] == 0 and versions[-1] == 4 and set(versions) == {0, 4} and sorted(versions) == versions
    assert eng.stats["prefills_total"] - prefills == (1 if mode == "retract" else 0)


def test_verify_against_engine_checksums(world, tmp_path):
    from furlong.weights.checksums import ENDPOINT, verify

    r = httpx.post(world["urls"][0] + ENDPOINT, json={}, headers={"Authorization": f"Bearer {TOKEN}"})
    if r.status_code in (404, 405):
        pytest.skip(f"the engine has no POST {ENDPOINT} yet (contract in furlong/weights/checksums.py)")
    reset(world)
    s = sender("shm", tmp_path)
    s.connect(world["urls"], TOKEN)
    with contextlib.closing(s):
        s.push(world["new_sd"].items(), 2)
    report = verify(world["urls"], TOKEN, world["new_sd"].items())
    assert report.ok and report.checked == len(world["new_sd"])
    assert set(report.weight_versions.values()) == {2}
    sums = {n: checksum(t) for n, t in world["new_sd"].items()}  # the driver's form: CRCs from the trainer actor
    assert verify(world["urls"], TOKEN, sums).ok
    drifted = {**world["new_sd"], "model.norm.weight": world["new_sd"]["model.norm.weight"] + 1}
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight"):
        verify(world["urls"], TOKEN, drifted.items())
    wrong = verify(world["urls"], TOKEN, {"model.norm.weight": 1, "no.such.weight": 2}, raise_on_mismatch=False)
    assert wrong.mismatches == {u: ["model.norm.weight", "no.such.weight"] for u in world["urls"]}


@pytest.mark.parametrize("reuse", [True, False])
def test_shm_segments_are_reused_then_unlinked(world, tmp_path, reuse):
    import os

    reset(world)
    s = sender("shm", tmp_path, reuse_segments=reuse)
    s.connect(world["urls"], TOKEN)
    s.push(world["new_sd"].items(), 1)
    kept = [seg.name for seg in s._free]
    assert len(kept) == (2 if reuse else 0) and all(os.path.exists(f"/dev/shm/{n}") for n in kept)
    s.push(world["old_sd"].items(), 2)  # written into the same segments
    assert [seg.name for seg in s._free] == kept or sorted(seg.name for seg in s._free) == sorted(kept)
    s.close()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in kept)
    want = {n: checksum(t) for n, t in world["old_sd"].items()}
    assert all(engine_sums(e) == want and e.weight_version == 2 for e in world["engines"])


@pytest.mark.parametrize("transport", ["shm", "delta"])
def test_resident_parameters_travel_without_a_copy(world, tmp_path, transport):
    """The trainer's parameters moved into shared memory are read by the engines in place: no bucket segment
    is written for them (all of them go in one request, whatever the bucket size), an optimiser step keeps
    them there, and a tensor computed for the sync (not held) still travels through a bucket; every push ends
    verified against the engines' checksums."""
    from furlong.weights.resident import ResidentWeights

    reset(world)
    model = AutoModelForCausalLM.from_pretrained(create_model("qwen3", "tiny", seed=1))
    resident = ResidentWeights.adopt(model)
    assert resident is not None
    sd = model.state_dict()
    assert all(resident.locate(t) is not None for t in sd.values())
    assert {n: checksum(t) for n, t in sd.items()} == {n: checksum(t) for n, t in world["new_sd"].items()}
    s = sender(transport, tmp_path, verify=True)
    s.resident = resident
    s.connect(world["urls"], TOKEN)
    try:
        first = s.push(model.state_dict().items(), 7)
        assert first.verified and first.zero_copy_bytes == first.bytes > 0 and s._free == []
        assert first.buckets == 1  # one request for every resident tensor, though 0.05 MB buckets would make ~12
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
        opt.step()  # in place: the parameters stay in the segment
        assert all(resident.locate(p) is not None for p in model.parameters())
        items = dict(model.state_dict())
        key = "model.layers.0.mlp.up_proj.weight"
        items[key] = items[key] * 1.5  # computed for the sync, as a LoRA merge would be: not in the segment
        second = s.push(items.items(), 8)
        assert second.verified and second.zero_copy_bytes == second.bytes - items[key].numel() * 4
        assert len(s._free) == 1 and second.buckets == 2  # one bucket segment, for that one tensor
    finally:
        s.close()
        resident.close()
    want = {n: checksum(t) for n, t in items.items()}
    for e in world["engines"]:
        assert {n: v for n, v in engine_sums(e).items() if n in want} == want and e.weight_version == 8


def test_resident_weights_are_refused_without_room_in_dev_shm(monkeypatch):
    from furlong.weights import resident

    model = AutoModelForCausalLM.from_pretrained(create_model("qwen3", "tiny"))
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    monkeypatch.setattr(resident, "MARGIN", 10**9)  # more than any /dev/shm holds
    assert resident.ResidentWeights.adopt(model) is None
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before  # nothing moved
