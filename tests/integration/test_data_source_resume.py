"""DataSource resume across real processes: checkpoint in one, restore in another, same stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from furlong.data import DataSource, load_dataset

# Each child loads the dataset file itself, so nothing but the JSON state crosses the process gap.
CHILD = r"""
import json, sys
from furlong.data import DataSource, load_dataset

data, state_file, mode = sys.argv[1:4]
src = DataSource(load_dataset(data, prompt_key="q", label_key="a"), seed=11)
out = {}
if mode == "first":
    b1 = src.next_batch(5)
    src.push_back(b1[1:3])
    b2 = src.next_batch(7)
    src.push_back(b2[-2:])
    out["seen"] = [[p.index, p.prompt, p.label] for p in b1 + b2]
    with open(state_file, "w") as f:
        json.dump(src.state_dict(), f)
else:
    with open(state_file) as f:
        src.load_state_dict(json.load(f))
    out["seen"] = [[p.index, p.prompt, p.label] for p in src.next_batch(30)]
    out["state"] = src.state_dict()
print(json.dumps(out))
"""


def run_child(data: Path, state: Path, mode: str, hash_seed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(data), str(state), mode], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_resume_in_a_new_process_gives_the_uninterrupted_stream(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}", "a": i * i}) + "\n" for i in range(9)))

    src = DataSource(load_dataset(data, prompt_key="q", label_key="a"), seed=11)
    b1 = src.next_batch(5)
    src.push_back(b1[1:3])
    b2 = src.next_batch(7)
    src.push_back(b2[-2:])
    rest = src.next_batch(30)

    state = tmp_path / "state.json"
    first = run_child(data, state, "first", hash_seed="1")
    assert first["seen"] == [[p.index, p.prompt, p.label] for p in b1 + b2]
    saved = json.loads(state.read_text())
    assert saved["pending"] == [p.index for p in b2[-2:]] and saved["returned"] == 4

    second = run_child(data, state, "resume", hash_seed="2")
    assert second["seen"] == [[p.index, p.prompt, p.label] for p in rest]
    assert second["seen"][:2] == [[p.index, p.prompt, p.label] for p in b2[-2:]]  # pushed-back prompts survive
    assert second["state"] == src.state_dict()
