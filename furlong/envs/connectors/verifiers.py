"""Verifiers connector: a verifiers taskset's episodes as furlong rollouts (`rollout.agent_fn`).

Verifiers (the `verifiers` package, `verifiers.v1`) describes an environment as a
*taskset* (tasks with their rubric: `@vf.reward` methods), a *harness* (the agent
program that talks to the model) and a *runtime* (where that program runs). It pins
`openai` and `mcp` versions furlong cannot share, so it lives in its own virtual
environment (`SPEC`, built by `furlong envs setup verifiers` or on first use) and furlong
drives it through a driver process (`drivers/verifiers_driver.py`) in that environment.

    rollout.data_source: furlong.envs.connectors.verifiers:data_source
        the taskset's tasks as furlong prompts (the opening messages the harness sends),
        each carrying `metadata["verifiers"]` = {taskset, idx, key}
    rollout.agent_fn: furlong.envs.connectors.verifiers:agent
        per sample, one verifiers episode of that task (`Env.run_slot`), its model
        client pointed at the sample's TITO session: every model call goes to furlong's
        engine and is recorded token for token; the reward is what the task's rubric
        computed (`score`, plus each named reward beside it)

One driver process stays up and runs every episode of this process (concurrently); it
exits when this process does. Episodes use verifiers' `subprocess` runtime and, unless
set otherwise, its `null` harness (a plain chat loop), so nothing needs Docker or a
network. The null harness's program is a PEP 723 script that verifiers prepares with
`uv` on first use (the `uv` pinned in `SPEC`; its packages come from PyPI once, then
from uv's cache).

Keys of `envs.connector`:

    taskset: ID          required: a verifiers taskset id, i.e. an importable module that
                         exports a `vf.Taskset` (and optionally a `vf.Env`) in `__all__`
    taskset_args: {}     fields of the taskset's config (e.g. num_tasks)
    harness: null        the verifiers harness id of the agent seat
    paths: []            directories put on the driver's PYTHONPATH (where a local taskset lives)
    n_tasks: null        use the first N tasks (required for an infinite taskset)
    sampling: {}         verifiers sampling settings sent with every model call; what they
                         leave out takes the rollout's (temperature, top_p, seed, budget)
    env: {}              further verifiers env config, merged over the above (e.g.
                         {"agent": {"max_turns": 4}})
    timeout_s: 600       seconds for one episode
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from furlong.envs.connectors.venvs import DRIVERS, VenvSpec, driver_env, ensure, run_driver

SPEC = VenvSpec(
    name="verifiers",
    python="3.11",
    requirements=("verifiers==0.4.0", "openai==2.54.0", "mcp==2.0.0", "uv==0.13.8"),
    env={"UV_PYTHON_DOWNLOADS": "never", "HF_HUB_OFFLINE": "1"},
    doc="Verifiers tasksets (verifiers.v1: taskset + harness + runtime), one episode per sample",
)
DRIVER = "verifiers_driver"
FIELD = "envs.connector"


class VerifiersError(RuntimeError):
    """A verifiers episode failed or could not be run; the message says which and why."""


@dataclass(frozen=True)
class Options:
    taskset: str
    taskset_args: dict[str, Any] = field(default_factory=dict)
    harness: str = "null"
    paths: tuple[str, ...] = ()
    n_tasks: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0

    def env_config(self) -> dict[str, Any]:
        """The verifiers env config (`[env]` of a verifiers eval) this connector runs."""
        base = {
            "taskset": {**self.taskset_args, "id": self.taskset},
            "agent": {"harness": {"id": self.harness}, "runtime": {"type": "subprocess"}},
            "timeout": {"episode": self.timeout_s},
        }
        return _merge(base, self.env)

    def driver_env(self) -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join(self.paths)} if self.paths else {}


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def options(envs: Any) -> Options:
    """`envs.connector` (from the `envs` section, a dict, or None) checked; errors name the key."""
    raw = envs.get("connector", envs) if isinstance(envs, dict) else getattr(envs, "connector", None)
    raw = dict(raw or {})
    known = {f.name for f in fields(Options)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{FIELD}: unknown key(s) {unknown} for the verifiers connector; known: {sorted(known)}")
    taskset = raw.get("taskset")
    if not isinstance(taskset, str) or not taskset.strip():
        raise ValueError(
            f"{FIELD}.taskset: required, a verifiers taskset id (an importable module exporting a "
            f"vf.Taskset), got {taskset!r}"
        )
    for key in ("taskset_args", "sampling", "env"):
        if not isinstance(raw.get(key) or {}, dict):
            raise ValueError(f"{FIELD}.{key}: must be a mapping, got {raw[key]!r}")
    paths = raw.get("paths") or []
    if isinstance(paths, str) or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{FIELD}.paths: must be a list of directories, got {paths!r}")
    missing = [p for p in paths if not Path(p).is_dir()]
    if missing:
        raise ValueError(f"{FIELD}.paths: not a directory: {missing}")
    n = raw.get("n_tasks")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{FIELD}.n_tasks: must be a positive integer or null, got {n!r}")
    timeout = raw.get("timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"{FIELD}.timeout_s: must be a positive number of seconds, got {timeout!r}")
    harness = raw.get("harness", "null")
    if not isinstance(harness, str) or not harness:
        raise ValueError(f"{FIELD}.harness: must be a verifiers harness id, got {harness!r}")
    return Options(
        taskset=taskset.strip(),
        taskset_args=dict(raw.get("taskset_args") or {}),
        harness=harness,
        paths=tuple(str(Path(p).resolve()) for p in paths),
        n_tasks=n,
        sampling=dict(raw.get("sampling") or {}),
        env=dict(raw.get("env") or {}),
        timeout_s=float(timeout),
    )


# ---------------------------------------------------------------- tasks -> prompts
def list_tasks(opts: Options) -> dict[str, Any]:
    """The driver's listing of the taskset: tasks (idx, key, id, name, messages), class names, version."""
    return run_driver(
        SPEC,
        DRIVER,
        {"op": "list", "env": opts.env_config(), "limit": opts.n_tasks},
        timeout_s=opts.timeout_s,
        env=opts.driver_env(),
    )


_listed: dict[str, list[Any]] = {}


def prompts(opts: Options) -> list[Any]:
    """The taskset's tasks as furlong `Prompt`s, in taskset order (listed once per process and settings)."""
    key = json.dumps([opts.env_config(), opts.n_tasks, opts.paths], sort_keys=True)
    if key not in _listed:
        _listed[key] = _prompts(opts)
    return list(_listed[key])


def _prompts(opts: Options) -> list[Any]:
    from furlong.data.datasets import Prompt

    listing = list_tasks(opts)
    out = []
    for i, t in enumerate(listing["tasks"]):
        ref = {"taskset": opts.taskset, "idx": t["idx"], "key": t["key"], "id": t.get("id"), "name": t.get("name")}
        prompt = t["messages"] or str(t.get("name") or t.get("id") or f"task {t['idx']}")
        out.append(Prompt(index=i, prompt=prompt, label=t.get("id"), metadata={"verifiers": ref}))
    if not out:
        raise ValueError(f"{FIELD}.taskset: taskset {opts.taskset!r} yielded no tasks")
    return out


def data_source(config: Any = None, seed: int = 0) -> Any:
    """The `rollout.data_source` plug point: the taskset's tasks as a resumable, shuffled DataSource."""
    from furlong.data import DataSource

    envs = getattr(config, "envs", config)
    return DataSource(prompts(options(envs)), seed=seed)


async def evaluate(ctx: Any, prompts_: list[Any], step: int = 0) -> dict[str, float]:
    """The `rollout.eval_fn` plug point: furlong's eval metrics over verifiers episodes.

    The held-out prompts a run's `data` section gives are not verifiers tasks; this
    runs, instead, the first `len(prompts_)` (`data.n_eval`) tasks of the connector's
    taskset through the same agent (one sampled episode each, `rollout.eval_n_samples`
    of them, and one greedy), scored by the taskset's rubric: `eval/mean_reward`,
    `eval/pass@k` and `eval/greedy_accuracy` count a reward of 1 as solved.
    """
    from furlong.data.chat import encode_prompt
    from furlong.envs.agent import generate
    from furlong.rollout.eval import evaluate as furlong_evaluate
    from furlong.rollout.generate import sampling_params

    tasks = prompts(options(ctx.envs))[: max(1, len(prompts_))]
    return await furlong_evaluate(
        ctx,
        [(p, encode_prompt(ctx.tokenizer, p.prompt)) for p in tasks],
        n_samples=getattr(ctx.config, "eval_n_samples", 1),
        sampling_params=sampling_params(ctx.config),
        reward_fn=_agent_reward,
        generate_fn=generate,
        seed=0,
    )


def _agent_reward(sample: Any) -> Any:
    """An eval sample's reward is the one the agent (the verifiers rubric) gave it."""
    reward = sample.reward if sample.reward is not None else sample.metadata.get("agent_reward")
    if reward is None:
        raise ValueError("the verifiers episode returned no reward")
    return reward


# ---------------------------------------------------------------- the episode driver process
class _Worker:
    """A `verifiers_driver.py --serve` process: requests go out as JSON lines, replies come back matched by id.

    A plain subprocess with a reader thread (not an asyncio subprocess), so one driver
    serves every event loop of this process (each reply resolves its future on that
    future's own loop) and nothing is left bound to a loop that has closed.
    """

    def __init__(self, extra_env: dict[str, str]):
        python = ensure(SPEC)
        fd, name = tempfile.mkstemp(prefix="furlong-verifiers-", suffix=".log")
        self.log = Path(name)
        with os.fdopen(fd, "wb") as err:
            self.proc = subprocess.Popen(
                [str(python), str(DRIVERS / f"{DRIVER}.py"), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=driver_env(SPEC, extra_env),
                text=True,
                bufsize=1,
            )
        self.pending: dict[int, asyncio.Future] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count()
        threading.Thread(target=self._read, name="furlong-verifiers-replies", daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.lock:
                fut = self.pending.pop(reply.pop("id", None), None)
            if fut is not None:
                _resolve(fut, reply)
        self.proc.wait()
        try:
            tail = self.log.read_text(errors="replace")[-3000:]
        except OSError:  # removed at exit
            tail = ""
        error = VerifiersError(f"the verifiers driver exited (code {self.proc.returncode}); log {self.log}:\n{tail}")
        with self.lock:
            pending, self.pending = list(self.pending.values()), {}
        for fut in pending:
            _resolve(fut, error)

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()

    async def request(self, req: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        with self.lock:
            self.pending[rid] = fut
        try:
            self._send({**req, "id": rid})
            return await asyncio.wait_for(fut, timeout_s)
        except OSError as e:
            raise VerifiersError(f"the verifiers driver is gone ({e}); log {self.log}") from None
        except BaseException:  # timed out or cancelled: stop the episode in the driver too
            with self.lock:
                self.pending.pop(rid, None)
            if self.proc.poll() is None:
                try:
                    self._send({"op": "cancel", "id": rid})
                except OSError:
                    pass
            raise


def _resolve(fut: asyncio.Future, value: Any) -> None:
    """Complete `fut` from the reader thread, on its own loop (a closed loop: nobody waits any more)."""

    def finish() -> None:
        if not fut.done():
            fut.set_exception(value) if isinstance(value, BaseException) else fut.set_result(value)

    try:
        fut.get_loop().call_soon_threadsafe(finish)
    except RuntimeError:
        pass


_workers: dict[str, _Worker] = {}
_workers_lock = threading.Lock()


def _worker(opts: Options) -> _Worker:
    """This process's driver for `opts.paths`, started on first use (and again if it died)."""
    key = json.dumps(opts.paths)
    with _workers_lock:
        worker = _workers.get(key)
        if worker is None or not worker.alive():
            worker = _workers[key] = _Worker(opts.driver_env())
        return worker


@atexit.register
def _stop_workers() -> None:
    for w in _workers.values():
        w.kill()
        w.log.unlink(missing_ok=True)
    _workers.clear()


# ---------------------------------------------------------------- the agent
def task_ref(sample: Any, opts: Options) -> dict[str, Any]:
    """The verifiers task a sample's prompt came from (`metadata["verifiers"]`, set by `data_source`)."""
    ref = (getattr(sample, "metadata", None) or {}).get("verifiers")
    if not isinstance(ref, dict) or "idx" not in ref:
        raise ValueError(
            f"sample {getattr(sample, 'index', '?')} names no verifiers task (metadata['verifiers']); "
            "take its prompts from rollout.data_source: furlong.envs.connectors.verifiers:data_source"
        )
    if ref.get("taskset") not in (None, opts.taskset):
        raise ValueError(
            f"{FIELD}.taskset is {opts.taskset!r}, but the sample's prompt came from taskset {ref['taskset']!r}"
        )
    return ref


async def run_episode(sample: Any, base_url: str, opts: Options) -> dict[str, Any]:
    """One verifiers episode of the sample's task against `base_url`; the driver's reply (see the driver)."""
    ref = task_ref(sample, opts)
    req = {
        "op": "episode",
        "env": opts.env_config(),
        "limit": opts.n_tasks,
        "idx": ref["idx"],
        "key": ref.get("key"),
        "base_url": base_url,
        "model": "furlong",
        "sampling": opts.sampling,
    }
    worker = await asyncio.to_thread(_worker, opts)
    try:
        reply = await worker.request(req, opts.timeout_s + 30.0)
    except TimeoutError:
        raise VerifiersError(
            f"verifiers episode of task {ref['idx']} ({opts.taskset}) gave no result within "
            f"{FIELD}.timeout_s = {opts.timeout_s:g} s (+30 s grace)"
        ) from None
    if "error" in reply:
        raise VerifiersError(f"verifiers episode of task {ref['idx']} ({opts.taskset}): {reply['error']}")
    return reply


async def agent(sample: Any, base_url: str, envs: Any = None) -> dict[str, float]:
    """The `rollout.agent_fn`: run the sample's verifiers task as one episode; its rubric's reward.

    The reward is `{"score": total, name: score, ...}`: verifiers' total (each reward
    times its weight, summed) and each named reward unweighted. An episode that ended
    on an error with nothing scored raises (the sample fails, with verifiers' error).
    """
    opts = options(envs)
    reply = await run_episode(sample, base_url, opts)
    keep = ("ok", "truncated", "stop", "turns", "errors", "seconds")
    sample.metadata["verifiers_episode"] = {k: reply[k] for k in keep}
    if not reply["scored"] or (not reply["ok"] and not reply["truncated"]):
        raise VerifiersError(
            f"verifiers episode of task {sample.metadata['verifiers']['idx']} ({opts.taskset}) "
            f"failed: {'; '.join(reply['errors']) or 'nothing was scored'}"
        )
    named = {(k if k != "score" else "vf_score"): float(v["score"]) for k, v in reply["rewards"].items()}
    return {
        "score": float(reply["reward"]),
        **named,
        **{f"metric/{k}": float(v) for k, v in reply["metrics"].items() if isinstance(v, (int, float))},
    }
