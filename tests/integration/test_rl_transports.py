"""Every weight-sync transport, through a whole `furlong train` run, leaves the engine bit-identical.

`tests/integration/test_weights_sync.py` proves it at the sender level; here the run's own
path does the sync (supervisor -> trainer actor -> sender -> engine process) with
`weights.verify=true`, which compares the engine's CRC32 of every tensor with the
trainer's after each sync and fails the sync on any difference. One RL step each, in
this process on one shared Ray (what `furlong train` runs, without the start-up cost).
The entropy bonus makes the step change every weight the loss reaches, so the sync
carries new values (a zero-advantage step would leave them equal, and a delta
transport would have nothing to send).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from tests.helpers import processes_left

ROOT = Path(__file__).resolve().parents[2]


TOKEN = "-leading-dash-token"  # token_urlsafe's alphabet has "-": engines and router must still take such a token


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """The first run starts a local Ray; it serves every transport, then goes, leaving no process behind."""
    yield
    import ray

    session_dir = ray._private.worker._global_node.get_session_dir_path() if ray.is_initialized() else None
    ray.shutdown()
    if session_dir:
        deadline = time.monotonic() + 15
        while processes_left(TOKEN, session_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not processes_left(TOKEN, session_dir), processes_left(TOKEN, session_dir)


@pytest.mark.parametrize("transport", ["shm", "broadcast", "p2p", "disk", "delta"])
def test_one_step_with_each_transport_leaves_engine_weights_equal_to_the_trainer(tmp_path, transport):
    from furlong.config import load_config
    from furlong.driver.run import Run

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "admin_token").write_text(TOKEN)
    cfg = load_config(
        str(ROOT / "recipes" / "debug.yaml"),
        [
            f"run_dir={tmp_path / 'run'}",
            "train.total_steps=1",
            "data.n_eval=1",
            "observe.tensorboard=false",
            f"weights.transport={transport}",
            "weights.verify=true",
            "algo.entropy_coef=0.01",
        ],
    )
    result = asyncio.run(Run(cfg, progress=False).run())
    assert result["steps"] == 1
    (m,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert m["train/grad_norm"] > 0, "the step did not change the weights"
    assert m["weight_sync/version"] == 1
    assert m["weight_sync/verified"] == 1, f"{transport}: the sync was not verified"
