"""A synthetic run written through the real `EventStore` API, for tests, screenshots and the overhead benchmark.

It makes the same calls a `furlong train` step makes — spans for every worker's
phases, the step's metrics, engine health metrics and the trained samples with
their train log-probs and advantages — with made-up but self-consistent values:
real `Sample` objects (policy tokens, a tool segment with loss mask 0, truncated
and aborted samples, a zero-variance group), times laid out on a virtual clock so
nothing sleeps. It returns what it wrote, so tests can check the dashboard against it.

    python -m furlong.observe.synthetic RUN_DIR [--steps 6]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path
from typing import Any

from furlong.observe.store import EventStore
from furlong.rollout.sample import Sample, Source, Status

ANSWERS = ["The answer is 42.", "I think it is 17.", "Let me add: 17 + 25 = 42.", "42", "It is 41, no, 42."]


def _ids(tokenizer: Any, text: str, rng: random.Random, n: int) -> list[int]:
    return list(tokenizer.encode(text)) if tokenizer is not None else [rng.randrange(3, 500) for _ in range(n)]


def make_group(step: int, group: int, size: int, version: int, rng: random.Random, tokenizer: Any = None) -> list[Sample]:
    """One prompt's samples: mostly policy tokens, one with a tool call and its output, some truncated/aborted."""
    a, b = 10 + group * 7 % 50, 20 + step * 3 % 40
    prompt = [{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}]
    out = []
    for k in range(size):
        s = Sample(index=group * size + k, group_index=group, prompt=prompt, tokens=_ids(tokenizer, prompt[0]["content"], rng, 12))
        text = ANSWERS[(step + group + k) % len(ANSWERS)]
        first = _ids(tokenizer, text, rng, 6 + k)
        # Partial rollout across a weight sync: the first tokens came from the previous version.
        cut = len(first) // 3 if (k == 1 and version > 0) else 0
        for part, v in ((first[:cut], version - 1), (first[cut:], version)):
            if part:
                s.append(part, logprobs=[-rng.uniform(0.01, 3.0) for _ in part], version=v)
        if k == 2:  # a tool round-trip: env output is not trained
            s.append(_ids(tokenizer, " [calc: 42]", rng, 4), source=Source.TOOL, version=version)
            tail = _ids(tokenizer, " So 42.", rng, 3)
            s.append(tail, logprobs=[-rng.uniform(0.01, 1.0) for _ in tail], version=version)
        s.status = Status.TRUNCATED if k == size - 1 and group % 2 else Status.COMPLETED
        if step % 3 == 2 and k == 0 and group == 0:
            s.status, s.status_reason = Status.ABORTED, "engine restarted"
        zero_var = group == 1 and step % 2 == 0  # every sample of this group gets the same reward
        s.reward = 1.0 if zero_var or "42" in text and s.status == Status.COMPLETED else 0.0
        s.metadata["staleness"] = 1 if cut else 0  # as the rollout manager sets it
        if tokenizer is None:
            s.metadata["response_text"] = text
        out.append(s.validate())
    return out


def write_synthetic_run(
    run_dir: str | Path,
    *,
    steps: int = 4,
    groups: int = 3,
    group_size: int = 4,
    trainer_ranks: int = 2,
    engines: int = 2,
    tokenizer: Any = None,
    seed: int = 0,
    store: EventStore | None = None,
    step_pause_s: float = 0.0,
) -> dict[str, Any]:
    """Write `steps` training steps to `run_dir`; return what was written (workers, steps, samples per step...)."""
    rng = random.Random(seed)
    own = store is None
    store = store or EventStore(run_dir, tokenizer=tokenizer)
    engine_ids = [f"engine/{e}" for e in range(engines)]
    ranks = [f"trainer/{r}" for r in range(trainer_ranks)]
    workers = ["driver", *engine_ids, *ranks]
    t = time.time() - steps * 2.0  # a virtual clock ending about now
    written: dict[str, Any] = {"workers": workers, "steps": list(range(1, steps + 1)), "samples": {}, "spans": 0}

    def span(worker: str, phase: str, step: int, start: float, dur: float, device: str) -> float:
        store.record_span(worker, phase, step, start, start + dur, device=device)
        written["spans"] += 1
        return start + dur

    for step in range(1, steps + 1):
        version, gen_start = step - 1, t
        gen_end = max(span(e, "generate", step, t, rng.uniform(0.5, 0.8), f"cpu:{i}") for i, e in enumerate(engine_ids))
        span("driver", "idle", step, t, gen_end - t, "cpu")
        t_rew = span("driver", "reward", step, gen_end, 0.05, "cpu")
        ends = []
        devices = {e: f"cpu:{i}" for i, e in enumerate(engine_ids)} | {w: f"cpu:{engines + r}" for r, w in enumerate(ranks)}
        for w in ranks:
            dev = devices[w]
            tr = span(w, "idle", step, t, gen_end - t, dev)
            tr = span(w, "ref-logprob", step, t_rew, 0.1, dev)
            for _ in range(2):  # num_steps_per_rollout = 2
                tr = span(w, "forward-backward", step, tr, rng.uniform(0.2, 0.3), dev)
                tr = span(w, "optimiser", step, tr, 0.03, dev)
            ends.append(tr)
        sync_start = max(ends)
        sync_end = sync_start + 0.08
        for w in [*ranks, *engine_ids]:
            span(w, "weight-sync", step, sync_start, 0.08, devices[w])
        if step % 2 == 0:
            sync_end = span(engine_ids[0], "eval", step, sync_end, 0.1, devices[engine_ids[0]])
        t = sync_end + 0.02

        samples = [s for g in range(groups) for s in make_group(step, g, group_size, version, rng, tokenizer)]
        train_lp = [[lp + rng.gauss(0, 0.02) for lp in s.rollout_logprobs] for s in samples]
        advantages = []
        for g in range(groups):
            rewards = [s.scalar_reward for s in samples if s.group_index == g]
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
            advantages += [(x - mean) / (std + 1e-6) for x in rewards]
        store.samples(step, samples, train_logprobs=train_lp, advantages=advantages, version=version)
        written["samples"][step] = [(s.index, s.response_length) for s in samples]

        rewards = [s.scalar_reward for s in samples]
        n_tok = sum(s.response_length for s in samples)
        store.metrics(step, {
            "rollout/reward_mean": sum(rewards) / len(rewards),
            "eval/greedy_accuracy": min(1.0, 0.2 + 0.1 * step + rng.uniform(-0.05, 0.05)),
            "loss/total": 1.0 / step + rng.uniform(0, 0.05),
            "policy/kl_ref": 0.01 * step,
            "policy/entropy": 2.0 - 0.1 * step,
            "rollout/tokens_per_s": n_tok / (gen_end - gen_start),
            "rollout/staleness_mean": sum(s.metadata["staleness"] for s in samples) / len(samples),
        })
        for i, e in enumerate(engine_ids):
            store.metrics(step, {
                f"{e}/queue": rng.randrange(0, 8),
                f"{e}/tokens_per_s": 900 + 100 * i + rng.uniform(-50, 50),
                f"{e}/healthy": 0.0 if (i == engines - 1 and step == steps and engines > 1) else 1.0,
            })
        if step_pause_s:
            store.flush()
            time.sleep(step_pause_s)
    if own:
        store.close()
    else:
        store.flush()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m furlong.observe.synthetic", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tokenizer", action="store_true", help="use the tiny model's tokenizer for real token text")
    p.add_argument("--pause", type=float, default=0.0, help="seconds between steps (to watch --follow)")
    a = p.parse_args(argv)
    tok = None
    if a.tokenizer:
        from transformers import AutoTokenizer

        from furlong.models import create_model

        tok = AutoTokenizer.from_pretrained(create_model("qwen3", "tiny"))
    w = write_synthetic_run(a.run_dir, steps=a.steps, tokenizer=tok, step_pause_s=a.pause)
    print(f"wrote {len(w['steps'])} steps, {w['spans']} spans, {sum(map(len, w['samples'].values()))} samples to {a.run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
