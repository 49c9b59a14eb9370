"""Event-store overhead: the same short training workload with the store on and off, side by side.

The workload is synthetic but has the shape of a real training step (the full RL
driver, `furlong train`, did not record events yet when this was written): per step,
a real forward + backward + AdamW step of the locally built qwen3 `small` model
(3.4M parameters) on `--train-batch` sequences of `--tokens` tokens (a micro-batch:
kept small so the run is short), then the writes a whole step makes — `--samples`
samples with per-token provenance (train log-probs,
advantages), ~40 metrics, engine metrics and ~30 spans. "Off" is
`EventStore(enabled=False)` (the same calls, no queue, no thread, no file). Runs
alternate off/on to spread machine noise, and the median step time of each is compared.

Also printed: the caller-side cost of each call (what the trainer thread pays) and
whether any event was dropped.

    python benchmarks/observe_overhead.py [--steps 12] [--samples 64] [--tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="steps per configuration (half with the store on)")
    p.add_argument("--samples", type=int, default=64, help="samples recorded per step")
    p.add_argument("--train-batch", type=int, default=8, help="sequences in the forward/backward")
    p.add_argument("--tokens", type=int, default=128, help="response tokens per sample")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from furlong.models import create_model
    from furlong.observe.store import EventStore
    from furlong.observe.synthetic import make_group

    torch.set_num_threads(a.threads)
    path = create_model("qwen3", "small")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, 500, (a.train_batch, a.tokens + 16))
    rng = random.Random(0)
    group_size = 8
    samples = [s for g in range(a.samples // group_size) for s in make_group(1, g, group_size, 1, rng, None)]
    for s in samples:  # pad every response to --tokens policy tokens, as a real step of this shape would have
        extra = a.tokens - s.response_length
        if extra > 0:
            s.append([rng.randrange(3, 500) for _ in range(extra)], logprobs=[-rng.uniform(0.01, 3) for _ in range(extra)], version=1)
    train_lp = [[x - 0.01 for x in s.rollout_logprobs] for s in samples]
    adv = [rng.gauss(0, 1) for _ in samples]
    metric_names = [f"policy/m{i}" for i in range(40)]

    def step(store: EventStore, n: int, call_times: dict[str, list[float]]) -> float:
        t0 = time.perf_counter()
        with store.span("trainer/0", "forward-backward", n, device="cpu:0"):
            out = model(input_ids=ids, labels=ids).loss
            out.backward()
            loss = float(out.detach())
        with store.span("trainer/0", "optimiser", n, device="cpu:0"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        c = time.perf_counter()
        store.samples(n, samples, train_logprobs=train_lp, advantages=adv, version=n)
        call_times["samples"].append(time.perf_counter() - c)
        c = time.perf_counter()
        store.metrics(n, {k: loss + i for i, k in enumerate(metric_names)})
        call_times["metrics"].append(time.perf_counter() - c)
        now = time.time()
        c = time.perf_counter()
        for w in ("engine/0", "engine/1", "driver", "trainer/1"):
            for ph in ("generate", "reward", "ref-logprob", "weight-sync", "idle", "eval", "optimiser"):
                store.record_span(w, ph, n, now - 0.1, now, device="cpu")
        call_times["28 spans"].append(time.perf_counter() - c)
        for e in range(2):
            store.metrics(n, {f"engine/{e}/queue": 3, f"engine/{e}/tokens_per_s": 900.0, f"engine/{e}/healthy": 1.0})
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        on = EventStore(Path(tmp) / "run", tokenizer=tok)
        off = EventStore(Path(tmp) / "off", enabled=False)
        times: dict[str, list[float]] = {"off": [], "on": []}
        calls: dict[str, dict[str, list[float]]] = {k: {"samples": [], "metrics": [], "28 spans": []} for k in times}
        step(off, 0, calls["off"])  # warm-up: first backward, allocator
        for n in range(1, a.steps + 1):
            for name, store in (("off", off), ("on", on)) if n % 2 else (("on", on), ("off", off)):
                times[name].append(step(store, n, calls[name]))
        t = time.perf_counter()
        on.flush()
        drain = time.perf_counter() - t
        on.close()
        size = (Path(tmp) / "run" / "events.sqlite").stat().st_size

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"workload: qwen3 small fwd+bwd+AdamW on {a.train_batch}x{a.tokens + 16} tokens; writes per step: "
          f"{len(samples)} samples x {a.tokens} tokens, 46 metrics, 30 spans; {a.steps} steps each; {a.threads} threads")
    print(f"{'store':<6} {'median step':>12} {'samples()':>11} {'metrics()':>11} {'28 spans':>10}")
    for k in ("off", "on"):
        c = {n: statistics.median(v) * 1e6 for n, v in calls[k].items()}
        print(f"{k:<6} {med[k] * 1e3:>10.1f}ms {c['samples']:>9.0f}µs {c['metrics']:>9.0f}µs {c['28 spans']:>8.0f}µs")
    print(f"overhead ratio (on/off, median step): {med['on'] / med['off']:.3f}x")
    print(f"events dropped: {on.dropped}; written: {on.written}; final flush waited {drain * 1e3:.1f}ms; events.sqlite {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
