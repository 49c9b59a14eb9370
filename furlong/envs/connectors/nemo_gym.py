"""NeMo Gym connector: episodes on NeMo Gym's own servers, the model calls on furlong's TITO sessions.

NeMo Gym (`nemo-gym` on PyPI) describes an environment as servers: a *resources
server* (tools and the verifier that computes the reward), an *agent server* (the
loop: call the model, run tool calls, ask the resources server to verify) and a
*model server* (the Responses API in front of an OpenAI-compatible endpoint). This
connector runs all three from NeMo Gym's own code in NeMo Gym's own environment
(`furlong envs setup nemo-gym`), and points the model server — NeMo Gym's
`vllm_model`, the one NeMo RL trains through — at furlong's session server. So
every token of an episode is the engine's, recorded exactly by the session, and the
reward is the one NeMo Gym's verifier computed.

    rollout.agent_fn: furlong.envs.connectors.nemo_gym:agent
    envs.connector: {config_paths: [...], agent: NAME, overrides: {...}, ...}   # see OPTIONS

Per sample, `agent` sends the sample's NeMo Gym task row to the agent server's
`POST /run`, naming the sample's session in the row's `responses_create_params.metadata`
(the model server's base URL is fixed when it starts, so the session travels with
each request); NeMo Gym runs the episode and verifies it; the reward it returns is
the sample's, and the verifier's other fields land in `metadata["nemo_gym_verify"]`.
A row's own `temperature` and `top_p` are dropped: the rollout's sampling settings,
which the session applies, decide how the policy samples.

The servers (`drivers/nemo_gym_serve.py`) start on the first episode, once per
process and per (options, session server), on free loopback ports, and stop at exit.
Starting them costs seconds (three Python processes importing NeMo Gym); an episode
then costs only its HTTP round trips.

Task rows: a prompt from `data_source` carries its row in `metadata["nemo_gym"]`. Any
other prompt (a furlong task, a JSONL) becomes `{"question", "expected_answer"}` — the
fields of NeMo Gym's math resources servers — from `metadata["question"]` (else the
last user message) and the label, with the prompt's messages as the model input.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from furlong.core.net import tls_context
from furlong.envs.connectors.venvs import DRIVERS, VenvSpec, driver_env, ensure, run_driver
from furlong.envs.session_server import SESSION_METADATA

SPEC = VenvSpec(
    name="nemo-gym",
    python="3.12",
    requirements=("nemo-gym==0.4.0", "math-verify==0.8.0"),  # math-verify: the math_with_judge verifier's own pin
    doc="NeMo Gym resources servers, agents and its vllm_model server, driven over HTTP",
)
DEFAULT_CONFIG = "resources_servers/math_with_judge/configs/math_with_judge.yaml"
ROW_SAMPLING = ("temperature", "top_p")  # Responses API sampling fields a task row may carry
SESSION_URL = re.compile(r"^(?P<root>https?://[^/]+(?:/.*?)?)/sessions/(?P<sid>[^/]+)/v1/?$")


@dataclass(frozen=True)
class Options:
    """`envs.connector` for NeMo Gym; each key's error names it."""

    config_paths: tuple[str, ...] = (DEFAULT_CONFIG,)  # NeMo Gym config files: resources server + agent
    agent: str | None = None  # the agent server instance episodes run on; default: the only one
    overrides: dict[str, Any] = field(default_factory=dict)  # merged over NeMo Gym's global config
    model: str = "furlong"  # the model name NeMo Gym's model server sends
    dataset: str = "example"  # data_source: the agent's dataset (its name or type) to read rows from
    timeout_s: float = 600.0  # one episode (POST /run)
    startup_timeout_s: float = 300.0  # the servers' start

    def key(self) -> str:
        return json.dumps([self.config_paths, self.overrides, self.model], sort_keys=True)


OPTIONS = tuple(Options.__dataclass_fields__)


def options(envs: Any) -> Options:
    """`envs.connector` (a dict, or the `envs` section holding it) as Options; a bad key or value names its field."""
    raw = dict((envs if isinstance(envs, dict) else getattr(envs, "connector", None)) or {})
    unknown = sorted(set(raw) - set(OPTIONS))
    if unknown:
        raise ValueError(f"envs.connector.{unknown[0]}: unknown option for nemo-gym; known: {sorted(OPTIONS)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"envs.connector.{key}"
        if key == "config_paths":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(p, str) and p for p in value):
                raise ValueError(f"{where}: must be a non-empty list of NeMo Gym config file paths, got {value!r}")
            # A file here (relative to the working directory) wins; otherwise NeMo Gym looks in its install.
            value = tuple(str(Path(p).resolve()) if Path(p).is_file() else p for p in value)
        elif key == "overrides":
            if not isinstance(value, dict):
                raise ValueError(f"{where}: must be a mapping (merged over NeMo Gym's global config), got {value!r}")
        elif key in ("timeout_s", "startup_timeout_s"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{where}: must be a positive number of seconds, got {value!r}")
            value = float(value)
        elif key == "agent" and value is None:
            pass
        elif not isinstance(value, str) or not value:
            raise ValueError(f"{where}: must be a non-empty string, got {value!r}")
        out[key] = value
    return Options(**out)


# ---- the servers --------------------------------------------------------------------
class Servers:
    """NeMo Gym's servers for one Options and one session server; the driver process owns them."""

    def __init__(self, opts: Options, sessions_root: str):
        from furlong.core.net import free_port
        from furlong.core.processes import ManagedProcess, spawn

        self.workdir = Path(tempfile.mkdtemp(prefix="furlong-nemo-gym-"))
        port = free_port()
        request = {
            "config_paths": list(opts.config_paths),
            "overrides": opts.overrides,
            "head_port": port,
            "policy_base_url": f"{sessions_root}/v1",
            "policy_model_name": opts.model,
        }
        argv = [str(ensure(SPEC)), str(DRIVERS / "nemo_gym_serve.py"), json.dumps(request)]
        self.process = ManagedProcess(
            "NeMo Gym servers", argv, f"http://127.0.0.1:{port}", self.workdir / "servers.log"
        )
        with open(self.process.log_path, "ab") as log:  # ManagedProcess's start, with the venv's environment
            self.process.proc = spawn(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=driver_env(SPEC),
                start_new_session=True,
            )
        self.process.wait_healthy(opts.startup_timeout_s)
        self.servers = httpx.get(f"{self.process.url}/health", timeout=10, verify=tls_context()).json()["servers"]
        self.config_paths = list(opts.config_paths)

    def agent(self, name: str | None) -> dict[str, Any]:
        """The agent server `name` (`envs.connector.agent`), or the only one when None."""
        agents = [s for s in self.servers if s["type"] == "responses_api_agents"]
        chosen = [s for s in agents if name in (None, s["name"])]
        if len(chosen) != 1:
            raise ValueError(
                f"envs.connector.agent: {name!r} picks {len(chosen)} of the agent servers "
                f"{[s['name'] for s in agents]} in {self.config_paths}; name one"
            )
        return chosen[0]

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)  # its logs: a failure's message carries their tail


_servers: dict[tuple[str, str], Servers] = {}
_lock = threading.Lock()


def running(opts: Options, sessions_root: str) -> Servers | None:
    """The servers for (opts, session server) when they are up, without waiting for a start."""
    found = _servers.get((opts.key(), sessions_root))
    return found if found is not None and found.process.alive() else None


def servers(opts: Options, sessions_root: str) -> Servers:
    """This process's NeMo Gym servers for (opts, session server), started on first use and stopped at exit."""
    with _lock:
        key = (opts.key(), sessions_root)
        found = _servers.get(key)
        if found is not None and not found.process.alive():
            found = None  # it died: start it again, the error of a second failure surfaces below
        if found is None:
            found = _servers[key] = Servers(opts, sessions_root)
            atexit.register(found.stop)
        return found


def stop_all() -> None:
    """Stop every NeMo Gym server process this process started."""
    with _lock:
        for s in _servers.values():
            s.stop()
        _servers.clear()


# ---- one episode --------------------------------------------------------------------
def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def task_row(sample: Any) -> dict[str, Any]:
    """The NeMo Gym task row for a sample (see the module docstring)."""
    row = sample.metadata.get("nemo_gym")
    if isinstance(row, dict):
        row = json.loads(json.dumps(row))
    else:
        prompt = sample.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        users = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
        question = sample.metadata.get("question") or (users[-1] if users else "")
        row = {
            "responses_create_params": {
                "input": [{"role": m["role"], "content": _text(m.get("content"))} for m in messages]
            },
            "question": str(question),
        }
        if sample.label is not None:
            row["expected_answer"] = str(sample.label)
    if not isinstance(row.get("responses_create_params"), dict) or not row["responses_create_params"].get("input"):
        raise ValueError("nemo-gym: the task row has no responses_create_params.input (the model's input)")
    return row


async def run_episode(row: dict[str, Any], base_url: str, envs: Any = None) -> dict[str, Any]:
    """Run one NeMo Gym episode on the session at `base_url`; NeMo Gym's verify response (reward, response, ...)."""
    opts = options(envs)
    m = SESSION_URL.match(base_url)
    if not m:
        raise ValueError(f"nemo-gym: base_url {base_url!r} is not a furlong session URL (.../sessions/<id>/v1)")
    up = running(opts, m["root"]) or await asyncio.to_thread(servers, opts, m["root"])
    agent_server = up.agent(opts.agent)
    body = json.loads(json.dumps(row))
    params = body["responses_create_params"]
    for key in ROW_SAMPLING:  # the rollout's sampling settings (the session's defaults) govern, not the row's
        params.pop(key, None)
    params["metadata"] = {**(params.get("metadata") or {}), SESSION_METADATA: m["sid"]}
    async with httpx.AsyncClient(timeout=httpx.Timeout(opts.timeout_s, connect=10.0), verify=tls_context()) as http:
        resp = await http.post(f"{agent_server['url']}/run", json=body)
    if resp.status_code != 200:
        raise RuntimeError(
            f"NeMo Gym agent {agent_server['name']} POST /run: HTTP {resp.status_code}: "
            f"{resp.text[:1000]} (server logs: {up.workdir / 'logs'})"
        )
    out = resp.json()
    if not isinstance(out, dict) or "reward" not in out:
        raise RuntimeError(f"NeMo Gym agent {agent_server['name']} POST /run: no reward in {str(out)[:500]}")
    return out


async def agent(sample: Any, base_url: str, envs: Any = None) -> float:
    """`rollout.agent_fn`: one NeMo Gym episode for `sample`; returns the reward NeMo Gym's verifier gave."""
    out = await run_episode(task_row(sample), base_url, envs)
    sample.metadata["nemo_gym_verify"] = {
        k: v
        for k, v in out.items()
        if k not in ("responses_create_params", "response") and isinstance(v, (str, int, float, bool, type(None)))
    }
    return float(out["reward"])


# ---- prompts ------------------------------------------------------------------------
def rows(envs: Any = None) -> list[dict[str, Any]]:
    """The task rows of the configured agent's dataset `envs.connector.dataset` (read by NeMo Gym's config)."""
    opts = options(envs)
    request = {
        "config_paths": list(opts.config_paths),
        "overrides": opts.overrides,
        "agent": opts.agent,
        "dataset": opts.dataset,
    }
    return run_driver(SPEC, "nemo_gym_tasks", request, timeout_s=opts.startup_timeout_s)["rows"]


def data_source(config: Any = None, seed: int = 0) -> Any:
    """`rollout.data_source`: the configured dataset's rows as furlong prompts (row in `metadata["nemo_gym"]`)."""
    from furlong.data import DataSource, Prompt

    prompts = []
    for i, row in enumerate(rows(getattr(config, "envs", config))):
        given = row["responses_create_params"]["input"]
        messages = [
            {"role": m.get("role", "user"), "content": _text(m.get("content"))}
            for m in ([{"role": "user", "content": given}] if isinstance(given, str) else given)
        ]
        meta = {"nemo_gym": row, **({"question": row["question"]} if isinstance(row.get("question"), str) else {})}
        prompts.append(Prompt(index=i, prompt=messages, label=row.get("expected_answer"), metadata=meta))
    return DataSource(prompts, seed=seed)
