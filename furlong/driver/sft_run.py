"""`algo.name=sft`: supervised fine-tuning with no engine, no router and no sampling.

An SFT run trains on what the dataset says, not on what the model says: each step takes
`train.global_batch_size` prompts from the demonstrations (`data.sft_path`: prompt/response
pairs or whole conversations, with only the assistant turns in the loss) or from the task's
reference answers, and takes one optimiser step of masked cross-entropy. Nothing samples, so
starting an engine would only cost memory and a process: the run starts trainer ranks alone.

Eval, every `rollout.eval_every` steps and before/after, is teacher-forced on the held-out
prompts' reference answers, also engine-free:

- `eval/sft_nll`: the mean negative log-likelihood per trained token;
- `eval/greedy_match_lower_bound`: the fraction of held-out prompts whose every reference
  token has probability above 1/2. Such a token is the argmax, so greedy decoding reproduces
  the whole reference: a lower bound on greedy exact-match accuracy that needs no decoding.

Checkpoints are the trainer's (`checkpoints/step_<n>/`, with `hf/` config and tokenizer), so
`furlong export` turns one into a model another run can load (e.g. as `algo.teacher_path`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TYPE_CHECKING, Any

from furlong.data.sft import sft_samples, sft_source
from furlong.driver import build
from furlong.driver.restarts import RunStopped
from furlong.driver.rundir import checkpoint_dir, rotate_checkpoints, write_driver_state

if TYPE_CHECKING:
    from furlong.driver.run import Run

SURE = math.log(0.5)  # a reference token above this log-prob is the greedy choice


async def evaluate(run: Run, samples: list[Any]) -> dict[str, float]:
    """Teacher-forced held-out metrics of the reference answers (see the module docstring)."""
    if not samples:
        return {}
    lps = await run.trainers.compute_logprobs(samples)
    nll = n = sure = 0.0
    for s, lp in zip(samples, lps):
        kept = [x for x, m in zip(lp, s.loss_mask or [1] * len(lp)) if m]
        nll -= sum(kept)
        n += len(kept)
        sure += float(bool(kept) and min(kept) > SURE)
    return {
        "eval/sft_nll": nll / max(n, 1.0),
        "eval/greedy_match_lower_bound": sure / len(samples),
        "eval/n_prompts": float(len(samples)),
    }


def save(run: Run, step: int, cursor: dict[str, Any]) -> None:
    path = checkpoint_dir(run.run_dir, step)
    run.log.flush()  # the step's rows on disk before the marker says it is done
    run.trainers.save(str(path))
    write_driver_state(path, {"step": step, "version": 0, "sft": cursor, "log": run.log.state_dict()})
    rotate_checkpoints(run.run_dir, run.cfg.train.keep_checkpoints)


async def run_sft(run: Run, t0: float) -> dict[str, Any]:
    """The whole engine-free SFT run (set up by `Run._prepare`); its result, also in `result.json`."""
    from furlong.data.from_config import build_data

    cfg = run.cfg
    if run.resume:
        raise RunStopped("--resume of an algo.name=sft run is not built yet; start it again")
    try:
        source, evals = build_data(cfg)
        stream = sft_source(cfg.data, source, seed=cfg.seed)
        chat, bs = cfg.data.apply_chat_template, cfg.train.global_batch_size
        held_out = sft_samples(list(evals), run.tokenizer, chat) if evals else []
        run.log.note(f"starting {cfg.train.world_size} trainer rank(s), no engine (algo.name=sft)")
        build.start_ray(cfg)
        if run.given_top is not None:  # a warm topology: its trainer ranks, rebuilt for this run; its engines idle
            await asyncio.to_thread(build.rebuild_trainers, cfg, run.given_top, run.model_dir, run.plugs)
            run.top = run.given_top
        else:
            run.top = await asyncio.to_thread(build.trainers_only, cfg, run.model_dir, run.plugs)
        run.trainers = run.top.trainers
        before = await evaluate(run, held_out)
        every = cfg.rollout.eval_every
        with run.log.progress("SFT", cfg.train.total_steps) as advance:
            for step in range(cfg.train.total_steps):
                t = time.perf_counter()
                m = await run.trainers.sft_step(sft_samples(stream.next_batch(bs), run.tokenizer, chat))
                metrics = {(f"train/{k}" if "/" not in k else k): float(v) for k, v in m.items()}
                metrics["time/step_s"] = time.perf_counter() - t
                run.step = step + 1
                if every and run.step % every == 0:
                    metrics.update(await evaluate(run, held_out))
                run.log.write(run.step, metrics)
                advance(f"loss {m.get('loss', float('nan')):.3f}")
                if cfg.train.checkpoint_every and run.step % cfg.train.checkpoint_every == 0:
                    await asyncio.to_thread(save, run, run.step, _cursor(stream))
        await asyncio.to_thread(save, run, run.step, _cursor(stream))
        after = await evaluate(run, held_out)
        run.log.note("eval (after SFT): " + " ".join(f"{k}={v:.3f}" for k, v in sorted(after.items())))
        result = {
            "steps": run.step,
            "before": before,
            "after": after,
            "engines_started": 0 if run.given_top is not None else len(run.top.engine_urls),
            "minutes": (time.perf_counter() - t0) / 60,
            "run_dir": str(run.run_dir),
        }
        (run.run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
        return result
    finally:
        await run.close()


def _cursor(stream: Any) -> dict[str, Any]:
    state = getattr(stream, "state_dict", None)
    return state() if callable(state) else {}
