"""What ends a run early, and what restarts it: a dead trainer, lost engines, NaN/inf losses.

A trainer rank that dies surfaces as `TrainerDied` from the trainer group's calls.
Without `cluster.auto_restart` the run stops with `RunStopped`, naming the last
complete checkpoint and the `--resume` command. With it, the whole topology is
brought down and the run resumes from that checkpoint, at most
`MAX_TRAINER_RESTARTS` times: the checkpoint holds the trainer's and the driver's
full state, so the resumed run trains exactly what the uninterrupted one would
have (tested: final weights are equal).

No engine (or no router) able to serve for `cluster.no_engine_timeout_s`, or every
engine lost for good (`EnginesLost`, from the supervisor), stops the run too, naming
what died, the last checkpoint and the `--resume` command: nothing could generate
the next batch. NaN/inf losses are skipped by the trainer,
one optimiser step at a time; `check_finite` stops the run after
`train.max_nonfinite_steps` of them in a row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from furlong.cluster.supervisor import EnginesLost
from furlong.cluster.trainer_group import TrainerDied
from furlong.driver.rundir import latest_checkpoint

MAX_TRAINER_RESTARTS = 3  # cluster.auto_restart: bounded, so a crash loop ends


class RunStopped(RuntimeError):
    """The run cannot go on; the message says why and how to continue."""


def check_finite(per_opt: list[dict[str, float]], limit: int, step: int, note: Callable[[str], None]) -> None:
    """Warn about skipped non-finite optimiser steps; stop the run after `limit` in a row."""
    skipped = sum(int(m.get("nonfinite/skipped", 0)) for m in per_opt)
    streak = int(per_opt[-1].get("nonfinite/streak", 0)) if per_opt else 0
    if skipped:
        note(
            f"warning: RL step {step}: loss or gradient was NaN/inf in {skipped} optimiser step(s); "
            f"skipped them (weights unchanged), {streak} in a row"
        )
    if streak >= limit:
        raise RunStopped(
            f"the loss was NaN/inf in {streak} optimiser steps in a row (train.max_nonfinite_steps="
            f"{limit}), at RL step {step}; the weights are those of the last finite step. Check the "
            "rewards, the learning rate and any loss or before_train_step plug point"
        )


async def run_with_restarts(run: Any) -> dict[str, Any]:
    """`run.run()`; a dead trainer stops it cleanly, or with `cluster.auto_restart` resumes it from its checkpoint.

    `run` is a `furlong.driver.run.Run` (anything with `run()`, `cfg`, `run_dir`, `progress` and
    the `(cfg, resume=, progress=)` constructor): a restart builds a fresh one with `resume=True`.
    """
    restarts = 0
    while True:
        try:
            result = await run.run()
            result["trainer_restarts"] = restarts
            return result
        except EnginesLost as e:
            ckpt = latest_checkpoint(run.run_dir)
            where = f"the last complete checkpoint is {ckpt}" if ckpt else "no checkpoint was complete yet"
            raise RunStopped(
                f"{e}; the run stopped: {where}. Fix the engines (their logs above), then continue it with "
                f"`furlong train --resume {run.run_dir}`"
            ) from e
        except TrainerDied as e:
            ckpt = latest_checkpoint(run.run_dir)
            where = f"the last complete checkpoint is {ckpt}" if ckpt else "no checkpoint was complete yet"
            if not run.cfg.cluster.auto_restart:
                raise RunStopped(
                    f"{e}; the run stopped: {where}. Continue it with "
                    f"`furlong train --resume {run.run_dir}` (or set cluster.auto_restart=true)"
                ) from e
            if restarts >= MAX_TRAINER_RESTARTS:
                raise RunStopped(f"{e}; gave up after {restarts} automatic restarts: {where}") from e
            restarts += 1
            print(
                f"furlong {e}; restarting the trainer group from {ckpt or 'step 0'} "
                f"(automatic restart {restarts}/{MAX_TRAINER_RESTARTS})",
                file=sys.stderr,
            )
            run = type(run)(run.cfg, resume=True, progress=run.progress)
