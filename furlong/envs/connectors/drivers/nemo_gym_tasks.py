"""Read the task rows of a NeMo Gym agent's dataset; runs inside the nemo-gym environment.

stdin:  {"config_paths": [...], "overrides": {...}, "agent": NAME or null, "dataset": NAME or TYPE}
stdout: {"rows": [...]} (the dataset's JSONL rows, as NeMo Gym's agent would be sent them)
        or {"error": "..."} naming what is missing

The config is resolved by NeMo Gym's own parser (as `nemo_gym_serve` does); the
dataset is the agent's `datasets` entry with that name or type, its `jsonl_fpath`
relative to the working directory or NeMo Gym's install. Only files that are present
are read: datasets NeMo Gym would download (`huggingface_identifier`) are not fetched.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nemo_gym_serve import instances, resolve


def main(request: dict) -> dict:
    from nemo_gym import PARENT_DIR

    # Configs name the model server (`policy_model`); reading rows starts nothing, so any address does.
    request = {"policy_base_url": "http://127.0.0.1:9/v1", **request}
    agents = [s for s in instances(resolve(request)) if s["type"] == "responses_api_agents"]
    names = [s["name"] for s in agents]
    chosen = [s for s in agents if request.get("agent") in (None, s["name"])]
    if len(chosen) != 1:
        return {
            "error": f"envs.connector.agent: {request.get('agent')!r} picks {len(chosen)} of the agent servers "
            f"{names} in {request.get('config_paths')}; name one"
        }
    datasets = list(chosen[0]["section"].get("datasets") or [])
    want = request.get("dataset") or "example"
    found = [d for d in datasets if want in (d.get("name"), d.get("type"))]
    if not found:
        return {
            "error": f"envs.connector.dataset: agent {chosen[0]['name']} has no dataset named or typed {want!r}; "
            f"it has {[(d.get('name'), d.get('type')) for d in datasets]}"
        }
    rel = Path(found[0]["jsonl_fpath"])
    path = next((p for p in (rel, Path.cwd() / rel, PARENT_DIR / rel) if p.is_file()), None)
    if path is None:
        return {
            "error": f"envs.connector.dataset: {want!r} file {rel} is not here (NeMo Gym downloads it with "
            f"`gym dataset collate --download`; furlong reads only files that are present)"
        }
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                return {"error": f"{path}:{n}: not JSON: {e}"}
    return {"rows": rows, "path": str(path)}


if __name__ == "__main__":
    try:
        reply = main(json.loads(sys.stdin.read()))
    except Exception as e:  # noqa: BLE001 - reported to furlong, which raises it with this text
        reply = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(reply))
