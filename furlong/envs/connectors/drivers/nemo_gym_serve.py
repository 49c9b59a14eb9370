"""Run NeMo Gym's servers for furlong: a resources server, an agent and a model server, one process each.

Runs inside the nemo-gym virtual environment (standard library + nemo_gym only).

    python nemo_gym_serve.py '{"config_paths": [...], "overrides": {...}, "policy_base_url": URL,
                               "policy_model_name": NAME, "head_port": PORT}'

What `gym env start` does, less what does not fit here: the global config is
resolved by NeMo Gym's own parser (`config_paths`, then furlong's overrides on top,
free loopback ports for every server); the head server serves it on `head_port`;
every server instance runs its own `app.py` (NeMo Gym's `run_webserver`, unchanged)
in a process of its own, from its directory, with the config in the environment,
exactly as there. Left out: the per-server `uv` environments (every server runs on
this environment's packages) and Ray (`initialize_ray` is skipped: the servers
furlong drives do not use it, and a Ray cluster per process would cost seconds and
hundreds of MB each).

The model server is NeMo Gym's `vllm_model` (instance `policy_model`), pointed at
furlong's session server: it asks for `token_id:N` log-probs and calls `/tokenize`,
as it does with vLLM, and every episode names its session in the request metadata.

`GET /health` on the head port answers 503 until every server answers, then 200 with
the server instances (name, type, url). A server that exits ends this process with
its log tail; SIGTERM ends them all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

MODEL_CONFIG = "responses_api_models/vllm_model/configs/vllm_model.yaml"
SERVER_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models")
# Each server process: NeMo Gym's entrypoint run as `python app.py` would, without Ray.
LAUNCH = (
    "import runpy, sys, nemo_gym.server_utils as su; su.initialize_ray = lambda: None; "
    "sys.argv = [sys.argv[1]]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def resolve(spec: dict) -> object:
    """NeMo Gym's global config for `spec`, resolved by its own parser (ports, references, defaults).

    Its errors name the furlong fields they come from (`envs.connector.config_paths` / `.overrides`).
    """
    try:
        return _resolve(spec)
    except Exception as e:  # noqa: BLE001 - NeMo Gym raises many kinds; the message is what matters
        raise ValueError(
            f"envs.connector.config_paths / envs.connector.overrides: NeMo Gym could not resolve "
            f"the config: {type(e).__name__}: {e}"
        ) from None


def _resolve(spec: dict) -> object:
    from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
    from omegaconf import OmegaConf

    initial = {
        "config_paths": list(spec.get("config_paths") or []) + ([MODEL_CONFIG] if spec.get("policy_base_url") else []),
        "head_server": {"host": "127.0.0.1", "port": int(spec.get("head_port") or 0) or 11000},
        "default_host": "127.0.0.1",
    }
    if spec.get("policy_base_url"):
        initial |= {
            "policy_base_url": spec["policy_base_url"],
            "policy_api_key": "furlong",
            "policy_model_name": spec.get("policy_model_name") or "furlong",
            "policy_model": {
                "responses_api_models": {
                    "vllm_model": {"return_token_id_information": True, "uses_reasoning_parser": False}
                }
            },
        }
    merged = OmegaConf.merge(OmegaConf.create(initial), OmegaConf.create(spec.get("overrides") or {}))
    return GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=merged, skip_load_from_cli=True, skip_load_from_dotenv=True
        )
    )


def instances(config: object) -> list[dict]:
    """Every server instance in the config: name, type, implementation, entrypoint, host, port, its section."""
    from nemo_gym.global_config import NEMO_GYM_RESERVED_TOP_LEVEL_KEYS

    out = []
    for name, section in config.items():
        if name in NEMO_GYM_RESERVED_TOP_LEVEL_KEYS or not hasattr(section, "keys") or not section:
            continue
        kind = next(iter(section.keys()))
        if kind not in SERVER_TYPES or not hasattr(section[kind], "keys"):
            continue
        impl = next(iter(section[kind].keys()))
        inner = section[kind][impl]
        if "entrypoint" in inner:
            out.append(
                {
                    "name": name,
                    "type": kind,
                    "impl": impl,
                    "entrypoint": inner["entrypoint"],
                    "host": inner["host"],
                    "port": int(inner["port"]),
                    "url": f"http://{inner['host']}:{inner['port']}",
                    "section": inner,
                }
            )
    return out


def server_dir(kind: str, impl: str) -> Path:
    """Where a server's code lives: the working directory first (a user's own server), else NeMo Gym's install."""
    from nemo_gym import PARENT_DIR

    local = Path.cwd() / kind / impl
    if (local / "requirements.txt").exists() or (local / "pyproject.toml").exists():
        return local
    return PARENT_DIR / kind / impl


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def serve(spec: dict) -> int:
    import nemo_gym.global_config as gc
    import uvicorn
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import HeadServer
    from omegaconf import OmegaConf

    try:
        config = resolve(spec)
    except ValueError as e:
        print(e, flush=True)
        return 2
    gc._GLOBAL_CONFIG_DICT = config  # what the head server serves at /global_config_dict_yaml
    servers = instances(config)
    config_yaml = OmegaConf.to_yaml(config)
    logs = Path.cwd() / "logs"
    logs.mkdir(exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    for s in servers:
        env = {**os.environ, "NEMO_GYM_CONFIG_DICT": config_yaml, "NEMO_GYM_CONFIG_PATH": s["name"]}
        with open(logs / f"{s['name']}.log", "ab") as log:
            procs[s["name"]] = subprocess.Popen(
                [sys.executable, "-c", LAUNCH, s["entrypoint"]],
                cwd=server_dir(s["type"], s["impl"]),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
    public = [{k: s[k] for k in ("name", "type", "impl", "url")} for s in servers]
    ready = threading.Event()
    head = HeadServer(config=BaseServerConfig(host="127.0.0.1", port=int(spec["head_port"])))
    head.set_server_instances(public)
    app = head.setup_webserver()

    @app.get("/health")
    def health():
        from fastapi.responses import JSONResponse

        return JSONResponse({"ready": ready.is_set(), "servers": public}, status_code=200 if ready.is_set() else 503)

    threading.Thread(
        target=uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=int(spec["head_port"]), log_level="warning")
        ).run,
        daemon=True,
    ).start()

    def stop(*_: object) -> None:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    waiting = {s["name"]: s["url"] for s in servers}
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                tail = (logs / f"{name}.log").read_text(errors="replace")[-3000:]
                print(f"NeMo Gym server {name} exited with code {p.returncode}; its log:\n{tail}", flush=True)
                stop()
        for name in [n for n, url in waiting.items() if _up(url)]:
            del waiting[name]
            print(f"NeMo Gym server {name} up at {dict((s['name'], s['url']) for s in servers)[name]}", flush=True)
        if not waiting and not ready.is_set():
            ready.set()
            print(json.dumps({"ready": public}), flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
