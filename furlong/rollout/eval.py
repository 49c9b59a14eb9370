"""Evaluation on held-out prompts: pass@k from n samples, and greedy accuracy.

pass@k uses the unbiased estimator of Chen et al. (2021): with n samples of which c
are correct, pass@k = 1 - C(n-c, k) / C(n, k) — the chance that k of the n samples,
drawn without replacement, hold at least one correct answer. Averaging it over
prompts has far less variance than drawing exactly k samples per prompt. It is
reported for k = 1, 2, 4, ... up to n (and n itself).

Greedy accuracy is one temperature-0 sample per prompt: the number a user quotes.
A sample is correct when its score reaches `correct_threshold` (1.0: the synthetic
tasks score 1 or 0). A reward that raises counts the sample wrong, and is counted.
Eval seeds are fixed per (seed, prompt index, sample index), so two evals of the
same weights agree and differences between steps come from the weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from math import comb
from typing import Any

from furlong.core.sample import Sample, Status
from furlong.rollout.generate import RolloutContext, derive_seed
from furlong.rollout.rewards import SCORABLE, score_sample

MAX_ATTEMPTS = 3


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def k_values(n: int) -> list[int]:
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks + ([n] if ks[-1] != n else [])


async def _one(
    ctx: RolloutContext,
    generate_fn: Callable[..., Any],
    reward_fn: Callable[..., Any],
    sample: Sample,
    params: dict[str, Any],
) -> Sample:
    """Generate (resuming after an abort, retrying an engine error) and score one eval sample."""
    for _attempt in range(MAX_ATTEMPTS):
        try:
            sample = await generate_fn(ctx, sample, params)
        except Exception as e:  # noqa: BLE001
            sample.status, sample.status_reason = Status.FAILED, f"{type(e).__name__}: {e}"
            continue
        if Status(sample.status) in SCORABLE:
            await score_sample(sample, reward_fn)
            return sample
    sample.status = Status.FAILED
    return sample


async def evaluate(
    ctx: RolloutContext,
    prompts: list[tuple[Any, list[int]]],
    *,
    n_samples: int,
    sampling_params: dict[str, Any],
    reward_fn: Callable[..., Any],
    generate_fn: Callable[..., Any],
    seed: int = 0,
    greedy: bool = True,
    correct_threshold: float = 1.0,
) -> dict[str, float]:
    """Metrics `eval/...` for `prompts` given as (Prompt, prompt ids) pairs."""
    if not prompts:
        raise ValueError("evaluate: no held-out prompts")
    jobs, sampled, greedy_samples = [], [], []
    for i, (p, ids) in enumerate(prompts):
        row = []
        for j in range(n_samples):
            s = Sample(
                index=i * n_samples + j,
                group_index=i,
                prompt=p.prompt,
                tokens=list(ids),
                label=p.label,
                metadata=dict(p.metadata or {}),
            )
            jobs.append(
                _one(ctx, generate_fn, reward_fn, s, {**sampling_params, "seed": derive_seed("eval", seed, p.index, j)})
            )
            row.append(len(jobs) - 1)
        sampled.append(row)
        if greedy:
            s = Sample(
                index=i,
                group_index=i,
                prompt=p.prompt,
                tokens=list(ids),
                label=p.label,
                metadata=dict(p.metadata or {}),
            )
            jobs.append(_one(ctx, generate_fn, reward_fn, s, {**sampling_params, "temperature": 0.0, "seed": 0}))
            greedy_samples.append(len(jobs) - 1)
    done = await asyncio.gather(*jobs)

    def correct(s: Sample) -> bool:
        return s.reward is not None and s.scalar_reward >= correct_threshold

    metrics: dict[str, float] = {"eval/n_prompts": float(len(prompts)), "eval/n_samples": float(n_samples)}
    counts = [sum(correct(done[j]) for j in row) for row in sampled]
    for k in k_values(n_samples):
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(n_samples, c, k) for c in counts) / len(counts)
    scored = [done[j] for row in sampled for j in row if done[j].reward is not None]
    metrics["eval/mean_reward"] = sum(s.scalar_reward for s in scored) / len(scored) if scored else 0.0
    metrics["eval/mean_response_length"] = sum(done[j].response_length for row in sampled for j in row) / (
        len(prompts) * n_samples
    )
    metrics["eval/failed"] = float(sum(Status(s.status) == Status.FAILED for s in done))
    if greedy:
        metrics["eval/greedy_accuracy"] = sum(correct(done[j]) for j in greedy_samples) / len(greedy_samples)
    return metrics
