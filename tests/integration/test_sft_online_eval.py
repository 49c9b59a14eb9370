"""`algo.name=sft` with `rollout.eval_mode=dedicated`: the run starts its eval engine and nothing else
(no router, no rollout engine); at each eval step (and before/after) it pushes the trainer's weights
to it and logs the generation eval (pass@k, reward) beside the teacher-forced metrics.

One short run (tiny model, 2 steps, eval every step). What the engine holds is read as the run
closes it (the `EngineEval.close` below observes, then closes as the run does): its weight version
and every tensor's CRC32, against the trainer's own checksums of its final weights.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _descendants(word: bytes) -> set[int]:
    """`furlong <word>` processes descended from this test process (our Ray's workers start them)."""
    parents: dict[int, int] = {}
    found = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            with open(f"/proc/{d}/stat") as f:
                parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if word in cmd and any(b"furlong" in c for c in cmd):
            found.add(int(d))
    me, out = os.getpid(), set()
    for pid in found:
        p = pid
        while p > 1 and p != me:
            p = parents.get(p, 1)
        if p == me:
            out.add(pid)
    return out


def test_sft_refuses_async_eval_naming_the_fields():
    """async eval shares the rollout engines, which an SFT run does not start; blocking is teacher-forced only."""
    from furlong.config import ConfigError, load_config

    recipe = str(ROOT / "recipes" / "sft_reverse_teacher.yaml")
    with pytest.raises(ConfigError, match=r"rollout.eval_mode.*algo.name|algo.name=sft starts no rollout engines"):
        load_config(recipe, ["rollout.eval_mode=async"])
    assert load_config(recipe, ["rollout.eval_mode=dedicated"]).rollout.eval_mode == "dedicated"


@pytest.mark.slow  # an SFT run with one engine (Ray, trainer rank, `furlong serve`)
@pytest.mark.timeout(600)
def test_sft_dedicated_eval_runs_on_its_engine_with_the_trainer_weights(tmp_path, monkeypatch):
    from furlong.config import load_config
    from furlong.core.client import EngineControl
    from furlong.driver import sft_run
    from furlong.driver.run import Run

    cfg = load_config(
        str(ROOT / "recipes" / "sft_reverse_teacher.yaml"),
        [
            "model.size=tiny",
            "observe.tensorboard=false",
            "rollout.eval_mode=dedicated",
            "rollout.eval_every=1",
            "rollout.max_new_tokens=8",
            "data.n_eval=4",
            "train.global_batch_size=4",
            "rollout.rollout_batch_size=4",
            f"train.total_steps={STEPS}",
            "train.checkpoint_every=0",
            "cluster.threads_per_process=1",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    seen: dict[str, Any] = {}
    close = sft_run.EngineEval.close

    async def observed_close(self: Any) -> None:
        (url,) = self.urls
        held = await asyncio.to_thread(EngineControl(url, admin_token=self.run.token).weights_checksum)
        seen.update(
            held=held,
            trainer=await asyncio.to_thread(self.run.trainers.weight_checksums),
            serve=_descendants(b"serve"),
            router=_descendants(b"router"),
        )
        await close(self)

    monkeypatch.setattr(sft_run.EngineEval, "close", observed_close)
    result = asyncio.run(Run(cfg, progress=False).run())

    assert len(seen["serve"]) == 1 and not seen["router"], seen  # the eval engine only
    assert result["engines_started"] == 1, result
    logs = sorted(p.name for p in (Path(result["run_dir"]) / "logs").glob("*.log"))
    assert logs == ["eval-engine-0.log"], logs
    held, trainer = seen["held"], seen["trainer"]
    assert held["weight_version"] == STEPS  # pushed for the after-SFT eval
    assert trainer and {n: t["crc32"] for n, t in held["tensors"].items() if n in trainer} == trainer

    rows = [json.loads(x) for x in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # each eval step: the engine's generation eval, on that step's weights, beside teacher-forced
        assert "eval/pass@1" in r and "eval/sft_nll" in r and r["eval/weight_version"] == r["step"], r
    for phase, version in (("before", 0), ("after", STEPS)):
        assert "eval/pass@1" in result[phase] and result[phase]["eval/weight_version"] == version, result[phase]
