"""OpenEnv connector: an OpenEnv environment server as a furlong `Environment` (`envs.name: openenv`).

OpenEnv (the `openenv` package) serves each environment as a FastAPI app; a WebSocket
connection to its `/ws` is one stateful episode: `reset` gives the first observation,
each `step(action)` an observation, a reward and `done`. The package pins `openai`,
`mcp` and `gradio` versions furlong cannot share, so it lives in its own virtual
environment (`SPEC`, built by `furlong envs setup openenv` or on first use) and furlong
only talks to its server: it starts one per process on a free loopback port, from that
environment's Python (`drivers/openenv_server.py`), and stops it at exit.

The mapping onto furlong's protocol (`furlong/envs/protocol.py`):

    reset(sample)         open a connection, reset(seed, episode_id); the observation is a
                          `role` message added to the prompt (unless `reset_message: false`)
    step(sample, text)    the model turn's text (special tokens removed) becomes the action
                          `{action_field: text}` (or the parsed JSON object with
                          `action_format: json`); the observation becomes a `role` message,
                          appended with loss mask 0; OpenEnv's `done` ends the episode
    reward(sample)        OpenEnv's step rewards: their sum (`reward: sum`) or the last one,
                          as `score`, with `steps` and `done` beside it

State lives in `sample.metadata["openenv"]` (episode id, seed, actions, rewards); the
connection itself lives in this process. A sample resumed where its connection is gone
(another process, an episode restarted from its prompt) is replayed: a fresh connection
resets with the same seed and episode id and re-sends the episode's actions so far, which
restores the environment exactly when it is deterministic given its seed.

Keys of `envs.connector` (all optional):

    env: echo               echo | an OpenEnv environment directory | MODULE:APP (see the driver)
    url: null               an OpenEnv server already running (then none is started)
    action_field: message   the action field that receives the model's text
    action_format: text     text | json (the model writes the whole action as a JSON object)
    observation_field: null the observation field shown to the model; null = the observation as JSON
                            (echo: echoed_message)
    role: user              the role of observation messages (user | tool)
    reset_message: true     show the reset observation before the first turn
    reward: sum             sum | last: how the step rewards make the episode's reward
    max_sessions: 256       episodes at once on the started server
    start_timeout_s: 120    seconds for the server to become healthy
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.core.sample import Sample
from furlong.envs.connectors.venvs import DRIVERS, VenvSpec, driver_env, ensure

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig

SPEC = VenvSpec(
    name="openenv",
    python="3.11",
    requirements=("openenv==0.10.0",),
    env={"HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "ENABLE_WEB_INTERFACE": "false"},
    doc="OpenEnv environment servers (reset / step over a WebSocket)",
)
ECHO_DEFAULTS = {"observation_field": "echoed_message"}
_APP = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class OpenEnvError(RuntimeError):
    """The OpenEnv server could not be started or reached, or broke an episode; the message says which."""


@dataclass(frozen=True)
class Options:
    """The `envs.connector` keys, checked (see the module docstring); `echo` brings its own observation field."""

    env: str = "echo"
    url: str | None = None
    action_field: str = "message"
    action_format: str = "text"
    observation_field: str | None = None
    role: str = "user"
    reset_message: bool = True
    reward: str = "sum"
    max_sessions: int = 256
    start_timeout_s: float = 120.0

    @classmethod
    def parse(cls, connector: dict[str, Any] | None) -> Options:
        raw = dict(connector or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"envs.connector: unknown key(s) {unknown} for openenv; known: {sorted(known)}")
        if raw.get("env", "echo") == "echo":
            raw = {**ECHO_DEFAULTS, **raw}
        opts = cls(**raw)
        choices = {"action_format": ("text", "json"), "reward": ("sum", "last"), "role": ("user", "tool")}
        for key, allowed in choices.items():
            if getattr(opts, key) not in allowed:
                raise ValueError(f"envs.connector.{key}={getattr(opts, key)!r}: must be one of {list(allowed)}")
        if opts.url is None and not (opts.env == "echo" or Path(opts.env).is_dir() or _APP.match(opts.env)):
            raise ValueError(
                f"envs.connector.env={opts.env!r}: not 'echo', an OpenEnv environment directory, "
                f"or MODULE:APP importable in the openenv environment"
            )
        if int(opts.max_sessions) < 1:
            raise ValueError(f"envs.connector.max_sessions={opts.max_sessions}: must be >= 1")
        return opts


# ---------------------------------------------------------------- the server, one per process
_SERVERS: dict[tuple[str, int], Any] = {}
_SERVERS_LOCK = threading.Lock()


def server_url(opts: Options) -> str:
    """The URL of the OpenEnv server for `opts`: `url`, or one this process started (and stops at exit).

    Starting blocks the caller (the rollout's event loop) for a few seconds, once per process:
    every episode waits for the server anyway, and a start from a short-lived thread would
    take the server down with it (`ManagedProcess` ties its child's life to the starting thread).
    """
    if opts.url:
        return opts.url.rstrip("/")
    from furlong.core.net import free_port
    from furlong.core.processes import ManagedProcess, ProcessFailed

    env = opts.env if opts.env == "echo" or _APP.match(opts.env) else str(Path(opts.env).resolve())
    key = (env, int(opts.max_sessions))
    with _SERVERS_LOCK:
        proc = _SERVERS.get(key)
        if proc is not None and proc.alive():
            return proc.url
        python = ensure(SPEC)
        work = Path(tempfile.mkdtemp(prefix="furlong-openenv-"))
        port = free_port()
        argv = _env_argv() + [
            str(python),
            str(DRIVERS / "openenv_server.py"),
            "--env",
            env,
            "--port",
            str(port),
            "--workdir",
            str(work),
            "--max-sessions",
            str(opts.max_sessions),
        ]
        proc = ManagedProcess(f"openenv server ({env})", argv, f"http://127.0.0.1:{port}", work / "server.log")
        try:
            proc.start(opts.start_timeout_s)
        except ProcessFailed as e:
            shutil.rmtree(work, ignore_errors=True)
            raise OpenEnvError(f"envs.connector.env={opts.env!r}: the OpenEnv server did not start: {e}") from None
        _SERVERS[key] = proc
        atexit.register(_stop, proc, work)
        return proc.url


def _env_argv() -> list[str]:
    """`env` arguments that turn this process's environment into the openenv environment's (`venvs.driver_env`)."""
    want = driver_env(SPEC)
    return (
        ["env"]
        + [f"--unset={k}" for k in os.environ if k not in want]
        + [f"{k}={v}" for k, v in want.items() if os.environ.get(k) != v]
    )


def _stop(proc: Any, work: Path) -> None:
    proc.stop()
    shutil.rmtree(work, ignore_errors=True)


def stop_servers() -> None:
    """Stop every OpenEnv server this process started (also done at exit)."""
    with _SERVERS_LOCK:
        for proc in _SERVERS.values():
            proc.stop()
        _SERVERS.clear()


# ---------------------------------------------------------------- episodes
_OPEN: OrderedDict[str, tuple[Any, Any, Any]] = OrderedDict()  # episode id -> (event loop, aiohttp session, websocket)


class OpenEnvEnvironment:
    """One OpenEnv environment behind furlong's async Environment protocol (see the module docstring)."""

    def __init__(self, opts: Options, url: str, seed: int = 0, timeout_s: float = 60.0):
        self.opts, self.url, self.seed, self.timeout_s = opts, url, int(seed), timeout_s

    async def reset(self, sample: Sample) -> list[dict[str, Any]]:
        state = sample.metadata["openenv"] = {
            "episode": uuid.uuid4().hex,
            "seed": self.seed,
            "actions": [],
            "rewards": [],
            "done": False,
            "errors": 0,
        }
        first = await self._open(state)
        return [self._message(first)] if self.opts.reset_message else []

    async def step(self, sample: Sample, action: str) -> tuple[list[dict[str, Any]], bool]:
        state = sample.metadata.get("openenv")
        if state is None:  # reset skipped (its messages were already in the prompt): start the episode now
            state = sample.metadata["openenv"] = {
                "episode": uuid.uuid4().hex,
                "seed": self.seed,
                "actions": [],
                "rewards": [],
                "done": False,
                "errors": 0,
            }
        turns = [m["content"] for m in sample.metadata.get("messages", []) if m.get("role") == "assistant"]
        text = turns[-1] if turns else str(sample.metadata.get("response_text", ""))
        ws = self._socket(state)
        if ws is None or state["actions"] != turns[:-1]:
            ws = await self._replay(state, turns[:-1])
        reply = await self._act(ws, state, text)
        if state["done"]:
            await _close(state["episode"])
            return [], True
        return [self._message(reply)], False

    async def reward(self, sample: Sample) -> dict[str, float]:
        state = sample.metadata.get("openenv")
        if state is None:
            raise ValueError("openenv: the sample has no episode (metadata['openenv']); was reset() called?")
        await _close(state["episode"])
        rewards = [float(r) for r in state["rewards"] if r is not None]
        last = state["rewards"][-1] if state["rewards"] else None
        score = sum(rewards) if self.opts.reward == "sum" else float(last or 0.0)
        return {"score": score, "steps": float(len(state["actions"])), "done": float(state["done"])}

    # -------------------------------------------------------------- wire
    async def _open(self, state: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        await _close(state["episode"])
        while len(_OPEN) >= self.opts.max_sessions:  # stay within the server's capacity; a closed episode replays
            await _close(next(iter(_OPEN)))
        session = aiohttp.ClientSession()
        try:
            ws = await session.ws_connect(self.url.replace("http", "ws", 1) + "/ws", heartbeat=None, max_msg_size=0)
        except (aiohttp.ClientError, OSError) as e:
            await session.close()
            raise OpenEnvError(f"openenv: cannot connect to {self.url}/ws: {e}") from None
        _OPEN[state["episode"]] = (asyncio.get_running_loop(), session, ws)
        reply = await self._send(ws, {"type": "reset", "data": {"seed": state["seed"], "episode_id": state["episode"]}})
        if reply.get("type") != "observation":
            raise OpenEnvError(f"openenv: reset failed: {reply.get('data')}")
        return reply["data"]

    async def _replay(self, state: dict[str, Any], actions: list[str]) -> Any:
        """Reset with the episode's seed and re-send `actions`: the connection was lost or they changed."""
        await self._open(state)
        state.update(actions=[], rewards=[], done=False)
        ws = self._socket(state)
        for text in actions:
            await self._act(ws, state, text)
        return ws

    async def _act(self, ws: Any, state: dict[str, Any], text: str) -> dict[str, Any]:
        """Send one model turn as an action; record its reward. An invalid action is shown to the model, not sent."""
        state["actions"].append(text)
        action = self._action(text)
        if isinstance(action, str):
            state["rewards"].append(None)
            state["errors"] += 1
            return {"observation": {"error": action}}
        reply = await self._send(ws, {"type": "step", "data": action})
        if reply.get("type") != "observation":  # the environment refused the action (validation, execution)
            state["rewards"].append(None)
            state["errors"] += 1
            return {"observation": {"error": _error_text(reply)}}
        data = reply["data"]
        state["rewards"].append(data.get("reward"))
        state["done"] = bool(data.get("done"))
        return data

    def _action(self, text: str) -> dict[str, Any] | str:
        if self.opts.action_format == "text":
            return {self.opts.action_field: text}
        try:
            action = json.loads(text.strip())
        except json.JSONDecodeError as e:
            return f"invalid action: not JSON ({e})"
        return action if isinstance(action, dict) else "invalid action: not a JSON object"

    async def _send(self, ws: Any, message: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        await ws.send_str(json.dumps(message))
        try:
            msg = await ws.receive(timeout=self.timeout_s)
        except TimeoutError:
            raise OpenEnvError(
                f"openenv: no reply to {message['type']} within {self.timeout_s:.0f} s (envs.timeout_s) from {self.url}"
            ) from None
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise OpenEnvError(
                f"openenv: the connection to {self.url}/ws closed during {message['type']} ({msg.type.name})"
            )
        return json.loads(msg.data)

    def _socket(self, state: dict[str, Any]) -> Any:
        entry = _OPEN.get(state["episode"])
        if entry is None or entry[0] is not asyncio.get_running_loop() or entry[2].closed:
            _OPEN.pop(state["episode"], None)
            return None
        _OPEN.move_to_end(state["episode"])
        return entry[2]

    def _message(self, reply: dict[str, Any]) -> dict[str, Any]:
        obs = dict(reply.get("observation") or {})
        field = self.opts.observation_field
        if "error" in obs and len(obs) == 1:
            content = str(obs["error"])
        elif field is not None:
            if field not in obs:
                raise OpenEnvError(
                    f"envs.connector.observation_field={field!r}: the observation has only {sorted(obs)}"
                )
            content = str(obs[field])
        else:
            obs.pop("metadata", None)
            content = json.dumps(obs, ensure_ascii=False)
        return {"role": self.opts.role, "content": content}


def _error_text(reply: dict[str, Any]) -> str:
    """OpenEnv's error reply as one line: its message, then each validation error's field and reason."""
    data = reply.get("data") or {}
    details = "; ".join(
        f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
        for e in data.get("errors") or []
        if isinstance(e, dict)
    )
    return str(data.get("message", reply)) + (f": {details}" if details else "")


async def _close(episode: str) -> None:
    entry = _OPEN.pop(episode, None)
    if entry is None:
        return
    loop, session, ws = entry
    if loop is asyncio.get_running_loop():
        try:
            await ws.send_str(json.dumps({"type": "close"}))
        except Exception:  # noqa: BLE001 - already gone
            pass
        await ws.close()
        await session.close()


def environment(config: EnvsConfig | None = None, seed: int = 0) -> OpenEnvEnvironment:
    """The `envs.name: openenv` factory: options from `envs.connector`; starts this process's server on first use."""
    opts = Options.parse(getattr(config, "connector", None))
    timeout_s = max(float(getattr(config, "timeout_s", 10.0) or 10.0), 1.0)
    return OpenEnvEnvironment(opts, server_url(opts), seed=seed, timeout_s=timeout_s)


# ---------------------------------------------------------------- prompts
TOPICS = [
    "the weather",
    "your favourite number",
    "a colour",
    "a river",
    "breakfast",
    "the moon",
    "a song",
    "a city",
    "a tree",
    "the sea",
    "a book",
    "a game",
    "a bird",
    "the wind",
    "a mountain",
    "a clock",
]


def make_prompts(n: int, seed: int = 0) -> list[Any]:
    """`n` chat prompts for the echo environment, deterministic in (n, seed); each carries the episode seed."""
    from furlong.data.datasets import Prompt

    out = []
    for i in range(n):
        topic = TOPICS[(i * 7 + seed) % len(TOPICS)]
        text = f"You are talking to an echo environment. Say one sentence about {topic}; it repeats it back."
        out.append(Prompt(index=i, prompt=[{"role": "user", "content": text}], metadata={"seed": seed * 100_003 + i}))
    return out


def data_source(config: Any = None, seed: int = 0) -> Any:
    """The `rollout.data_source` plug point for echo-environment prompts (a resumable, shuffled DataSource)."""
    from furlong.data import DataSource

    return DataSource(make_prompts(256, seed), seed=seed)
