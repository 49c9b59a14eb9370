"""`furlong train engine.backend=sglang` on CPU: the real launcher starts a stand-in SGLang, and a run completes.

The stand-in (`tests/fixtures/sglang_standin`) parses SGLang's command line strictly, takes
its admin key only from the 0600 `--config` file that `engine.sglang_exec` writes, and
checks every control request against SGLang's documented request shapes (refusing, say, an
integer `weight_version`, which SGLang types as a string) before furlong's engine serves it.
So the run below proves the path `engine.backend=sglang` → `engine.launch` → `sglang_exec` →
`sglang.launch_server`, the flag mapping, and the weight sync over SGLang's
`init_weights_update_group` / `update_weights_from_distributed` endpoints.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import pytest

from tests.helpers import token_holders

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "fixtures" / "sglang_standin"
TOKEN = "sglang-run-test-token"


@pytest.fixture()
def standin_on_path(monkeypatch):
    import ray

    if ray.is_initialized():  # Ray's workers inherit the environment at ray.init: start ours with the stand-in
        ray.shutdown()
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")])))
    yield
    ray.shutdown()


@pytest.mark.timeout(300)
def test_a_short_run_completes_against_the_sglang_standin(tmp_path, standin_on_path):
    from furlong.config import ConfigError, load_config
    from furlong.driver.run import Run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "admin_token").write_text(TOKEN)
    overrides = [
        f"run_dir={run_dir}",
        "engine.backend=sglang",
        "engine.device=cpu",
        "train.total_steps=1",
        "data.n_eval=1",
        "algo.entropy_coef=0.01",
    ]
    with pytest.raises(ConfigError, match="weights.verify=true compares every engine tensor"):
        load_config(str(ROOT / "recipes" / "debug.yaml"), [*overrides, "weights.verify=true"])
    with pytest.raises(ConfigError, match="weights.transport=shm needs an endpoint only the built-in engine has"):
        load_config(str(ROOT / "recipes" / "debug.yaml"), [*overrides, "weights.transport=shm"])
    cfg = load_config(str(ROOT / "recipes" / "debug.yaml"), overrides)
    assert cfg.weights.transport == "broadcast"  # SGLang's sync path, when the transport is left unset
    result = asyncio.run(Run(cfg, progress=False).run())
    assert result["steps"] == 1
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    (m,) = [r for r in records if "weight_sync/version" in r]  # the step's record (other lines: perf, cpu)
    assert m["weight_sync/version"] == 1

    log = (run_dir / "logs" / "engine-0.log").read_text()
    argv = json.loads(re.search(r"^standin argv: (.*)$", log, re.M).group(1))
    assert argv[argv.index("--device") + 1] == "cpu" and "--config" in argv and TOKEN not in " ".join(argv)
    controls = re.findall(r"^standin control (\S+) (.*)$", log, re.M)
    paths = [p for p, _ in controls]
    assert "/init_weights_update_group" in paths and "/update_weights_from_distributed" in paths, paths
    assert not [c for c in controls if "REFUSED" in c[1]], controls
    assert all("weight_version=str" in f for p, f in controls if p == "/update_weights_from_distributed")
    assert not token_holders(TOKEN)  # the engine (and its wrapper) and the router are gone
