"""Run one Harbor trial and print its outcome as one JSON line; runs in the harbor connector's environment.

Request (stdin, JSON):
    task_dir      a local Harbor task directory (task.toml, instruction.md, tests/)
    base_url      the OpenAI-compatible endpoint the agent's model calls go to
    model         the LiteLLM model name, "openai/<name>" for an OpenAI-compatible server
                  (both left out for agents without a model: "oracle" runs the task's solution)
    agent         a Harbor agent name (default "terminus-2")
    agent_kwargs  options for that agent (Terminus 2: max_turns, temperature, parser_name, ...)
    trials_dir    where Harbor writes the trial directory (config, logs, verifier output)
    environment   "furlong-local" (default: harbor_local_env.LocalEnvironment, no Docker)
                  or any Harbor environment type ("docker", ...) or import path
    timeout_s     the agent's time limit (overrides the task's agent.timeout_sec when set)

Reply (stdout, last line): {"rewards": {...} | null, "trial_dir", "trial_name",
"exception": {"type", "message"} | null, "agent", "harbor_version", "seconds"}, or
{"error": "..."} when the trial could not be set up at all.

The agent's model calls are plain chat completions (no token ids or log-probs are
asked for): the endpoint furlong gives it is a TITO session, which records the exact
tokens itself. A session refuses a turn once the trajectory's token budget is used
up, with OpenAI's `context_length_exceeded` code and wording; LiteLLM reads it as a full
context window, so Harbor ends the agent's run without retries, and the verifier then
scores what the agent left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCAL = "harbor_local_env:LocalEnvironment"


def _load_local_environment() -> None:
    """Make `harbor_local_env` importable by name for Harbor, without putting the other drivers on sys.path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("harbor_local_env", HERE / "harbor_local_env.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["harbor_local_env"] = module
    spec.loader.exec_module(module)


async def run(req: dict) -> dict:
    from importlib.metadata import version

    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
    from harbor.trial.trial import Trial

    _load_local_environment()
    env = req.get("environment") or "furlong-local"
    environment = (
        EnvironmentConfig(import_path=LOCAL)
        if env == "furlong-local"
        else EnvironmentConfig(import_path=env)
        if ":" in env
        else EnvironmentConfig(type=env)
    )
    agent = AgentConfig(
        name=req.get("agent") or "terminus-2",
        model_name=req.get("model"),
        base_url=req.get("base_url"),
        kwargs=dict(req.get("agent_kwargs") or {}),
        override_timeout_sec=req.get("timeout_s"),
    )
    config = TrialConfig(
        task=TaskConfig(path=Path(req["task_dir"])),
        trials_dir=Path(req["trials_dir"]),
        agent=agent,
        environment=environment,
    )
    start = time.monotonic()
    trial = await Trial.create(config)
    result = await trial.run()
    info = result.exception_info
    return {
        "rewards": dict(result.verifier_result.rewards or {}) if result.verifier_result else None,
        "trial_dir": str(Path(req["trials_dir"]) / result.trial_name),
        "trial_name": result.trial_name,
        "exception": {"type": info.exception_type, "message": info.exception_message[-2000:]} if info else None,
        "agent": {"name": result.agent_info.name, "version": result.agent_info.version},
        "harbor_version": version("harbor"),
        "seconds": round(time.monotonic() - start, 2),
    }


async def _cancel_on_sigterm(coro) -> dict:  # noqa: ANN001
    """Run `coro`; SIGTERM cancels it, so the trial stops its environment (Harbor's finally) before exiting."""
    task = asyncio.ensure_future(coro)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def main() -> int:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # sibling drivers must not shadow packages
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("OPENAI_API_KEY", "furlong")  # the local endpoint needs none; LiteLLM wants one set
    try:
        req = json.loads(sys.stdin.read())
        for key in ("task_dir", "trials_dir"):
            if not req.get(key):
                raise ValueError(f"request has no {key!r}")
        reply = asyncio.run(_cancel_on_sigterm(run(req)))
    except Exception as e:  # noqa: BLE001 - reported to furlong as the driver's error
        traceback.print_exc(file=sys.stderr)
        reply = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
