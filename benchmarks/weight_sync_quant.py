"""Bytes moved per sync, and bytes the engine holds, per `engine.quantization` format, against none.

One built-in engine per format serves the locally built qwen3 `--size` (default m25, ~25M parameters) in
this process behind its HTTP server; a `ShmSender` with `quantization=<fmt>` pushes the model's fp32 weights
`--steps` times (after one untimed push). Printed per format: the sender's `report.bytes` per sync (codes +
scales for each projection, everything else dense) and its ratio to the dense sync; the mean seconds of a
timed push (quantising included: it happens in the sender, once per sync) and the ratio to the dense push;
and what the engine holds for its weights (`/get_weights_checksum`'s tensors: codes + scales, plus the
dense embeddings, norms and lm_head) against the dense engine. lm_head and the embeddings stay fp32 by
design, so they bound the ratio from below on a small-vocabulary model.

    python benchmarks/weight_sync_quant.py [--size m25] [--steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402

FORMATS = ("none", "fp8", "mxfp8", "nvfp4", "int4")


def run_format(path, fmt: str, weights: list[tuple[str, torch.Tensor]], steps: int) -> dict[str, float]:
    from furlong.engine.engine import Engine
    from furlong.engine.quantized import held_state_dict
    from furlong.engine.server import ServerThread
    from furlong.weights import make_sender

    eng = Engine(path, kv_cache_mb=8, quantization=fmt).start()
    try:
        with ServerThread(eng) as srv:
            sender = make_sender("shm", quantization=fmt)
            sender.connect([srv.url], None)
            try:
                report = sender.push(weights, version=1)
                times = []
                for v in range(steps):
                    t0 = time.perf_counter()
                    sender.push(weights, version=2 + v)
                    times.append(time.perf_counter() - t0)
            finally:
                sender.close()
        held = eng.call(lambda: held_state_dict(eng.hf, eng.model)).result(60)
    finally:
        eng.stop()
    return {
        "bytes": report.bytes,
        "seconds": statistics.mean(times),
        "held": sum(t.numel() * t.element_size() for t in held.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="m25", choices=["tiny", "small", "m25"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _machine.header()
    from transformers import AutoModelForCausalLM

    from furlong.models import create_model

    path = create_model("qwen3", args.size)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    weights = [(n, t.detach().clone()) for n, t in hf.state_dict().items()]
    n_params = sum(t.numel() for _, t in weights)
    print(f"qwen3 {args.size}: {n_params / 1e6:.1f}M parameters, fp32; shm, {args.steps} timed pushes per format")
    print(f"{'format':<7} {'MB/sync':>8} {'vs none':>8} {'s/sync':>7} {'vs none':>8} {'held MB':>8} {'vs none':>8}")
    base = None
    for fmt in FORMATS:
        r = run_format(path, fmt, weights, args.steps)
        base = base or r
        print(
            f"{fmt:<7} {r['bytes'] / 1e6:>8.2f} {r['bytes'] / base['bytes']:>8.3f} {r['seconds']:>7.3f} "
            f"{r['seconds'] / base['seconds']:>8.2f} {r['held'] / 1e6:>8.2f} {r['held'] / base['held']:>8.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
