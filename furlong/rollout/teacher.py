"""On-policy distillation's teacher: score each student sample with the teacher's log-probs.

The student samples (the ordinary rollout); a teacher engine then reads every sample's
tokens as a *prompt* (`max_new_tokens=1`, `return_logprob`, `logprob_start_len` = the
sample's prompt length) and returns log pi_T(y_t | y_<t) for each sampled token. That is
one prefill per sample and no real decoding: the cheap half of distillation (Thinking Machines,
"On-Policy Distillation", 2025; slime's OPD scores with the teacher's SGLang server the
same way). The log-probs land in `Sample.teacher_logprobs`, which the trainer hands to the
loss hub (`train/losses/distill.py`) as a constant: no gradient flows through the teacher.

The engine's prompt log-probs are taken at temperature 1; the student's training log-probs
are taken at the rollout temperature, so a distillation run samples at temperature 1.
"""

from __future__ import annotations

import asyncio
from typing import Any

from furlong.core.sample import Sample

# One new token, not zero: the engine answers a zero-token request before any prefill, so with no prompt log-probs.
SCORE_PARAMS = {"max_new_tokens": 1, "temperature": 1.0}


async def score_sample(client: Any, sample: Sample) -> list[float]:
    """The teacher's log-prob of every response token of `sample` (prompt tokens are context only)."""
    start = sample.prompt_length
    if sample.response_length == 0:
        return []
    out = await client.generate(list(sample.tokens), dict(SCORE_PARAMS), logprob_start_len=start)
    rows = out["meta_info"].get("input_token_logprobs")
    if rows is None or len(rows) != sample.response_length:
        got = "none" if rows is None else len(rows)
        raise RuntimeError(
            f"sample {sample.index}: the teacher returned {got} prompt log-probs for {sample.response_length} tokens"
        )
    for (_, tok, _), want in zip(rows, sample.tokens[start:]):
        if tok != want:
            raise RuntimeError(f"sample {sample.index}: the teacher scored token {tok}, the student sampled {want}")
    return [float(lp) for lp, _, _ in rows]


async def score_batch(client: Any, samples: list[Sample]) -> dict[str, float]:
    """Fill `teacher_logprobs` on every sample (concurrently); metrics of the teacher's view of the batch.

    `teacher/logprob_mean`: the mean teacher log-prob of the sampled response tokens (trained tokens only);
    it climbs as the student learns to say what the teacher would."""
    scored = await asyncio.gather(*(score_sample(client, s) for s in samples))
    total = n = 0.0
    for s, lps in zip(samples, scored):
        s.teacher_logprobs = lps
        mask = s.loss_mask or [1] * len(lps)
        total += sum(lp for lp, m in zip(lps, mask) if m)
        n += sum(1 for m in mask if m)
    return {"teacher/logprob_mean": total / max(n, 1.0), "teacher/scored_samples": float(len(samples))}
