"""The multi-turn generate function: model turns, tool calls and environment feedback in one Sample.

Plug it in with `rollout.generate_fn: furlong.envs.multiturn:generate` (same signature
as the default single-turn `furlong.rollout.generate:generate`). One episode:

    prompt ids (from the manager)  [+ env.reset messages, before any output]
    repeat:  model turn     -> policy tokens: exact engine ids, log-probs, weight version per token
             env.step(text) -> tool / env messages, or done
             glue + messages + generation prompt -> loss mask 0, source tool | env | template
    until done, `rollout.max_turns` model turns, the token budget, or a length cut

Nothing the model produced is ever decoded and re-encoded into the Sample: decoding
happens only to *read* tool calls; the appended tokens are only the template's glue
and the new messages, tokenised as a suffix (`chat.suffix_ids`).

Budget: `max_new_tokens` bounds the whole response (model turns and appended
messages together), so every sample fits the trainer's sequence budget. Observations
that would not fit end the episode as `truncated`.

Resume: the episode's progress lives in `sample.metadata["multiturn"]`, so a sample
aborted mid-turn at a weight sync continues from its tokens so far (the turn's tokens
keep their versions), and a call cancelled while tools ran re-runs that step.

Reward: when neither `rollout.reward_fn` nor `rollout.group_reward_fn` is set, the
environment's `reward()` scores the finished episode here (the manager then keeps
it); otherwise those plug points score it as usual. `metadata["response_text"]` holds
the *final* model turn only, so a task rule never reads a tool's output as the answer.

Environment and tools come from the `envs` config section when the driver offers it
(`ctx.envs`, or `ctx.config.envs` when `ctx.config` is the whole config), else from the
sample's metadata (`env`, `task`, `tools`) — see `protocol.build_environment`.
"""

from __future__ import annotations

import inspect
import uuid
from typing import Any

from furlong.core import spans
from furlong.core.sample import Sample, Status
from furlong.data.chat import append_runs, encode_prompt, suffix_ids
from furlong.envs.protocol import build_environment
from furlong.rollout.generate import RolloutContext, apply_response, derive_seed
from furlong.rollout.rewards import check_reward


def _sections(ctx: RolloutContext) -> tuple[Any, Any]:
    """(rollout section, envs section or None) from whatever config the context carries."""
    cfg = ctx.config
    rollout = getattr(cfg, "rollout", cfg)
    envs = getattr(ctx, "envs", None) or getattr(cfg, "envs", None)
    return rollout, envs


def _accepts_routing_key(client: Any) -> bool:
    try:
        return "routing_key" in inspect.signature(client.generate).parameters
    except (TypeError, ValueError):
        return False


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Run (or resume) one multi-turn episode; see the module docstring."""
    tok = ctx.tokenizer
    if tok is None:
        raise ValueError("multiturn.generate: needs the tokenizer (RolloutContext.tokenizer)")
    rollout, envs = _sections(ctx)
    max_turns = int(getattr(rollout, "max_turns", 1) or 1)
    budget = int(sampling_params["max_new_tokens"])
    tools = sample.metadata.get("tools")
    env = build_environment(envs, sample)
    state = sample.metadata.get("multiturn")
    if sample.response_length == 0 or state is None:  # a fresh start (or a restart after reset_response)
        state = sample.metadata["multiturn"] = {
            "turns": 0,
            "turn_start": None,
            "stepping": False,
            "reset": bool((state or {}).get("reset")),
        }
        sample.metadata["messages"] = []
        if not state["reset"]:
            extra = await env.reset(sample)
            if extra:
                if not isinstance(sample.prompt, list):
                    raise ValueError(
                        "multiturn.generate: env.reset returned messages but the prompt is text, not messages"
                    )
                sample.tokens = encode_prompt(tok, list(sample.prompt) + extra, tools)
                sample.prompt = list(sample.prompt) + extra
            state["reset"] = True
    routing = {}
    if _accepts_routing_key(ctx.client):  # keep every turn on one engine: its prefix cache holds the episode
        routing["routing_key"] = sample.metadata.setdefault("routing_key", uuid.uuid4().hex)

    while True:
        if not state["stepping"]:
            if state["turn_start"] is None:
                state["turn_start"] = sample.response_length
            remaining = budget - sample.response_length
            if remaining <= 0:
                return await _finish(env, rollout, sample, Status.TRUNCATED, "token budget used up")
            params = {**sampling_params, "max_new_tokens": remaining}
            if "seed" in params and params["seed"] is not None and state["turns"]:
                params["seed"] = derive_seed(params["seed"], state["turns"], sample.response_length)
            out = await ctx.client.generate(sample.tokens, params, **routing)
            apply_response(sample, out)
            text = _turn_text(tok, sample, state["turn_start"], skip_special=True)
            sample.metadata["response_text"] = text
            if Status(sample.status) == Status.ABORTED:  # resumed later from the tokens so far
                return sample
            sample.metadata["messages"].append({"role": "assistant", "content": text})
            state["turns"] += 1
            if Status(sample.status) != Status.COMPLETED:
                return await _finish(env, rollout, sample, Status(sample.status), "length cut")
            sample.status, state["stepping"] = Status.PENDING, True  # no await since apply_response
        action = _turn_text(tok, sample, state["turn_start"], skip_special=False)
        with spans.span("env", "env-step", sample=sample.index, group=sample.group_index, turn=state["turns"]):
            messages, done = await env.step(sample, action)
        if done:
            return await _finish(env, rollout, sample, Status.COMPLETED, "")
        if state["turns"] >= max_turns:
            return await _finish(env, rollout, sample, Status.TRUNCATED, f"turn limit ({max_turns}) reached")
        ids, sources = suffix_ids(tok, messages, tools=tools, after_output=action)
        if sample.response_length + len(ids) >= budget:
            return await _finish(env, rollout, sample, Status.TRUNCATED, "no token budget left after the observation")
        append_runs(sample, ids, sources)
        sample.metadata["messages"].extend(messages)
        state["stepping"], state["turn_start"] = False, None


def _turn_text(tok: Any, sample: Sample, turn_start: int, *, skip_special: bool) -> str:
    return tok.decode(sample.response_tokens[turn_start:], skip_special_tokens=skip_special)


async def _finish(env: Any, rollout: Any, sample: Sample, status: Status, reason: str) -> Sample:
    """End the episode; score it with the environment unless a reward plug point will."""
    sample.status, sample.status_reason = status, reason
    sample.metadata["multiturn"]["stepping"] = False
    if getattr(rollout, "reward_fn", None) or getattr(rollout, "group_reward_fn", None):
        return sample
    try:
        sample.reward = check_reward(await env.reward(sample))
    except Exception as e:  # noqa: BLE001 - a broken reward fails this sample, not the run
        sample.status, sample.status_reason = Status.FAILED, f"environment reward: {type(e).__name__}: {e}"
        sample.metadata["reward_error"] = True
    return sample
