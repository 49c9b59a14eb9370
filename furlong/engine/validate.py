"""Engine-side checks of a request against the loaded model: context room, vocabulary, KV budget.

The request models themselves live in `furlong.core.api` (the contract every client
and server shares); these checks need the engine's model limits, so they live here.
"""

from __future__ import annotations

from furlong.core.api import BadRequest, SamplingParamsIn
from furlong.engine.sampler import SamplingParams


def to_sampling(p: SamplingParamsIn | None, *, prompt_len: int, max_context: int, default_max: int) -> SamplingParams:
    p = p or SamplingParamsIn()
    room = max_context - prompt_len
    if p.max_new_tokens is not None and p.max_new_tokens > room:
        raise BadRequest(
            "sampling_params.max_new_tokens",
            f"{p.max_new_tokens} exceeds the {room} tokens left in the {max_context}-token context",
        )
    seed = p.seed if p.seed is not None else p.sampling_seed
    return SamplingParams(
        max_new_tokens=p.max_new_tokens if p.max_new_tokens is not None else min(default_max, room),
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        stop=p.stop or [],
        stop_token_ids=p.stop_token_ids or [],
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
        no_stop_trim=p.no_stop_trim,
        seed=seed,
    )


def check_prompt(ids: list[int], field: str, *, vocab: int, max_context: int, kv_tokens: int) -> None:
    if not ids:
        raise BadRequest(field, "prompt is empty")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(field, f"token id {bad} is outside the vocabulary [0, {vocab})")
    if len(ids) >= max_context:
        raise BadRequest(field, f"prompt has {len(ids)} tokens; the context holds {max_context}")
    if len(ids) + 1 > kv_tokens:
        raise BadRequest(field, f"prompt has {len(ids)} tokens; the KV cache holds {kv_tokens} (raise --kv-cache-mb)")


def check_stop_ids(ids: list[int] | None, field: str, vocab: int) -> None:
    bad = next((t for t in ids or [] if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(field, f"token id {bad} is outside the vocabulary [0, {vocab})")
