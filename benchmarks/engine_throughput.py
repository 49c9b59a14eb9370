"""Rollout throughput: HF `generate` vs the furlong engine (in-process and over HTTP via the router).

Same model (the locally built ~25M-parameter qwen3 `m25`), same 32 prompts,
64 new tokens each (eos ignored so every system produces exactly 32 × 64
tokens), greedy, fp32, in one run. Also measures the machine's fp32 matmul
peak and turns it into a tokens/s roofline (≈ 2·params FLOP per token) so
every figure is also shown as a fraction of what the hardware allows.

    python benchmarks/engine_throughput.py [--threads 2] [--prompts 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def matmul_gflops(n: int = 1024, seconds: float = 1.5) -> dict[str, float]:
    """fp32 GFLOP/s of an n x n matmul through each library torch can use here: MKL (`torch.mm`, what HF
    runs on) and oneDNN with a pre-packed weight (what the engine runs on when available). The roofline
    is the better of the two, so no system is measured against a slower library than it could use."""
    from furlong.engine.model import pick_linear

    a, b = torch.randn(n, n), torch.randn(n, n)
    linear, pack = pick_linear(torch.float32)
    packed = pack(b)
    out = {}
    for name, fn in (("mkl", lambda: torch.mm(a, b)), ("onednn", lambda: linear(a, packed))):
        fn()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            reps += 1
        out[name] = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9
    return out


def make_prompts(tok, n: int) -> list[list[int]]:
    return [
        tok.encode(
            f"<|im_start|>user\nWhat is {17 * i % 97} + {31 * i % 89}? Answer with a number.<|im_end|>\n<|im_start|>assistant\n"
        )
        for i in range(n)
    ]


def bench_hf(path, prompts, new_tokens) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        hf.generate(input_ids=ids[:2], attention_mask=att[:2], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=att, **kw)
        dt = time.perf_counter() - t0
    assert out.shape[1] - L == new_tokens
    return len(prompts) * new_tokens / dt


def bench_engine(path, prompts, new_tokens) -> float:
    from furlong.engine.engine import Engine
    from furlong.engine.request import Request
    from furlong.engine.sampler import SamplingParams

    eng = Engine(path, max_running=len(prompts), kv_cache_mb=256).start()
    sp = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    try:
        eng.generate([Request(p, sp(4)) for p in prompts[:2]], timeout=120)  # warm-up
        eng.flush_cache().result()
        t0 = time.perf_counter()
        reqs = eng.generate([Request(p, sp(new_tokens)) for p in prompts], timeout=600)
        dt = time.perf_counter() - t0
    finally:
        eng.stop()
    assert all(len(r.output_ids) == new_tokens for r in reqs)
    return len(prompts) * new_tokens / dt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def bench_http_router(path, prompts, new_tokens, threads: int) -> float:
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
            assert c.post(url + "/generate", json=body(prompts[0], 4)).status_code == 200  # warm-up
            c.post(url + "/flush_cache")
            with ThreadPoolExecutor(len(prompts)) as pool:
                t0 = time.perf_counter()
                outs = list(pool.map(lambda p: c.post(url + "/generate", json=body(p, new_tokens)).json(), prompts))
                dt = time.perf_counter() - t0
        assert all(len(o["output_ids"]) == new_tokens for o in outs), outs[0]
        return len(prompts) * new_tokens / dt
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
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from furlong.models import create_model, load_tokenizer

    path = create_model("qwen3", args.size)
    n_params = sum(
        t.numel()
        for t in __import__("safetensors.torch", fromlist=["load_file"])
        .load_file(str(path / "model.safetensors"))
        .values()
    )
    prompts = make_prompts(load_tokenizer(path), args.prompts)
    print(
        f"model qwen3-{args.size}: {n_params / 1e6:.1f}M params; {args.prompts} prompts × {args.new_tokens} new tokens; "
        f"{args.threads} threads; prompt lengths {min(map(len, prompts))}-{max(map(len, prompts))}",
        flush=True,
    )
    peaks = matmul_gflops()
    gflops = max(peaks.values())
    roofline = gflops * 1e9 / (2 * n_params)
    rows: list[tuple[str, float | None, str]] = []
    rows.append(
        (
            "HF generate (batch 32, padded)",
            None if args.skip_hf else bench_hf(path, prompts, args.new_tokens),
            "skipped (--skip-hf)",
        )
    )
    print("  measured HF generate", flush=True)
    rows.append(("furlong engine, in-process", bench_engine(path, prompts, args.new_tokens), ""))
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
                bench_http_router(path, prompts, args.new_tokens, args.threads),
                "",
            )
        )
    print(
        f"\nfp32 matmul peak: {gflops:.1f} GFLOP/s (MKL {peaks['mkl']:.0f}, oneDNN packed {peaks['onednn']:.0f})  ->  roofline {roofline:,.0f} tok/s (2 x {n_params / 1e6:.1f}M FLOP/token)\n"
    )
    print(f"{'system':<46}{'tok/s':>10}{'of roofline':>13}{'vs HF':>9}")
    hf = rows[0][1]
    for name, tps, why in rows:
        if tps is None:
            print(f"{name:<46}{why:>32}")
            continue
        vs = f"{tps / hf:.2f}x" if hf else "-"
        print(f"{name:<46}{tps:>10,.0f}{tps / roofline:>12.0%}{vs:>9}")
    print(f"{'roofline (fp32 matmul peak)':<46}{roofline:>10,.0f}{1:>12.0%}")
    load = os.getloadavg()[0]
    print(
        f"\nload average {load:.1f} on {os.cpu_count()} cores"
        + (" - other work shared the CPU; these figures understate every system" if load > args.threads + 0.5 else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
