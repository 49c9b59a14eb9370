"""The engine in-process against HF: greedy equality, log-prob exactness, batching, cache, sampling."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.engine.engine import Engine
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams
from furlong.models import create_model

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [300, 2, 40, 41, 42, 43], [77] * 19]


def greedy(n: int = 20, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_moe"])
def pair(request):
    path = create_model(request.param, "tiny")
    eng = Engine(path, kv_cache_mb=2, max_running=8, block_size=4).start()
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    yield eng, hf
    eng.stop()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_greedy_and_logprobs_match_hf(pair):
    eng, hf = pair
    reqs = eng.generate([Request(p, greedy(), return_logprob=True, logprob_start_len=0) for p in PROMPTS], timeout=120)
    for p, r in zip(PROMPTS, reqs):
        assert r.output_ids == hf_greedy(hf, p, 20)
        lp = hf_logprobs(hf, p + r.output_ids)
        want = [lp[len(p) - 1 + i, t].item() for i, t in enumerate(r.output_ids)]
        assert max(abs(a - b) for a, b in zip(want, r.output_logprobs)) < 1e-4
        prompt_want = [lp[i, p[i + 1]].item() for i in range(len(p) - 1)]
        assert r.input_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(prompt_want, r.input_logprobs[1:])) < 1e-4
        assert r.output_versions == [0] * 20


@pytest.mark.parametrize("pair", ["qwen3_moe"], indirect=True)
def test_routed_experts_match_hf_router(pair):
    eng, hf = pair
    if not eng.model.is_moe:
        pytest.skip("dense model")
    p = PROMPTS[2]
    (r,) = eng.generate([Request(p, greedy(6), return_routed_experts=True)], timeout=60)
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o[2])) for layer in hf.model.layers]
    with torch.no_grad():
        hf(torch.tensor([p + r.output_ids[:-1]]))
    for h in hooks:
        h.remove()
    want = torch.stack(seen, dim=1)  # [tokens, layers, k]
    got = torch.tensor(eng.result(r)["meta_info"]["routed_experts"])
    assert got.shape == want.shape
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_requests_join_and_leave_mid_flight():
    """Staggered arrivals and different lengths still give each request its solo greedy output."""
    path = create_model("qwen3", "tiny")
    eng = Engine(path, kv_cache_mb=2, max_running=3, block_size=4).start()
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    try:
        reqs = [Request(p, greedy(6 + 5 * i)) for i, p in enumerate(PROMPTS)]
        steps = []
        for r in reqs:
            eng.submit(r)
            steps.append(eng.stats["steps_total"])
            time.sleep(0.01)
        for r in reqs:
            assert r.done.wait(60)
        for i, (p, r) in enumerate(zip(PROMPTS, reqs)):
            assert r.output_ids == hf_greedy(hf, p, 6 + 5 * i)
            assert r.finish_reason == {"type": "length", "length": 6 + 5 * i}
    finally:
        eng.stop()


def test_preemption_recomputes_when_cache_is_full():
    path = create_model("qwen3", "tiny")
    # 2 layers * 2 (k,v) * 1 kv head * 32 dims * 4 bytes = 512 B/token; 0.05 MiB ~ 100 tokens.
    eng = Engine(path, kv_cache_mb=0.05, max_running=8, block_size=4).start()
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    try:
        assert eng.kv_capacity_tokens < 4 * 40
        reqs = eng.generate([Request(p, greedy(40)) for p in PROMPTS], timeout=120)
        assert eng.stats["preemptions_total"] > 0
        for p, r in zip(PROMPTS, reqs):
            assert r.output_ids == hf_greedy(hf, p, 40)
        assert eng.pool.used == 0 or eng.pool.available == eng.pool.num_blocks
    finally:
        eng.stop()


def test_prefix_reuse_across_turns():
    path = create_model("llama", "tiny")
    eng = Engine(path, kv_cache_mb=2, block_size=4).start()
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    try:
        (first,) = eng.generate([Request(PROMPTS[1], greedy(10))], timeout=60)
        turn2 = PROMPTS[1] + first.output_ids + [50, 51, 52]
        (second,) = eng.generate([Request(turn2, greedy(8), return_logprob=True)], timeout=60)
        # every token whose KV the first turn wrote: its full blocks, then its partial tail block (kept, adopted)
        assert second.cached_prompt_tokens == len(PROMPTS[1]) + len(first.output_ids) - 1
        assert second.output_ids == hf_greedy(hf, turn2, 8)
        lp = hf_logprobs(hf, turn2 + second.output_ids)
        want = [lp[len(turn2) - 1 + i, t].item() for i, t in enumerate(second.output_ids)]
        assert max(abs(a - b) for a, b in zip(want, second.output_logprobs)) < 1e-4
        eng.flush_cache().result(10)
        (third,) = eng.generate([Request(turn2, greedy(8))], timeout=60)
        assert third.cached_prompt_tokens == 0 and third.output_ids == second.output_ids
    finally:
        eng.stop()


def test_a_weight_update_in_place_keeps_cached_prefixes_for_one_update():
    """A weight update forgets the cached prefixes, except in place (`pause_mode=in_place`): there the
    context an agent's next turn continues stays for one update more — reused after one update, recomputed
    after two (KV matched through it is marked as that old), and forgotten at once by a plain update."""
    from furlong.engine.quantized import held_state_dict

    path = create_model("llama", "tiny")
    eng = Engine(path, kv_cache_mb=2, block_size=4).start()
    same = {"model.norm.weight": held_state_dict(eng.hf, eng.model)["model.norm.weight"].clone()}

    def update(mode: str) -> None:  # a new version (the same values: the outputs stay comparable)
        eng.pause(mode).result(10)
        eng.call(lambda: eng.apply_weights(same, eng.weight_version + 1)).result(10)
        eng.resume().result(10)

    def turn(prompt: list[int]) -> tuple[Request, list[int]]:
        (r,) = eng.generate([Request(prompt, greedy(6))], timeout=60)
        return r, prompt + r.output_ids + [50, 51]

    try:
        first, turn2 = turn(PROMPTS[1])
        update("in_place")
        second, turn3 = turn(turn2)
        assert second.cached_prompt_tokens == len(PROMPTS[1]) + len(first.output_ids) - 1  # carried over
        fresh, fresh2 = turn(PROMPTS[2])  # computed in the new epoch
        update("in_place")
        third, _ = turn(turn3)
        assert third.cached_prompt_tokens == 0  # its context holds KV from two updates back
        again, fresh3 = turn(fresh2)
        assert again.cached_prompt_tokens == len(PROMPTS[2]) + len(fresh.output_ids) - 1
        update("retract")
        last, _ = turn(fresh3)
        assert last.cached_prompt_tokens == 0 and eng.weight_version == 3
    finally:
        eng.stop()


def test_several_turns_after_cached_prefixes_in_one_step_match_hf():
    """Chunks after cached prefixes of other lengths, beside a fresh prompt, share one padded attention call
    (`batching.CachedPlan`): each one's tokens and log-probs are those of HF on its own."""
    path = create_model("qwen3", "tiny")
    eng = Engine(path, kv_cache_mb=2, block_size=4, max_running=8).start()
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    try:
        firsts = eng.generate([Request(p, greedy(n)) for p, n in zip(PROMPTS, (5, 9, 3, 11))], timeout=60)
        turns = [p + r.output_ids + tail for p, r, tail in zip(PROMPTS, firsts, ([50], [51, 52, 53], [54, 55], []))]
        turns[3] = [88, 89, 90, 91, 92]  # a fresh prompt in the same step
        steps = eng.stats["steps_total"]
        reqs = [Request(t, greedy(6), return_logprob=True) for t in turns]  # (prompt log-probs would skip the cache)
        seconds = eng.generate(reqs, timeout=60)
        assert eng.stats["steps_total"] - steps == 6  # all four prefilled in one step, then decoded together
        assert [r.cached_prompt_tokens > 0 for r in seconds] == [True, True, True, False]
        for t, r in zip(turns, seconds):
            assert r.output_ids == hf_greedy(hf, t, 6)
            lp = hf_logprobs(hf, t + r.output_ids)
            want = [lp[len(t) - 1 + i, x].item() for i, x in enumerate(r.output_ids)]
            assert max(abs(a - b) for a, b in zip(want, r.output_logprobs)) < 1e-4
    finally:
        eng.stop()


def test_fallback_backend_equals_native():
    path = create_model("llama", "tiny")
    nat = Engine(path, kv_cache_mb=1).start()
    fb = Engine(path, kv_cache_mb=1, backend="hf").start()
    try:
        assert fb.backend == "FallbackModel" and nat.backend == "NativeModel"
        a = nat.generate([Request(p, greedy(8), return_logprob=True) for p in PROMPTS], timeout=60)
        b = fb.generate([Request(p, greedy(8), return_logprob=True) for p in PROMPTS], timeout=60)
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids
            assert max(abs(u - v) for u, v in zip(x.output_logprobs, y.output_logprobs)) < 1e-4
    finally:
        nat.stop()
        fb.stop()


@pytest.fixture(scope="module")
def engine():
    eng = Engine(create_model("qwen3", "tiny"), kv_cache_mb=2).start()
    yield eng
    eng.stop()


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    sp = lambda seed: SamplingParams(
        max_new_tokens=16, temperature=1.3, top_p=0.9, top_k=50, seed=seed, ignore_eos=True
    )
    alone = engine.generate([Request(PROMPTS[0], sp(7))], timeout=60)[0].output_ids
    crowd = engine.generate([Request(PROMPTS[i % 4], sp(7 if i == 4 else i + 100)) for i in range(6)], timeout=60)
    assert crowd[4].output_ids == alone
    again = engine.generate([Request(PROMPTS[0], sp(7)), Request(PROMPTS[0], sp(8))], timeout=60)
    assert again[0].output_ids == alone
    assert again[1].output_ids != alone


def test_top_k_one_is_greedy_and_top_k_limits_choices(engine):
    g = engine.generate([Request(PROMPTS[1], greedy(12))], timeout=60)[0].output_ids
    k1 = engine.generate(
        [Request(PROMPTS[1], SamplingParams(max_new_tokens=12, top_k=1, ignore_eos=True, seed=3))], timeout=60
    )[0]
    assert k1.output_ids == g
    r = engine.generate(
        [
            Request(
                PROMPTS[1],
                SamplingParams(max_new_tokens=12, top_k=2, temperature=5, seed=1, ignore_eos=True),
                top_logprobs_num=2,
            )
        ],
        timeout=60,
    )[0]
    for tok, top in zip(r.output_ids, r.output_top_logprobs):
        assert tok in [t for _, t in top]  # always one of the two most likely


def test_stop_token_ids_stop_strings_and_max_new_tokens(engine):
    g = engine.generate([Request(PROMPTS[3], greedy(12))], timeout=60)[0]
    target = g.output_ids[4]
    first = g.output_ids.index(target)
    r = engine.generate([Request(PROMPTS[3], greedy(12, stop_token_ids=[target]))], timeout=60)[0]
    assert r.output_ids == g.output_ids[: first + 1]
    assert r.finish_reason == {"type": "stop", "matched": target}
    full = engine.decode(g.output_ids)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    s = engine.generate([Request(PROMPTS[3], greedy(12, stop=[stop]))], timeout=60)[0]
    assert s.finish_reason["type"] == "stop" and s.finish_reason["matched"] == stop
    res = engine.result(s)
    assert stop not in res["text"] and full.startswith(res["text"])
    assert engine.generate([Request(PROMPTS[3], greedy(3))], timeout=60)[0].output_ids == g.output_ids[:3]


def test_abort_and_pause_modes(engine):
    long = lambda: Request(PROMPTS[0], greedy(1500))
    a, b = engine.submit(long()), engine.submit(long())
    time.sleep(0.2)
    assert engine.abort(a.rid).result(10) == 1
    assert a.done.wait(10) and a.finish_reason["type"] == "abort" and not b.finished
    # in_place: the sequence keeps its cache and resumes
    engine.pause("in_place").result(10)
    n = len(b.output_ids)
    time.sleep(0.1)
    assert len(b.output_ids) == n and not b.finished and b.blocks
    engine.resume().result(10)
    # retract: back to the queue, KV freed, then recomputed
    time.sleep(0.05)
    engine.pause("retract").result(10)
    assert b in engine.waiting and not b.blocks and engine.pool.used == 0
    engine.resume().result(10)
    engine.pause("abort").result(10)
    assert b.done.wait(10) and b.finish_reason["type"] == "abort"
    queued = engine.submit(Request(PROMPTS[1], greedy(4)))
    time.sleep(0.1)
    assert not queued.finished  # paused: queued, not run
    engine.resume().result(10)
    assert queued.done.wait(30) and queued.finish_reason["type"] == "length"


def test_retract_resume_gives_the_uninterrupted_output(engine):
    want = engine.generate([Request(PROMPTS[2], greedy(200))], timeout=60)[0].output_ids
    r = engine.submit(Request(PROMPTS[2], greedy(200)))
    while len(r.output_ids) < 20 and not r.finished:
        time.sleep(0.001)
    engine.pause("retract").result(10)
    engine.resume().result(10)
    assert r.done.wait(60) and r.output_ids == want


def test_bad_weight_update_is_atomic(engine):
    from furlong.engine.quantized import held_state_dict
    from furlong.engine.weight_update import WeightUpdateError

    before = {k: v.clone() for k, v in held_state_dict(engine.hf, engine.model).items()}
    good = {"model.norm.weight": torch.zeros_like(before["model.norm.weight"])}
    for bad in ({**good, "model.nope.weight": torch.zeros(3)}, {**good, "lm_head.weight": torch.zeros(3, 3)}):
        with pytest.raises(WeightUpdateError, match="model.nope.weight|lm_head.weight"):
            engine.call(lambda bad=bad: engine.apply_weights(bad)).result(10)
    after = held_state_dict(engine.hf, engine.model)
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert engine.weight_version == 0
