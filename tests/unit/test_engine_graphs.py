"""`engine.cuda_graphs` on CPU: the static, padded decode step a CUDA graph records, run eagerly, against the
dynamic forward; and the refusal off CUDA.

Two engines on the same tiny model are stepped by hand in lockstep: one runs every step through the
dynamic forward, the other runs each decode-only step through `DecodeGraphs(capture=False)` — the very
step `torch.cuda.graph` records on a GPU (padded to its bucket, attention over the rows' whole
capacity, scratch rows and slot for the padding) — while requests of ragged lengths join and leave
between steps and a weight update lands mid-run. Greedy tokens and every reported log-prob must agree
(fp32). Graph replay ≡ eager on CUDA is tests/gpu/test_cuda_graphs.py.
"""

from __future__ import annotations

import pytest
import torch

from furlong.config.schema import Config, ConfigError
from furlong.engine.engine import Engine
from furlong.engine.graphs import DecodeGraphs, buckets, for_engine
from furlong.engine.launch import engine_argv
from furlong.engine.quantized import held_state_dict
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams

TOL = 1e-5  # fp32: the padded step reduces over more (masked, exactly zero) terms; no other difference


def test_buckets_are_powers_of_two_up_to_max_running():
    assert buckets(1) == [1] and buckets(3) == [1, 2, 4] and buckets(8) == [1, 2, 4, 8]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def ragged_requests(wave: int) -> list[Request]:
    """Greedy requests of ragged prompt lengths and output budgets (so they leave at different steps)."""
    lens = [(3, 9), (11, 4), (6, 13), (17, 2), (4, 7)] if wave == 0 else [(8, 5), (2, 11), (13, 3)]
    params = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return [
        Request(
            [(7 * wave + 3 * i + j) % 400 + 5 for j in range(p)], params(n), return_logprob=True, top_logprobs_num=4
        )
        for i, (p, n) in enumerate(lens)
    ]


def lockstep(engines: dict[str, Engine], update: dict[str, torch.Tensor], on_update=None) -> dict[str, list[Request]]:
    """Step every engine by hand: the same requests join at the same steps (a second wave at step 6, while
    the first decodes and some of it has left), the same weight update lands at step 9 (`on_update` first)."""
    reqs: dict[str, list[Request]] = {name: [] for name in engines}
    for step in range(40):
        if step == 9 and on_update:
            on_update()
        for name, eng in engines.items():
            if step in (0, 6):
                for r in ragged_requests(step // 6):
                    eng._add(r)
                    reqs[name].append(r)
            if step == 9:
                eng.apply_weights(update, version=1)
            if eng.running or eng.waiting:
                eng._step()
    assert not any(eng.running or eng.waiting for eng in engines.values())
    return reqs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_static_padded_decode_step_equals_the_dynamic_forward(arch):
    from furlong.models import create_model

    path = create_model(arch, "tiny")
    eager, static = (Engine(path, kv_cache_mb=2, max_running=8, block_size=4, device="cpu") for _ in range(2))
    runner = DecodeGraphs(static.model, static.pool.alloc() * static.pool.block_size, 8, capture=False)
    static.graphs = runner
    update = {n: p * 1.01 for n, p in held_state_dict(eager.hf, eager.model).items() if "layers.0." in n}
    before = []
    reqs = lockstep({"eager": eager, "static": static}, update, on_update=lambda: before.append(runner.key))
    assert not (eager.running or eager.waiting or static.running or static.waiting)
    gap = 0.0
    for a, b in zip(reqs["eager"], reqs["static"]):
        assert a.output_ids == b.output_ids and len(a.output_ids) == a.params.max_new_tokens
        gap = max(gap, max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)))
        for ta, tb in zip(a.output_top_logprobs, b.output_top_logprobs):
            assert [t for _, t in ta] == [t for _, t in tb]
            gap = max(gap, max(abs(x - y) for (x, _), (y, _) in zip(ta, tb)))
    assert gap <= TOL, gap
    print(f"{arch}: largest log-prob gap static vs dynamic {gap:.3g}")
    used = {B for B, n in runner.replays.items() if n}
    assert {1, 2, 4, 8} <= used, runner.replays  # ragged joins and leaves went through several buckets
    assert runner.mixed_steps == 2  # both waves' prompts, over the rows (`mixed_step`)
    # the packed weights were written in place (engine/packed.py): nothing moved, so no graph would be recaptured
    assert runner.key == before[0] and static.model.held
    assert eager.pool.used == 0 and static.pool.used == 1  # only the scratch block stays taken


def test_cuda_graphs_off_cuda_fail_at_start_naming_both_settings(tiny_model_dir, capsys):
    with pytest.raises(ValueError, match=r"engine.cuda_graphs=true .* on cpu \(engine.device\)"):
        Engine(tiny_model_dir, device="cpu", cuda_graphs=True)
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"engine": {"cuda_graphs": True, "device": "cpu"}})
    assert {"engine.cuda_graphs", "engine.device"} <= set(e.value.fields)
    from furlong.engine import cli

    with pytest.raises(SystemExit):
        cli.main(["--model", str(tiny_model_dir), "--device", "cpu", "--cuda-graphs", "--port", "1"])
    assert "engine.cuda_graphs=true" in capsys.readouterr().err


def test_cuda_graphs_reach_the_engine_command_line(tiny_model_dir):
    common = dict(model_dir=tiny_model_dir, host="127.0.0.1", port=1, dtype="bfloat16", kv_cache_mb=8, max_running=4)
    common.update(max_context=None, prefix_cache=True, threads=1, admin_token="t", device="cuda")
    assert "--cuda-graphs" in engine_argv("builtin", **common, cuda_graphs=True)
    assert "--cuda-graphs" not in engine_argv("builtin", **common)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="engine.cuda_graphs"):
            Config.from_dict({"engine": {"cuda_graphs": True, "backend": "sglang", "device": "cuda"}})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_compiled_decode_step_follows_the_dynamic_forward_and_compiles_once(arch):
    """`engine.compile`: the same lockstep with the static step compiled by `torch.compile` (dynamic shapes,
    attention up to each step's longest context). Inductor's fused loops reorder fp32 reductions, so
    log-probs agree to 1e-4, not bit for bit; greedy tokens agree. It compiles once, never again for a new
    bucket, a longer context, grown rows, a weight update (the projections read the weights when the
    step runs: `furlong::proj`). A new thread count (`/set_threads`) compiles once more: Dynamo guards it."""
    from furlong.models import create_model

    path = create_model(arch, "tiny")
    eager = Engine(path, kv_cache_mb=2, max_running=8, block_size=4, device="cpu")
    compiled = Engine(path, kv_cache_mb=2, max_running=8, block_size=4, device="cpu", compile_decode=True)
    runner = compiled.graphs
    assert runner.compiled is not None and runner.buckets == [1, 2, 4, 8] and runner.bucket(1) == 2
    update = {n: p * 1.01 for n, p in held_state_dict(eager.hf, eager.model).items() if "layers.0." in n}
    at_update, threads = [], torch.get_num_threads()

    def on_update():
        at_update.append(runner.compiled.compiles)
        torch.set_num_threads(1 if threads > 1 else 2)  # both engines step on this thread

    try:
        reqs = lockstep({"eager": eager, "compiled": compiled}, update, on_update=on_update)
    finally:
        torch.set_num_threads(threads)
    gap = 0.0
    for a, b in zip(reqs["eager"], reqs["compiled"]):
        assert a.output_ids == b.output_ids and len(a.output_ids) == a.params.max_new_tokens
        gap = max(gap, max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)))
    assert gap <= 1e-4, gap
    print(f"{arch}: largest log-prob gap compiled vs dynamic {gap:.3g}; {runner.compiled.compiles} compiles")
    assert {2, 4, 8} <= {B for B, n in runner.replays.items() if n}, runner.replays
    assert at_update == [1] and runner.compiled.compiles == 2  # the thread count changed at the update
    assert runner.compiled.calls == sum(runner.replays.values()) and runner.compiled.compile_s > 0
    # both waves' prompts went through the compiled mixed step (`mixed_step`): one compile, before the update
    assert runner.mixed_steps == runner.mixed.calls == 2 and runner.mixed.compiles == 1, runner.mixed_steps


def test_compile_settings_are_checked_and_reach_the_command_line(tiny_model_dir):
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"engine": {"compile": True, "backend": "sglang"}})
    assert {"engine.compile", "engine.backend"} <= set(e.value.fields)
    with pytest.raises(ValueError, match="engine.compile and engine.cuda_graphs"):
        for_engine(object(), cuda_graphs=True, compile_decode=True)  # refused before the engine is looked at
    common = dict(model_dir=tiny_model_dir, host="127.0.0.1", port=1, dtype="bfloat16", kv_cache_mb=8, max_running=4)
    common.update(max_context=None, prefix_cache=True, threads=1, admin_token="t")
    assert "--compile" in engine_argv("builtin", **common, compile_decode=True)
    assert "--compile" not in engine_argv("builtin", **common)


def turn_requests(wave: int, before: list[Request]) -> list[Request]:
    """A long greedy request (first wave only), then agent turns: the first wave's fresh prompts, later
    waves each continuing one earlier turn (its prompt, its output, then 3 tool tokens: a chunk after a
    cached prefix), one of them asking for prompt log-probs (every prompt row's logits)."""
    params = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    if wave == 0:
        long = Request([11, 12, 13, 14, 15], params(30), return_logprob=True)
        return [long] + [Request([(5 * i + j) % 300 + 7 for j in range(6 + i)], params(4)) for i in range(3)]
    turns = [r for r in before[-3:]]
    out = [Request(r.tokens + [40 + wave, 41, 42], params(4), return_logprob=True) for r in turns]
    out[0].logprob_start_len = 0
    return out


@pytest.mark.timeout(240)
def test_mixed_steps_over_the_rows_follow_the_dynamic_forward():
    """`mixed_step`: steps with prompt chunks (fresh prompts, then agent turns resuming a cached context,
    while a long request decodes) run over the decode rows, one query block a chunk, and every greedy
    token and log-prob (output and prompt) agrees with the dynamic forward (fp32: SDPA reduces the
    chunk's causal attention in another order, 1e-5). A chunk keeps its row when it decodes: no decode
    step gathers a row from the pool. A chunk over `MAX_CHUNK` tokens runs the eager forward."""
    from furlong.engine import mixed_step
    from furlong.models import create_model

    path = create_model("qwen3", "tiny")
    eager, rows = (Engine(path, kv_cache_mb=2, max_running=8, block_size=4, device="cpu") for _ in range(2))
    runner = DecodeGraphs(rows.model, rows.pool.alloc() * rows.pool.block_size, 8, capture=False)
    rows.graphs = runner
    fills, run = [], runner.run
    runner.run = lambda b: (fills.append(b.decode_plan.fill_len), run(b))[1]
    reqs: dict[str, list[Request]] = {"eager": [], "rows": []}
    engines = {"eager": eager, "rows": rows}
    for wave in range(3):
        for name, eng in engines.items():
            for r in turn_requests(wave, reqs[name]):
                eng._add(r)
                reqs[name].append(r)
        for _ in range(5):  # a turn's 4 tokens; the long request goes on decoding
            for eng in engines.values():
                eng._step()
    assert runner.mixed_steps == 3 and fills and not any(fills), (runner.mixed_steps, fills)
    for name, eng in engines.items():  # a chunk over MAX_CHUNK: the eager forward
        long_prompt = Request(
            list(range(5, 5 + mixed_step.MAX_CHUNK + 1)),
            SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True),
        )
        eng._add(long_prompt)
        reqs[name].append(long_prompt)
        while eng.running or eng.waiting:
            eng._step()
    assert runner.mixed_steps == 3
    gap = 0.0
    for a, b in zip(reqs["eager"], reqs["rows"], strict=True):
        assert a.output_ids == b.output_ids and len(a.output_ids) == a.params.max_new_tokens
        pairs = list(zip(a.output_logprobs, b.output_logprobs, strict=True))
        pairs += [(x, y) for x, y in zip(a.input_logprobs or [], b.input_logprobs or [], strict=True) if x is not None]
        gap = max([gap] + [abs(x - y) for x, y in pairs])
    assert reqs["rows"][4].input_logprobs and len(reqs["rows"][4].input_logprobs) == len(reqs["rows"][4].prompt_ids)
    assert gap <= TOL, gap
    print(f"largest log-prob gap mixed over rows vs dynamic {gap:.3g}")


@pytest.mark.timeout(240)
def test_mixed_steps_under_preemption_chunking_and_shared_prefills():
    """The scheduler's hard cases through mixed steps over the rows, against the dynamic forward: a KV cache
    small enough to preempt (a retracted request recomputes, and a row it held is never reused for it),
    prompts chunked by `max_prefill_tokens` (a chunk after the first resumes the row its first chunk took),
    and a group of identical prompts (followers share the leader's prefill and join decoding unfilled
    rows). Every greedy token agrees, and every log-prob to 1e-5."""
    from furlong.models import create_model

    path = create_model("qwen3", "tiny")
    kw = dict(kv_cache_mb=0.05, max_running=8, block_size=4, max_prefill_tokens=12, device="cpu")
    eager, rows = Engine(path, **kw), Engine(path, **kw)
    runner = DecodeGraphs(rows.model, rows.pool.alloc() * rows.pool.block_size, 8, capture=False)
    rows.graphs = runner
    prompts = [[(11 * i + 5 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((7, 15, 22, 9))]
    prompts += [prompts[0]] * 3  # a group: one prefill, three followers
    out = {}
    for name, eng in (("eager", eager), ("rows", rows)):
        eng.start()
        try:
            params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
            out[name] = eng.generate([Request(p, params, return_logprob=True) for p in prompts], timeout=180)
        finally:
            eng.stop()
    assert rows.stats["preemptions_total"] > 0 and runner.mixed_steps > 0, (rows.stats, runner.mixed_steps)
    gap = 0.0
    for a, b in zip(out["eager"], out["rows"], strict=True):
        assert a.output_ids == b.output_ids and len(b.output_ids) == 24
        gap = max([gap] + [abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True)])
    assert gap <= TOL, gap
