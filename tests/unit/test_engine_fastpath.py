"""Engine fast paths: n samples with one prefill, persistent decode rows, the vectorised seeded sampler."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.engine.decode_rows import DecodeRows
from furlong.engine.engine import Engine
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams, sample
from furlong.engine.server import ServerThread
from furlong.models import create_model

PROMPT_TAIL = [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 13 tokens: a partial block of 4
PROMPT_FULL = [300, 2, 40, 41, 42, 43, 44, 45]  # 8 tokens: exactly two blocks of 4


def sampled(seed: int, n: int = 10) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.2, top_k=40, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    path = create_model("qwen3", "tiny")
    eng = Engine(path, kv_cache_mb=2, max_running=16, block_size=4).start()
    yield eng, AutoModelForCausalLM.from_pretrained(path).eval()
    eng.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("prompt", [PROMPT_TAIL, PROMPT_FULL], ids=["partial-tail-block", "full-blocks"])
def test_n_samples_share_one_prefill_and_equal_their_solo_runs(pair, prompt):
    eng, _ = pair
    eng.flush_cache().result(10)
    alone = []
    for seed in range(4):
        before = eng.stats["prefills_total"]
        alone.append(eng.generate([Request(prompt, sampled(seed))], timeout=60)[0].output_ids)
        assert eng.stats["prefills_total"] == before + 1
        eng.flush_cache().result(10)  # no prefix reuse: each solo run computes its prompt
    assert len({tuple(a) for a in alone}) > 1  # the seeds differ, so the samples do
    before, forked = eng.stats["prefills_total"], eng.stats["forked_prefills_total"]
    group = eng.generate([Request(prompt, sampled(seed)) for seed in range(4)], timeout=60)
    assert eng.stats["prefills_total"] == before + 1  # one prefill for the whole group
    assert eng.stats["forked_prefills_total"] == forked + 3
    assert [r.output_ids for r in group] == alone  # shared (copied-on-fork) prompt KV is exact
    assert all(r.cached_prompt_tokens == len(prompt) for r in group[1:])
    assert eng.pool.used == 0  # every shared block's references were given back


@pytest.mark.timeout(240)
def test_greedy_group_and_forked_logprobs_match_hf(pair):
    eng, hf = pair
    eng.flush_cache().result(10)
    greedy = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    lead = Request(PROMPT_TAIL, greedy(8), return_logprob=True)
    reqs = eng.generate([lead] + [Request(PROMPT_TAIL, greedy(3 + 2 * i)) for i in range(3)], timeout=60)
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT_TAIL]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        lp = torch.log_softmax(hf(want).logits[0].float(), -1)
    want = want[0, len(PROMPT_TAIL) :].tolist()
    assert reqs[0].output_ids == want
    got = [lp[len(PROMPT_TAIL) - 1 + i, t].item() for i, t in enumerate(want)]
    assert max(abs(a - b) for a, b in zip(got, reqs[0].output_logprobs)) < 1e-4
    for i, r in enumerate(reqs[1:]):  # followers finish at different steps: rows are freed mid-flight
        assert r.output_ids == want[: 3 + 2 * i]


@pytest.mark.timeout(240)
def test_each_sample_s_next_turn_adopts_its_own_tail_block(pair):
    """After a sampled group (one prefill, forked), each sample's next turn reuses every token its first turn
    wrote — full blocks, then its own partial last block, kept when it finished — and decodes what HF
    decodes from scratch."""
    eng, hf = pair
    eng.flush_cache().result(10)
    firsts = eng.generate([Request(PROMPT_TAIL, sampled(seed)) for seed in range(4)], timeout=60)
    assert len({tuple(r.output_ids) for r in firsts}) == 4  # (seeded) four contexts, four tails
    turns = [PROMPT_TAIL + r.output_ids + [50, 51] for r in firsts]  # 23 tokens written, then 2 new ones
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    hits = eng.pool.hit_tokens
    seconds = eng.generate([Request(t, greedy, return_logprob=True) for t in turns], timeout=60)
    assert eng.pool.hit_tokens - hits == 4 * 22 and all(r.cached_prompt_tokens == 22 for r in seconds)
    for t, r in zip(turns, seconds):
        with torch.no_grad():
            want = hf.generate(torch.tensor([t]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
            lp = torch.log_softmax(hf(want).logits[0].float(), -1)
        assert r.output_ids == want[0, len(t) :].tolist()
        got = [lp[len(t) - 1 + i, x].item() for i, x in enumerate(r.output_ids)]
        assert max(abs(a - b) for a, b in zip(got, r.output_logprobs)) < 1e-4


@pytest.mark.timeout(240)
def test_http_generate_with_n_prefills_the_prompt_once(pair):
    """`sampling_params.n` over the real HTTP API: n results, one prefill, n - 1 forks (counted)."""
    eng, _ = pair
    before, forked = eng.stats["prefills_total"], eng.stats["forked_prefills_total"]
    body = {"input_ids": PROMPT_TAIL, "sampling_params": {"n": 3, "max_new_tokens": 6, "ignore_eos": True}}
    with ServerThread(eng) as srv, httpx.Client(timeout=60) as c:
        out = c.post(srv.url + "/generate", json=body).json()
        metrics = c.get(srv.url + "/metrics").text
    assert len(out) == 3 and all(len(o["output_ids"]) == 6 for o in out)
    assert eng.stats["prefills_total"] == before + 1 and eng.stats["forked_prefills_total"] == forked + 2
    assert f"furlong_engine_forked_prefills_total {forked + 2}" in metrics


def test_decode_rows_keep_packed_rows_and_fill_only_newcomers():
    rows = DecodeRows(n_layers=1, n_kv=1, head_dim=2, dtype=torch.float32)
    r, fill_i, _ = rows.assign((1, 2, 3), [5, 5, 5])
    assert r.tolist() == [0, 1, 2] and fill_i == [0, 1, 2]
    rows.commit(r, [5, 5, 5])
    r, fill_i, _ = rows.assign((1, 2, 3), [6, 6, 6])  # everyone follows on: nothing gathered
    assert r.tolist() == [0, 1, 2] and fill_i == []
    rows.commit(r, [6, 6, 6])
    r, fill_i, fill_r = rows.assign((1, 3, 4), [7, 7, 3])  # 2 left, 4 joined: 3 keeps row 2 < D
    assert sorted(r.tolist()) == [0, 1, 2] and r.tolist()[:2] == [0, 2] and fill_i == [2] and fill_r == [1]
    rows.commit(r, [7, 7, 3])
    r, fill_i, fill_r = rows.assign((3,), [8])  # 3 sat in row 2 >= D=1: moved into row 0 (refilled)
    assert r.tolist() == [0] and fill_i == [0]
    r, fill_i, _ = rows.assign((9,), [200])  # longer than the storage: it grows
    assert rows.cap >= 200 and fill_i == [0]


def test_vectorised_sampler_reproduces_alone_and_in_a_batch_and_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    p = SamplingParams(seed=1)
    crowd_p = [SamplingParams(temperature=0.7, top_k=3), p]
    for seed in range(20):
        alone, _ = sample(logits[1:], [p], [torch.Generator().manual_seed(seed)])
        gens = [torch.Generator().manual_seed(999), torch.Generator().manual_seed(seed)]
        crowd, _ = sample(logits, crowd_p, gens)
        assert crowd[1] == alone[0]
    g = torch.Generator().manual_seed(0)
    draws = [sample(logits[:1], [SamplingParams()], [g])[0][0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert (freq - torch.tensor([0.5, 0.3, 0.15, 0.05])).abs().max() < 0.04  # 3000 draws: sd <= 0.009
    masked = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    assert {sample(masked, [SamplingParams()], [g])[0][0] for _ in range(200)} == {0, 2}
