"""The default generate function: one single-turn request that extends a Sample.

A generate function (the `rollout.generate_fn` plug point) has the signature

    async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict) -> Sample

and must leave `sample` with its status set (completed | truncated | aborted; it may
raise, and the manager marks the sample failed with the error). The default sends
`sample.tokens` — the prompt plus any response tokens produced so far — as
`input_ids`, so the same function starts a sample and resumes a partial rollout:
a resumed sample keeps the log-probs and weight versions of its earlier tokens,
and the new tokens carry the versions the engine stamped on them. The token budget
is `max_new_tokens` for the whole response, not per request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING, Any

from furlong.core.client import EngineClient, EngineError
from furlong.core.sample import Sample, Source, Status, encode_routes

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig, RolloutConfig

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class RolloutContext:
    """What a generate function may use: the engine client, the tokenizer (or None), the rollout
    config, and the `envs` config section (tools, environment, sandbox) for agentic generate functions."""

    client: EngineClient
    tokenizer: Any = None
    config: RolloutConfig | None = None
    envs: EnvsConfig | None = None


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any parts: the same parts give the same seed in every process.

    Seeds come from what a sample *is* (prompt, place in the stream, sample index),
    never from when it ran, so any generation order yields the same samples.
    """
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**31 - 1)


def sampling_params(config: RolloutConfig) -> dict[str, Any]:
    """The `/generate` sampling parameters the `rollout` section sets (the stop strings only when some are)."""
    c = config
    params: dict[str, Any] = {
        "temperature": c.temperature,
        "top_p": c.top_p,
        "top_k": c.top_k,
        "max_new_tokens": c.max_new_tokens,
    }
    return params | ({"stop": list(c.stop)} if c.stop else {})


def reset_response(sample: Sample) -> Sample:
    """Drop every response token (and its per-token data) so the sample starts again from its prompt."""
    p = sample.prompt_length
    del sample.tokens[p:]
    sample.response_length = 0
    for per_token in (sample.loss_mask, sample.rollout_logprobs, sample.token_versions, sample.token_sources):
        per_token.clear()
    sample.reward, sample.routed_experts = None, None
    sample.status = Status.PENDING
    sample.status_reason = ""
    sample.metadata.pop("response_text", None)
    return sample


def apply_response(sample: Sample, out: dict[str, Any], tokenizer: Any = None) -> Sample:
    """Append one `/generate` response to `sample`: ids, log-probs, per-token versions, status."""
    meta = out.get("meta_info") or {}
    ids = [int(t) for t in out.get("output_ids", [])]
    triples = meta.get("output_token_logprobs") or []
    if len(triples) != len(ids):
        raise EngineError(f"/generate returned {len(ids)} output_ids but {len(triples)} output_token_logprobs")
    logprobs = [float(t[0]) for t in triples]
    versions = meta.get("output_token_versions") or [int(meta.get("weight_version", -1))] * len(ids)
    if len(versions) != len(ids):
        raise EngineError(f"/generate returned {len(ids)} output_ids but {len(versions)} output_token_versions")
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in FINISH_STATUS:
        raise EngineError(f"/generate returned unknown finish_reason {meta.get('finish_reason')!r}")
    start = 0
    for version, run in groupby(versions):  # Sample.append stamps one version per call
        n = len(list(run))
        sample.append(
            ids[start : start + n], source=Source.POLICY, logprobs=logprobs[start : start + n], version=int(version)
        )
        start += n
    routes = meta.get("routed_experts")
    # R3: every position this request forwarded, earlier turns included (an abort before any forward has none)
    if routes is not None and any(r is not None for r in routes):
        if len(routes) != len(sample.tokens) - 1:
            raise EngineError(
                f"/generate returned routed_experts for {len(routes)} positions, not {len(sample.tokens) - 1} "
                "(prompt + output tokens - 1)"
            )
        sample.routed_experts = encode_routes(routes)
    sample.status = FINISH_STATUS[reason]
    sample.status_reason = "" if reason != "abort" else "aborted by the engine"
    if tokenizer is not None:
        sample.metadata["response_text"] = tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
    else:
        sample.metadata["response_text"] = sample.metadata.get("response_text", "") + str(out.get("text", ""))
    return sample


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Single-turn generation, starting or resuming `sample` from the tokens it holds."""
    params = dict(sampling_params)
    remaining = int(params["max_new_tokens"]) - sample.response_length
    if remaining <= 0:
        sample.status = Status.TRUNCATED
        return sample
    params["max_new_tokens"] = remaining
    extra = routes_request(ctx)
    out = await ctx.client.generate(sample.tokens, params, **extra, **adapter_request(sample))
    if extra and "routed_experts" not in (out.get("meta_info") or {}):
        raise EngineError("rollout.routing_replay=true but /generate returned no meta_info.routed_experts")
    return apply_response(sample, out, ctx.tokenizer)


def routes_request(ctx: RolloutContext) -> dict[str, Any]:
    """The `/generate` fields that ask for the MoE routing (R3, `rollout.routing_replay`), for any generate fn.

    The engine then answers with the experts of every position it forwarded, prompt included: the
    trainer's forward covers prompt + response, and a prompt token routed differently changes the
    keys and values every response token attends to.
    """
    return {"return_routed_experts": True} if ctx.config is not None and ctx.config.routing_replay else {}


def adapter_request(sample: Sample) -> dict[str, Any]:
    """The `/generate` field that picks the sample's LoRA adapter (multi-LoRA, `train.lora.adapters`).

    A prompt tagged `metadata["adapter"]` (by `data.mix`, or a file row's field) is generated by that
    adapter, by name (SGLang's `lora_path`); the sample keeps the tag, and the trainer trains that adapter
    on it. Untagged samples name none: the engine serves its policy adapter (or the plain weights).
    """
    adapter = sample.metadata.get("adapter")
    return {"lora_path": str(adapter)} if adapter is not None else {}
