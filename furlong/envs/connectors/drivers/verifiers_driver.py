"""Verifiers driver: runs in the verifiers virtual environment (standard library + verifiers only).

furlong never imports verifiers; it runs this script with the environment's Python.

    {"op": "list", "env": ENV, "limit": N|null}
        -> {"tasks": [{"idx", "key", "id", "name", "messages"}], "taskset", "env_class", "version"}
    {"op": "episode", "env": ENV, "limit": N|null, "idx": I, "key": K, "base_url": URL,
     "model": "furlong", "sampling": {...}}
        -> {"reward", "rewards", "metrics", "ok", "truncated", "scored", "stop", "turns",
            "replies", "errors", "seconds"}

Without arguments it answers one `list` request from stdin with one JSON line on stdout
(`venvs.run_driver`). With `--serve` it stays up and answers JSON lines, each request
and reply carrying an `id`, running episodes concurrently (`{"op": "cancel", "id": I}`
cancels one); it exits when stdin closes, i.e. when furlong's process goes away. Each distinct ENV (a verifiers
env config: taskset, agent harness and runtime, ...) is loaded once and kept serving
(its interception server up), so an episode costs only its own work.

An episode is verifiers' own: `load_environment(ENV).run_slot(task, ctx)` with the
model client pointed at URL (a furlong TITO session). The one thing added: when the
model call was refused because the session's token budget ran out (HTTP 400 on
`max_tokens`), verifiers records a provider error and scores nothing; the driver then
scores the trace with the task's own rubric (`Task.score`) and marks it `truncated`,
so furlong trains on a cut trajectory with the reward its content earns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import traceback
from typing import Any

FIELD = "envs.connector"  # where furlong's user sets what this driver is given


class DriverError(Exception):
    """A failure to report as `{"error": ...}`: a message that names what is wrong."""


def _version() -> str:
    from importlib.metadata import version

    return version("verifiers")


class Loaded:
    """One verifiers env (from its config) and its task list."""

    def __init__(self, config: dict[str, Any], limit: int | None):
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config, taskset_class

        taskset_id = (config.get("taskset") or {}).get("id")
        try:
            taskset_class(taskset_id)
        except Exception as e:  # noqa: BLE001 - any import failure is the taskset name's fault
            raise DriverError(f"{FIELD}.taskset = {taskset_id!r}: {type(e).__name__}: {e}") from None
        try:
            self.env = load_environment(resolve_env_config(config))
        except Exception as e:  # noqa: BLE001 - config validation and taskset construction
            raise DriverError(
                f"{FIELD}: verifiers rejected the env config {json.dumps(config)}: {type(e).__name__}: {e}"
            ) from None
        taskset = self.env.taskset
        if limit is not None:
            taskset = taskset.take(limit)
        elif not taskset.bounded:
            raise DriverError(f"{FIELD}.n_tasks: taskset {taskset_id!r} is infinite; set n_tasks to bound it")
        try:
            self.tasks = list(taskset)
        except Exception as e:  # noqa: BLE001 - the taskset's own load() failed on its config
            raise DriverError(
                f"{FIELD}.taskset_args: taskset {taskset_id!r} failed to load its tasks: {type(e).__name__}: {e}"
            ) from None
        self.taskset_id = taskset_id

    def describe(self) -> dict[str, Any]:
        return {
            "tasks": [_task_row(t) for t in self.tasks],
            "taskset": type(self.env.taskset).__name__,
            "env_class": type(self.env).__name__,
            "version": _version(),
        }

    def task(self, idx: int, key: str | None) -> Any:
        if not 0 <= idx < len(self.tasks):
            raise DriverError(
                f"task idx {idx} is out of range: taskset {self.taskset_id!r} has {len(self.tasks)} tasks"
            )
        task = self.tasks[idx]
        if key is not None and task.key != key:
            raise DriverError(
                f"task {idx} of taskset {self.taskset_id!r} changed since its prompt was listed "
                f"(key {task.key[:12]} != {key[:12]})"
            )
        return task


def _task_row(task: Any) -> dict[str, Any]:
    """A task as furlong lists it: identity, and the opening messages a chat harness sends."""
    from verifiers.v1.dialects.chat import message_to_wire

    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [message_to_wire(m) for m in data.prompt]
    return {"idx": data.idx, "key": task.key, "id": data.id, "name": data.name, "messages": messages}


def _budget_refusal(trace: Any) -> bool:
    """Whether the trace ended because furlong's session refused a turn for its token budget."""
    marks = ("context_length_exceeded", "maximum context length", "token budget")
    return any(any(m in (e.message or "") for m in marks) for e in trace.errors)


async def episode(loaded: Loaded, req: dict[str, Any]) -> dict[str, Any]:
    import verifiers.v1 as vf
    from verifiers.v1.env import RunSlot

    task = loaded.task(int(req["idx"]), req.get("key"))
    client = vf.EvalClientConfig(base_url=req["base_url"], api_key_var="FURLONG_VERIFIERS_API_KEY")
    ctx = vf.ModelContext(
        client=client, model=req.get("model") or "furlong", sampling=vf.SamplingConfig(**(req.get("sampling") or {}))
    )
    result = await loaded.env.run_slot(RunSlot(task), ctx)
    traces = list(result.traces)
    truncated = False
    for trace in traces:
        if _budget_refusal(trace):
            if not trace.rewards:
                await task.score(trace)  # the task's own rubric, on what the trace holds
            truncated = True
    rewards = {
        name: {"score": r.score, "weight": r.weight} for t in traces for name, r in t.rewards.items() if r is not None
    }
    errors = [f"{e.type}: {e.message}" for e in result.errors] + [
        f"{e.type}: {e.message}" for t in traces for e in t.errors
    ]
    return {
        "reward": sum(t.reward for t in traces),
        "rewards": rewards,
        "metrics": {k: v for t in traces for k, v in t.metrics.items()},
        "ok": bool(result.ok),
        "truncated": truncated,
        "scored": bool(rewards),
        "stop": [t.stop_condition for t in traces],
        "turns": sum(t.num_turns for t in traces),
        "replies": [m.content or "" for t in traces for m in t.assistant_messages],
        "errors": errors,
        "seconds": {
            k: round(sum(_duration(t.timing, k) for t in traces), 3)
            for k in ("setup", "agent", "model", "harness", "scoring")
        },
    }


def _duration(timing: Any, stage: str) -> float:
    """Seconds a trace spent in a stage (`model` and `harness` are the two parts of `agent`)."""
    span = getattr(timing.agent, stage) if stage in ("model", "harness") else getattr(timing, stage)
    return float(span.duration)


def _reply_for(e: BaseException) -> dict[str, Any]:
    if isinstance(e, DriverError):
        return {"error": str(e)}
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def once(req: dict[str, Any]) -> dict[str, Any]:
    if req.get("op") != "list":
        raise DriverError(f"op {req.get('op')!r}: a single request may only be 'list'; episodes run with --serve")
    return Loaded(req["env"], req.get("limit")).describe()


async def serve(out: Any) -> None:
    """JSON lines in, JSON lines out, until stdin closes; see the module docstring."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    envs: dict[str, Loaded] = {}
    running: dict[Any, asyncio.Task] = {}
    stack = contextlib.AsyncExitStack()
    lock = asyncio.Lock()

    def send(reply: dict[str, Any]) -> None:
        out.write(json.dumps(reply) + "\n")
        out.flush()

    async def handle(req: dict[str, Any]) -> None:
        rid = req.get("id")
        try:
            if req.get("op") not in ("list", "episode"):
                raise DriverError(f"unknown op {req.get('op')!r} (list | episode | cancel)")
            key = json.dumps([req["env"], req.get("limit")], sort_keys=True)
            async with lock:  # one load (and one interception server) per distinct env
                if key not in envs:
                    loaded = Loaded(req["env"], req.get("limit"))
                    await stack.enter_async_context(loaded.env.serving())
                    envs[key] = loaded
            loaded = envs[key]
            send({"id": rid, **(loaded.describe() if req["op"] == "list" else await episode(loaded, req))})
        except asyncio.CancelledError:
            send({"id": rid, "error": "cancelled"})
        except Exception as e:  # noqa: BLE001 - every failure goes back to its caller
            send({"id": rid, **_reply_for(e)})
        finally:
            running.pop(rid, None)

    try:
        while line := await reader.readline():
            req = json.loads(line)
            if req.get("op") == "cancel":
                if (t := running.get(req.get("id"))) is not None:
                    t.cancel()
                continue
            running[req.get("id")] = asyncio.create_task(handle(req))
    finally:
        for t in list(running.values()):
            t.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        await stack.aclose()


def main() -> int:
    # Replies own the real stdout; anything else that prints (verifiers, its programs) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if "--serve" in sys.argv[1:]:
        asyncio.run(serve(out))
        return 0
    try:
        reply = once(json.loads(sys.stdin.read()))
    except Exception as e:  # noqa: BLE001 - reported as the reply
        reply = _reply_for(e)
    out.write(json.dumps(reply) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
