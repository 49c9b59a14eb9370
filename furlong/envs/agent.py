"""The `rollout.agent_fn` glue: a black-box agent's episode on a TITO session becomes the rollout's Sample.

With `rollout.agent_fn: pkg.module:agent` set (and no `rollout.generate_fn`), the
composition root (`driver/build.py`) hands the rollout manager `generate` below as its
generate function (the manager, a floor below envs, never imports it):

    open a session on this process's session server (started once, in a thread,
        against the URL the manager's EngineClient uses: the router or one engine)
    await agent(sample, base_url)          # any harness; it only speaks the OpenAI API
        (or agent(sample, base_url, envs): a third parameter gets the `envs` section)
    close the session; its Sample -> the rollout's sample (exact engine ids,
        log-probs, weight versions, loss mask 0 on template and tool tokens)
    reward: what the agent returned, else the environment's reward

The session carries the rollout's sampling settings (temperature, top_p, top_k, stop
and a per-turn seed) as defaults for whatever the agent's request leaves out, and the
rollout's `max_new_tokens` as a budget for the whole trajectory, so a black-box
agent samples like the built-in generate functions and every sample fits the
trainer's sequence budget. A turn refused for the budget makes the agent's client
raise; the episode then ends `truncated` with what was recorded.

The agent cannot be resumed mid-episode (its state is its own), so a sample that
comes back for another try — aborted at a weight sync, or retried after an error —
starts again from its prompt. An agent that branched (sent an earlier history again)
leaves several trajectories; the one its last turn extended is trained, and
`metadata["agent_trajectories"]` counts them all.

Reward: a float or dict the agent returns is the reward, unless `rollout.reward_fn`
or `rollout.group_reward_fn` is set (then it is kept as `metadata["agent_reward"]`
and those score the sample); when the agent returns None and an `envs` environment
is configured, its `reward()` scores the episode; otherwise the manager's default
(the synthetic task's rule on `metadata["response_text"]`, the final reply) does.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import threading
from typing import TYPE_CHECKING, Any

import httpx

from furlong.core.net import tls_context
from furlong.core.sample import Sample, Status
from furlong.envs.session_server import ServerThread, SessionServer
from furlong.rollout.generate import RolloutContext, reset_response
from furlong.rollout.rewards import call, check_reward

if TYPE_CHECKING:
    from furlong.config.schema import RolloutConfig

SAMPLING = ("temperature", "top_p", "top_k", "stop", "seed")
_servers: dict[str, ServerThread] = {}
_lock = threading.Lock()


def session_server(engine_url: str, tokenizer: Any = None) -> ServerThread:
    """This process's session server for `engine_url`, started on first use and stopped at exit.

    It gets its own tokenizer (loaded from the same directory) because it runs in
    another thread, and a fast tokenizer is not safe to share between threads.
    """
    with _lock:
        server = _servers.get(engine_url)
        if server is None:
            path = getattr(tokenizer, "name_or_path", None)
            own = None
            if path and os.path.isdir(path):
                from furlong.models import load_tokenizer

                own = load_tokenizer(path)
            server = _servers[engine_url] = ServerThread(SessionServer(engine_url, own)).__enter__()
            atexit.register(server.__exit__)
        return server


def _agent(rollout: RolloutConfig) -> Any:
    spec = getattr(rollout, "agent_fn", None)
    if spec is None:
        raise ValueError("agent.generate: rollout.agent_fn is not set (the agent to run on each sample)")
    if callable(spec):
        return spec
    from furlong.config.registry import load_plugin

    return load_plugin("rollout.agent_fn", spec)


def _wants_config(agent: Any) -> bool:
    """An agent with a third parameter gets the `envs` config section (connectors read `envs.connector`)."""
    import inspect

    try:
        params = [
            p
            for p in inspect.signature(agent).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _final_reply(messages: list[dict[str, Any]]) -> tuple[str, int]:
    """(the last assistant reply's text, tool calls made) from a session's recorded messages."""
    replies = [m for m in messages if m.get("role") == "assistant"]
    calls = sum(len(m.get("tool_calls") or []) for m in replies)
    return (str(replies[-1].get("content") or "") if replies else ""), calls


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Run `rollout.agent_fn` on one sample through a TITO session; see the module docstring."""
    from furlong.envs.multiturn import _sections

    sections = _sections(ctx)
    rollout: RolloutConfig = sections[0]  # typed, so tools.schema_readers sees the reads of `rollout.*` below
    envs = sections[1]
    agent = _agent(rollout)
    sample.metadata["max_turns"] = int(getattr(rollout, "max_turns", 1) or 1)  # a hint agents may follow
    if sample.response_length or Status(sample.status) != Status.PENDING:
        reset_response(sample)  # an agent cannot resume mid-episode: start again
    server = session_server(ctx.client.url, ctx.tokenizer)
    defaults = {k: sampling_params[k] for k in SAMPLING if sampling_params.get(k) is not None}
    body = {
        "label": sample.label,
        "sampling": defaults,
        "max_new_tokens": int(sampling_params["max_new_tokens"]),
        "metadata": {k: sample.metadata[k] for k in ("prompt_index", "sample_index", "seq") if k in sample.metadata},
    }
    async with httpx.AsyncClient(
        base_url=server.url, timeout=httpx.Timeout(None, connect=10.0), verify=tls_context()
    ) as http:
        resp = await http.post("/sessions", json=body)
        resp.raise_for_status()
        sid = resp.json()["id"]
        error: Exception | None = None
        try:
            args = (sample, server.session_url(sid)) + ((envs,) if _wants_config(agent) else ())
            result = await call(agent, *args)
        except Exception as e:  # noqa: BLE001 - decided below, once the session's record is known
            result, error = None, e
        finally:  # also on cancellation: a session never outlives its sample
            closed = await asyncio.shield(http.delete(f"/sessions/{sid}"))
    recorded = [Sample.from_dict(d) for d in closed.json()["samples"]]
    exhausted = any(s.metadata.get("budget_exhausted") for s in recorded)
    if error is not None and not (exhausted and recorded):
        raise RuntimeError(f"agent {getattr(rollout, 'agent_fn', agent)}: {type(error).__name__}: {error}") from error
    if not recorded:
        raise RuntimeError(f"agent {getattr(rollout, 'agent_fn', agent)} made no model call on its session")
    out = max(recorded, key=lambda s: s.metadata.get("last_turn", 0))
    text, calls = _final_reply(out.metadata.get("messages", []))
    out.index, out.group_index, out.label = sample.index, sample.group_index, sample.label
    out.metadata = {
        **sample.metadata,
        **out.metadata,
        "response_text": text,
        "tool_calls": calls,
        "agent_trajectories": len(recorded),
    }
    if exhausted and Status(out.status) == Status.COMPLETED:
        out.status, out.status_reason = Status.TRUNCATED, "token budget used up"
    if Status(out.status) not in (Status.COMPLETED, Status.TRUNCATED):
        return out  # aborted: the manager tries again (from the prompt)
    if getattr(rollout, "reward_fn", None) or getattr(rollout, "group_reward_fn", None):
        if result is not None:
            out.metadata["agent_reward"] = result
        return out
    try:
        if result is not None:
            out.reward = check_reward(result)
        elif envs is not None and (getattr(envs, "name", None) or getattr(envs, "environment", None)):
            from furlong.envs.protocol import build_environment

            out.reward = check_reward(await build_environment(envs, out).reward(out))
    except Exception as e:  # noqa: BLE001 - a broken reward fails this sample, not the run
        out.status, out.status_reason = Status.FAILED, f"agent reward: {type(e).__name__}: {e}"
        out.metadata["reward_error"] = True
    return out


async def tool_agent(sample: Sample, base_url: str) -> None:
    """A plain OpenAI-API tool-use agent: the built-in `rollout.agent_fn`, and what the calculator recipe runs.

    It sends the prompt's messages with the tools in `metadata["tools"]`, runs the
    calls the model makes with the tools furlong knows (`protocol.TOOLS`; others get
    an error result), sends the results back, and stops at the first reply without a
    call or after `metadata["max_turns"]` replies (the rollout's `max_turns`). It
    returns None: the environment (or the task's rule) scores the episode. Only HTTP
    and the OpenAI chat format are used, as by any external harness.
    """
    from furlong.core.plugins import import_path
    from furlong.core.tool_calls import ToolCall
    from furlong.envs.protocol import TOOLS
    from furlong.envs.tools import execute_all

    messages = list(sample.prompt) if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}]
    tools = sample.metadata.get("tools") or None
    names = [t.get("function", t).get("name") for t in tools or []]
    fns = {n: import_path(TOOLS[n], "envs.tools") for n in names if n in TOOLS}
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"), timeout=httpx.Timeout(None, connect=10.0), verify=tls_context()
    ) as http:
        for _turn in range(int(sample.metadata.get("max_turns", 3))):
            resp = await http.post("/chat/completions", json={"model": "furlong", "messages": messages, "tools": tools})
            resp.raise_for_status()
            message = resp.json()["choices"][0]["message"]
            messages.append(message)
            calls = [
                ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"), c["id"])
                for c in message.get("tool_calls") or []
            ]
            if not calls:
                break
            messages += await execute_all(calls, fns, timeout_s=10.0)
