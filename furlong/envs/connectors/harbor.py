"""Harbor connector: one Harbor trial per sample, its agent's model calls on the sample's TITO session.

Harbor (the `harbor` package) runs agents on terminal tasks: a task directory holds
`instruction.md`, `task.toml`, an `environment/` (a Dockerfile) and `tests/test.sh`,
which writes the reward to `/logs/verifier/reward.txt` (or several to `reward.json`).
A *trial* starts the task's environment, runs an agent in it, then runs the verifier.
Harbor needs Python >= 3.12 and pins `openai`/`mcp` versions furlong cannot share, so
it lives in its own virtual environment (`SPEC`, built by `furlong envs setup harbor`
or on first use) and each trial runs in a driver process there
(`drivers/harbor_trial.py`).

    rollout.agent_fn: furlong.envs.connectors.harbor:agent
        per sample, one Harbor trial of the sample's task: Harbor's Terminus 2 agent
        (by default) with the sample's session URL as its OpenAI-compatible endpoint,
        so every model call goes to furlong's engine and is recorded token for token;
        the reward is what the task's verifier wrote
    rollout.data_source: furlong.envs.connectors.harbor:data_source
        the tasks' instructions as furlong prompts, each naming its task in
        `metadata["harbor_task"]` (a JSONL file with a `harbor_task` field, read
        through `data.metadata_keys`, does the same)

The environment is `furlong-local` by default (`drivers/harbor_local_env.py`): the
task's container filesystem as a private root on this machine, entered through a
Linux mount namespace, so no Docker engine is needed. Any Harbor environment type
("docker", "daytona", ...) can be named instead.

Keys of `envs.connector`:

    tasks: PATH | [PATH]   required: a Harbor task directory, a directory of task
                           directories, or a list of either
    agent: terminus-2      a Harbor agent name
    agent_kwargs: {}       the agent's options; for Terminus 2 furlong sets
                           record_terminal_session=false, enable_summarize=false and
                           max_turns=rollout.max_turns unless given here
    model: openai/furlong  the LiteLLM model name the agent uses ("openai/..." = any
                           OpenAI-compatible endpoint, which the session is)
    environment: furlong-local   or a Harbor environment type or import path
    trials_dir: null       where trial directories go (default: a temporary directory)
    keep_trials: false     keep each trial's directory (logs, trajectory, verifier output)
    timeout_s: 900         seconds for one whole trial (driver start to verifier result)
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from furlong.envs.connectors.venvs import DRIVERS, VenvError, VenvSpec, driver_env, ensure

SPEC = VenvSpec(
    name="harbor",
    python="3.12",
    requirements=("harbor==0.26.0", "litellm==1.110.2", "openai==3.57.0", "pydantic==2.14.4"),
    env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    doc="Harbor trials (Terminus 2 agent, Harbor's verifier) in a Docker-free local environment",
)
DRIVER = "harbor_trial"
FIELD = "envs.connector"
TERMINUS_DEFAULTS = {"record_terminal_session": False, "enable_summarize": False, "suppress_max_turns_warning": True}
# Harbor reports a failed model call by the client's exception; such a trial says nothing about the
# policy, so it is an error (the rollout retries the sample), never a reward. A context-length error
# is the session's token budget running out: the episode ends and the verifier's reward stands.
MODEL_ERRORS = {
    "APIConnectionError",
    "APIError",
    "BadRequestError",
    "InternalServerError",
    "NotFoundError",
    "ServiceUnavailableError",
    "Timeout",
    "APITimeoutError",
    "RateLimitError",
    "AuthenticationError",
    "UnprocessableEntityError",
    "PermissionDeniedError",
}


class HarborError(RuntimeError):
    """A Harbor trial failed or gave no reward; the message says which task and why."""


@dataclass(frozen=True)
class Options:
    tasks: tuple[Path, ...]
    agent: str = "terminus-2"
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str = "openai/furlong"
    environment: str = "furlong-local"
    trials_dir: str | None = None
    keep_trials: bool = False
    timeout_s: float = 900.0


def is_task(path: Path) -> bool:
    return (path / "instruction.md").is_file() and (path / "task.toml").is_file()


def find_tasks(spec: Any, where: str = f"{FIELD}.tasks") -> tuple[Path, ...]:
    """The task directories `spec` names (a task, a directory of tasks, or a list of either); errors name `where`."""
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    if not items or not all(isinstance(p, (str, os.PathLike)) and str(p).strip() for p in items):
        raise ValueError(f"{where}: required, a Harbor task directory, a directory of them, or a list; got {spec!r}")
    found: list[Path] = []
    for item in items:
        path = Path(item).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f"{where}: {item}: no such directory")
        if is_task(path):
            found.append(path)
            continue
        inner = sorted(p for p in path.iterdir() if p.is_dir() and is_task(p))
        if not inner:
            raise ValueError(
                f"{where}: {item}: not a Harbor task directory (it needs instruction.md and task.toml) and holds none"
            )
        found += inner
    names = [p.name for p in found]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{where}: task names must be unique, repeated: {dupes}")
    return tuple(found)


def options(envs: Any) -> Options:
    """`envs.connector` (from the `envs` section, a dict, or None) checked; errors name the key."""
    raw = getattr(envs, "connector", envs) if envs is not None else None
    raw = dict(raw or {})
    known = {f.name for f in fields(Options)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{FIELD}: unknown key(s) {unknown} for the harbor connector; known: {sorted(known)}")
    if raw.get("tasks") is None:
        raise ValueError(f"{FIELD}.tasks: required, a Harbor task directory, a directory of them, or a list")
    tasks = find_tasks(raw["tasks"])
    if not isinstance(raw.get("agent_kwargs") or {}, dict):
        raise ValueError(f"{FIELD}.agent_kwargs: must be a mapping, got {raw['agent_kwargs']!r}")
    for key in ("agent", "model", "environment"):
        if key in raw and (not isinstance(raw[key], str) or not raw[key].strip()):
            raise ValueError(f"{FIELD}.{key}: must be a non-empty string, got {raw[key]!r}")
    timeout = raw.get("timeout_s", 900.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"{FIELD}.timeout_s: must be a positive number of seconds, got {timeout!r}")
    if not isinstance(raw.get("keep_trials", False), bool):
        raise ValueError(f"{FIELD}.keep_trials: must be true or false, got {raw['keep_trials']!r}")
    trials_dir = raw.get("trials_dir")
    if trials_dir is not None and not isinstance(trials_dir, str):
        raise ValueError(f"{FIELD}.trials_dir: must be a directory path, got {trials_dir!r}")
    return Options(
        tasks=tasks,
        agent=raw.get("agent", "terminus-2"),
        agent_kwargs=dict(raw.get("agent_kwargs") or {}),
        model=raw.get("model", "openai/furlong"),
        environment=raw.get("environment", "furlong-local"),
        trials_dir=trials_dir,
        keep_trials=bool(raw.get("keep_trials", False)),
        timeout_s=float(timeout),
    )


# ---------------------------------------------------------------- tasks -> prompts
def prompts(opts: Options) -> list[Any]:
    """Each task's instruction as a furlong `Prompt` (a user message), naming its task in metadata."""
    from furlong.data.datasets import Prompt

    return [
        Prompt(
            index=i,
            prompt=[{"role": "user", "content": (t / "instruction.md").read_text().strip()}],
            label=t.name,
            metadata={"harbor_task": str(t)},
        )
        for i, t in enumerate(opts.tasks)
    ]


def data_source(config: Any = None, seed: int = 0) -> Any:
    """The `rollout.data_source` plug point: the tasks of `envs.connector.tasks` as a resumable, shuffled DataSource."""
    from furlong.data import DataSource

    envs = getattr(config, "envs", config)
    return DataSource(prompts(options(envs)), seed=seed)


def task_of(sample: Any, opts: Options) -> Path:
    """The task a sample is for: `metadata["harbor_task"]` (a path, or a task name from `tasks`), else the only task."""
    ref = (getattr(sample, "metadata", None) or {}).get("harbor_task")
    by_name = {t.name: t for t in opts.tasks}
    if ref is None:
        if len(opts.tasks) == 1:
            return opts.tasks[0]
        raise ValueError(
            f"sample {getattr(sample, 'index', '?')}: metadata has no 'harbor_task' and {FIELD}.tasks "
            f"holds {len(opts.tasks)} tasks; take prompts from rollout.data_source: "
            f"furlong.envs.connectors.harbor:data_source, or a data file with a harbor_task field"
        )
    if str(ref) in by_name:
        return by_name[str(ref)]
    path = Path(str(ref)).expanduser()
    if path.is_dir() and is_task(path):
        return path.resolve()
    raise ValueError(
        f"sample metadata harbor_task={ref!r}: neither a Harbor task directory nor a task of "
        f"{FIELD}.tasks (known: {sorted(by_name)})"
    )


# ---------------------------------------------------------------- the agent
async def run_trial(request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One driver process for one trial; on timeout or cancellation it is asked to stop (its trial cleans up)."""
    python = await asyncio.to_thread(ensure, SPEC, quiet=True)
    proc = await asyncio.create_subprocess_exec(
        str(python),
        str(DRIVERS / f"{DRIVER}.py"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=driver_env(SPEC),
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), timeout_s)
    except BaseException as e:
        await _stop(proc)
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
            raise HarborError(
                f"task {Path(request['task_dir']).name}: no result within {timeout_s:.0f} s ({FIELD}.timeout_s)"
            ) from None
        raise
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    try:
        reply = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        reply = None
    if proc.returncode != 0 or not isinstance(reply, dict):
        raise VenvError(
            f"harbor driver failed (exit {proc.returncode}); stderr tail:\n{err.decode(errors='replace')[-3000:]}"
        )
    if "error" in reply:
        raise HarborError(f"task {Path(request['task_dir']).name}: {reply['error']}")
    return reply


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM (the driver cancels its trial, which stops its environment), then SIGKILL after 15 s."""
    if proc.returncode is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
        await asyncio.wait_for(asyncio.shield(proc.wait()), 15)
    except (ProcessLookupError, TimeoutError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def as_reward(rewards: dict[str, float]) -> float | dict[str, float]:
    """Harbor's rewards as furlong's: a lone `reward` as a float, else a dict with `score` = `reward` (or the first)."""
    if set(rewards) == {"reward"}:
        return float(rewards["reward"])
    score = rewards.get("reward", next(iter(rewards.values())))
    return {"score": float(score), **{k: float(v) for k, v in rewards.items() if k not in ("reward", "score")}}


async def agent(sample: Any, base_url: str, envs: Any = None) -> float | dict[str, float]:
    """The `rollout.agent_fn` plug point: one Harbor trial of the sample's task, its model on `base_url`.

    Returns the verifier's reward. Sets `metadata["harbor"]` on the sample (task,
    trial name, how the agent's run ended, seconds) for the run's records.
    """
    opts = options(envs)
    task = task_of(sample, opts)
    kwargs = dict(opts.agent_kwargs)
    if opts.agent == "terminus-2":
        kwargs = {**TERMINUS_DEFAULTS, "max_turns": int(sample.metadata.get("max_turns") or 1), **kwargs}
    root = Path(opts.trials_dir).expanduser() if opts.trials_dir else Path(tempfile.gettempdir()) / "furlong-harbor"
    root.mkdir(parents=True, exist_ok=True)
    trials_dir = Path(tempfile.mkdtemp(prefix=f"{task.name}-", dir=root))
    request = {
        "task_dir": str(task),
        "base_url": base_url,
        "model": opts.model,
        "agent": opts.agent,
        "agent_kwargs": kwargs,
        "environment": opts.environment,
        "trials_dir": str(trials_dir),
    }
    try:
        reply = await run_trial(request, opts.timeout_s)
    finally:
        if not opts.keep_trials:
            shutil.rmtree(trials_dir, ignore_errors=True)
    exc = reply.get("exception") or {}
    sample.metadata["harbor"] = {
        "task": task.name,
        "trial": reply["trial_name"],
        "agent": reply["agent"],
        "ended_by": exc.get("type"),
        "seconds": reply["seconds"],
        **({"trial_dir": reply["trial_dir"]} if opts.keep_trials else {}),
    }
    if exc.get("type") in MODEL_ERRORS:
        raise HarborError(
            f"task {task.name}: the agent's model call failed: {exc['type']}: {exc.get('message', '')[-500:]}"
        )
    if not reply.get("rewards"):
        raise HarborError(
            f"task {task.name}: the verifier gave no reward"
            + (f" ({exc['type']}: {exc.get('message', '')[-500:]})" if exc else "")
        )
    return as_reward(reply["rewards"])
