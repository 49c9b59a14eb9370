"""Rollout throughput: HF `generate` vs the furlong engine (in-process and over HTTP via the router).

Same model (the locally built ~25M-parameter qwen3 `m25`), same 32 prompts,
64 new tokens each (eos ignored so every system produces exactly 32 × 64
tokens), greedy, fp32 (or `--dtype bfloat16`: both systems in bf16, the peak measured in bf16,
2-byte weights streamed), in one run. Every figure is the median of 3 runs
(64 decode steps each). The machine line (`_machine.header`: CPU, flags, this
run's GEMM peak and memcpy bandwidth) comes first, and the roofline is
min(compute, bandwidth) counting every processed token — prompt and generated
(2 x params FLOP each) — and the weights + KV each decode step must stream.
A "mixed lengths" row gives each request a different `max_new_tokens`, so
requests finish at different steps, as in real traffic; a "groups" row sends 4 prompts
x 8 samples (GRPO groups: one prefill per group; greedy, so same token work). `--compile` runs the
engine's decode and mixed steps compiled (`engine.compile`); their compile time is printed apart, outside every
timed run (the warm-up compiles). A "ceiling" line times the engine's projections alone (its own
linears on its own weights, every weight once: a decode step of 32 rows, and once over all the prompt
tokens), the part of the work no change elsewhere in the step can remove, and prints the tok/s a run doing
nothing else would reach. `--profile` prints a
torch.profiler top-10 of one engine run. Last line:
`RATIO engine_vs_hf=<x> engine_of_roofline=<y>`.

    python benchmarks/engine_throughput.py [--threads 2] [--prompts 32] [--new-tokens 64] [--dtype bfloat16] [--compile]
        [--profile]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402

from furlong.core.net import free_port


def make_prompts(tok, n: int) -> list[list[int]]:
    return [
        tok.encode(
            f"<|im_start|>user\nWhat is {17 * i % 97} + {31 * i % 89}? Answer with a number.<|im_end|>\n<|im_start|>assistant\n"
        )
        for i in range(n)
    ]


def bench_hf(path, prompts, new_tokens, dtype: str = "float32") -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        hf.generate(input_ids=ids[:2], attention_mask=att[:2], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})

        def run() -> float:
            t0 = time.perf_counter()
            out = hf.generate(input_ids=ids, attention_mask=att, **kw)
            dt = time.perf_counter() - t0
            assert out.shape[1] - L == new_tokens
            return len(prompts) * new_tokens / dt

        return _machine.median_of(run)[0]


COMPILE_S: list[float] = []  # seconds each `--compile` engine spent compiling (in its warm-up)
FLOOR_S: dict[str, float] = {}  # the projections alone: "prefill" (every prompt token) and "decode" (one step)


def projection_floor(model, rows: int, repeats: int = 20) -> float:
    """Seconds for every dense projection of the engine's model, once, over `rows` token rows (median of
    `repeats`): the engine's own linears (oneDNN-packed on CPU) on the same weights, with nothing else —
    no attention, norms, sampler or scheduler. A step over `rows` tokens cannot take less, so this bounds
    what any engine work on the rest of the step can reach on this machine."""
    import statistics

    keys = list(model.sources)  # each projection weight once: "0.qkv", "0.o", ..., "lm_head"
    dtype = model.sources[keys[0]][0].dtype
    xs = {k: torch.randn(rows, model.sources[k][0].shape[1], dtype=dtype) for k in keys}

    def once() -> float:
        t0 = time.perf_counter()
        for k in keys:
            model.proj(k, xs[k])
        return time.perf_counter() - t0

    with torch.inference_mode():
        once()
        return statistics.median(once() for _ in range(repeats))


def bench_engine(
    path,
    prompts,
    new_tokens,
    mixed: bool = False,
    profile: bool = False,
    groups: int = 0,
    dtype: str = "float32",
    compile_decode: bool = False,
) -> float:
    """Median of 3 runs; `mixed`: request i asks for a different length (finishes at its own step);
    `groups`: the prompts are `groups` prompts repeated (GRPO groups, one prefill per group)."""
    from furlong.engine.engine import Engine
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams

    if groups:
        prompts = [prompts[i // (len(prompts) // groups)] for i in range(len(prompts))]
    eng = Engine(path, dtype=dtype, max_running=len(prompts), kv_cache_mb=256, compile_decode=compile_decode).start()
    sp = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    lens = [
        max(4, new_tokens // 4 + (i * 37) % (new_tokens - new_tokens // 4 + 1)) if mixed else new_tokens
        for i in range(len(prompts))
    ]

    def run() -> float:
        eng.flush_cache().result()
        t0 = time.perf_counter()
        reqs = eng.generate([Request(p, sp(n)) for p, n in zip(prompts, lens)], timeout=600)
        dt = time.perf_counter() - t0
        assert [len(r.output_ids) for r in reqs] == lens
        return sum(lens) / dt

    try:
        # warm-up, ragged so the batch passes through several buckets (a compiled step compiles here)
        eng.generate([Request(p, sp(4 + i % 8)) for i, p in enumerate(prompts)], timeout=600)
        if eng.graphs is not None and eng.graphs.compiled is not None:  # the decode and the mixed step
            COMPILE_S.append(eng.graphs.compiled.compile_s + eng.graphs.mixed.compile_s)
        if not mixed and not groups and not FLOOR_S:  # on the scheduler's thread, between runs
            n_prompt = sum(map(len, prompts))
            FLOOR_S["prefill"] = eng.call(lambda: projection_floor(eng.model, n_prompt, 5)).result()
            FLOOR_S["decode"] = eng.call(lambda: projection_floor(eng.model, len(prompts))).result()
        if profile:  # on this thread: the profiler records the thread that starts it, not the scheduler's
            inline = Engine(path, dtype=dtype, max_running=len(prompts), kv_cache_mb=256, compile_decode=compile_decode)
            step_inline(inline, [Request(p, sp(4)) for p in prompts[:2]])  # warm-up
            reqs = [Request(p, sp(n)) for p, n in zip(prompts, lens)]
            _machine.profile_top10(lambda: step_inline(inline, reqs), "engine scheduler steps, one run")
        return _machine.median_of(run)[0]
    finally:
        eng.stop()


def step_inline(eng, reqs) -> None:
    """Run requests through a (not started) engine's scheduler steps on the calling thread (for profiling)."""
    for r in reqs:
        eng._add(r)
    with torch.no_grad():
        while eng.running or eng.waiting:
            eng._step()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not healthy after {timeout} s")


def bench_http_router(
    path, prompts, new_tokens, threads: int, dtype: str = "float32", compile_decode: bool = False
) -> float:
    """Engine and router as real processes; 32 concurrent clients post /generate to the router."""
    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    ep, rp = free_port(), free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "furlong.cli",
                "serve",
                "--model",
                str(path),
                "--port",
                str(ep),
                "--max-running",
                str(len(prompts)),
                "--threads",
                str(threads),
                "--dtype",
                dtype,
                *(["--compile"] if compile_decode else []),
            ],
            env=env,
        )
    ]
    try:
        wait_healthy(f"http://127.0.0.1:{ep}", procs[0])
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "furlong.cli",
                    "router",
                    "--engine",
                    f"http://127.0.0.1:{ep}",
                    "--port",
                    str(rp),
                    "--log-level",
                    "warning",
                ],
                env={**env, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.DEVNULL,
            )
        )
        url = f"http://127.0.0.1:{rp}"
        wait_healthy(url, procs[1])
        body = lambda p, n: {
            "input_ids": p,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        }
        with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
            with ThreadPoolExecutor(len(prompts)) as pool:  # warm-up, ragged (a compiled step compiles here)
                warm = pool.map(
                    lambda ip: c.post(url + "/generate", json=body(ip[1], 4 + ip[0] % 8)), enumerate(prompts)
                )
                assert all(r.status_code == 200 for r in warm)
            c.post(url + "/flush_cache")

            def run() -> float:
                c.post(url + "/flush_cache")
                with ThreadPoolExecutor(len(prompts)) as pool:
                    t0 = time.perf_counter()
                    outs = list(pool.map(lambda p: c.post(url + "/generate", json=body(p, new_tokens)).json(), prompts))
                    dt = time.perf_counter() - t0
                assert all(len(o["output_ids"]) == new_tokens for o in outs), outs[0]
                return len(prompts) * new_tokens / dt

            return _machine.median_of(run)[0]
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--size", default="m25")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both systems' dtype")
    ap.add_argument("--compile", action="store_true", help="the engine's decode step compiled (engine.compile)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--profile", action="store_true", default=_machine.profiling(), help="torch.profiler top-10")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from furlong.models import create_model, load_tokenizer

    info = _machine.header(getattr(torch, args.dtype))  # the GEMM peak in the dtype the systems compute in
    path = create_model("qwen3", args.size)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    n_params = sum(
        t.numel()
        for t in __import__("safetensors.torch", fromlist=["load_file"])
        .load_file(str(path / "model.safetensors"))
        .values()
    )
    prompts = make_prompts(load_tokenizer(path), args.prompts)
    mean_prompt = sum(map(len, prompts)) // len(prompts)
    print(
        f"model qwen3-{args.size}: {n_params / 1e6:.1f}M params; "
        f"{args.prompts} prompts × {args.new_tokens} new tokens; "
        f"{args.threads} threads, {args.dtype}; prompt lengths {min(map(len, prompts))}-{max(map(len, prompts))}; median of 3 runs",
        flush=True,
    )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
    roofline = _machine.decode_roofline_tok_s(
        n_params, elem * n_params, mean_prompt, args.new_tokens, args.prompts, kv_bytes, info
    )
    rows: list[tuple[str, float | None, str]] = []
    rows.append(
        (
            f"HF generate (batch {args.prompts}, padded)",
            None if args.skip_hf else bench_hf(path, prompts, args.new_tokens, args.dtype),
            "skipped (--skip-hf)",
        )
    )
    print("  measured HF generate", flush=True)
    engine = lambda **kw: bench_engine(
        path, prompts, args.new_tokens, dtype=args.dtype, compile_decode=args.compile, **kw
    )
    rows.append(("furlong engine, in-process", engine(profile=args.profile), ""))
    rows.append(("furlong engine, mixed lengths", engine(mixed=True), ""))
    rows.append(("furlong engine, 4 prompts x 8 (groups)", engine(groups=4), ""))
    print("  measured engine in-process", flush=True)
    if args.skip_http:
        rows.append(("furlong engine, HTTP via router, 32 clients", None, "skipped (--skip-http)"))
    elif importlib.util.find_spec("furlong.router.cli") is None:
        rows.append(
            ("furlong engine, HTTP via router, 32 clients", None, "skipped: furlong.router is not installed yet")
        )
    else:
        rows.append(
            (
                "furlong engine, HTTP via router, 32 clients",
                bench_http_router(path, prompts, args.new_tokens, args.threads, args.dtype, args.compile),
                "",
            )
        )
    g, hf = info["gemm"], rows[0][1]
    print(
        f"\nroofline {roofline:,.0f} tok/s = min(compute: {g['peak']:.0f} GFLOP/s over 2 x {n_params / 1e6:.1f}M FLOP "
        f"per processed token, prompt included; bandwidth: {info['bandwidth_gbs']:.1f} GB/s over the weights per "
        f"decode step + KV read)\n"
    )
    print(f"{'system':<46}{'tok/s':>10}{'of roofline':>13}{'vs HF':>9}")
    for name, tps, why in rows:
        if tps is None:
            print(f"{name:<46}{why:>32}")
            continue
        vs = f"{tps / hf:.2f}x" if hf else "-"
        print(f"{name:<46}{tps:>10,.0f}{tps / roofline:>12.0%}{vs:>9}")
    print(f"{'roofline min(compute, bandwidth)':<46}{roofline:>10,.0f}{1:>12.0%}")
    if FLOOR_S:
        # one prefill step makes the first token of each request, then new_tokens - 1 decode steps
        floor_s = FLOOR_S["prefill"] + (args.new_tokens - 1) * FLOOR_S["decode"]
        ceiling = args.prompts * args.new_tokens / floor_s
        print(
            f"\nceiling: the engine's projections alone (every weight once a step, its own linears, nothing else) "
            f"take {FLOOR_S['decode'] * 1e3:.2f} ms a decode step of {args.prompts} rows and "
            f"{FLOOR_S['prefill'] * 1e3:.1f} ms over the prompts: at most {ceiling:,.0f} tok/s, "
            f"{ceiling / roofline:.0%} of the roofline" + (f", {ceiling / hf:.2f}x HF" if hf else "")
        )
    if COMPILE_S:
        print(f"\nengine.compile: {' + '.join(f'{s:.0f}' for s in COMPILE_S)} s compiling, once per engine, untimed")
    print("\n" + _machine.load_line(args.threads, "these figures understate every system"))
    eng = rows[1][1]
    print(f"RATIO engine_vs_hf={eng / hf if hf else float('nan'):.2f} engine_of_roofline={eng / roofline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
