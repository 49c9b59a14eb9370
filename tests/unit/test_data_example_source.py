"""The custom data-source example builds a mixed, resumable stream whose rewards dispatch by task."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from furlong.data import TASKS, PromptSource

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data_source" / "mixed_tasks.py"


def load_example():
    spec = importlib.util.spec_from_file_location("mixed_tasks", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mixed_tasks_example():
    build = load_example().build
    src = build(seed=1, n_per_task=20)
    assert isinstance(src, PromptSource)
    batch = src.next_batch(40)
    assert sorted(p.index for p in batch) == list(range(40))
    assert {p.metadata["task"] for p in batch[:10]} == {"arithmetic", "reverse"}  # shuffled together
    for p in batch:
        assert TASKS[p.metadata["task"]].score(f"Answer: {p.label}", p.label) == 1.0

    state = json.loads(json.dumps(src.state_dict()))
    resumed = build(seed=1, n_per_task=20)
    resumed.load_state_dict(state)
    assert resumed.next_batch(25) == src.next_batch(25)
