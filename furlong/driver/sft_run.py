"""`algo.name=sft`: supervised fine-tuning with no router, no rollout engine and no rollout sampling.

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

With `rollout.eval_mode=dedicated` the run also starts `engine.eval_num_engines` eval engines
(still no router, no rollout engine) and, at those same points, pushes the trainer's weights to
them and adds the rollout manager's generation eval (pass@k, reward): `EngineEval`. `async` is
refused (`config/checks.py`): it shares rollout engines an SFT run does not have.

Checkpoints are the trainer's (`checkpoints/step_<n>/`, with `hf/` config and tokenizer), so
`furlong export` turns one into a model another run can load (e.g. as `algo.teacher_path`).
`--resume` loads the newest one that loads (`Run.load_newest`, shared with RL runs: trainer,
step, metric log rewound) and the data cursor (`driver_state["sft"]`), then continues.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
from typing import TYPE_CHECKING, Any

from furlong.data.sft import sft_samples, sft_source
from furlong.driver import build
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


class EngineEval:
    """`rollout.eval_mode=dedicated`: the generation eval (pass@k, reward: the rollout manager's) on eval
    engines of the run's own, no router, no rollout engine. Blocking, between steps: nothing else is in
    flight, so each eval first pushes the trainer's weights as the step's version and sees only those."""

    def __init__(self, run: Run, started: list[tuple[Any, str]], source: Any, evals: list[Any]) -> None:
        """`started`: `build.sft_eval_engines`'s [(actor, url)]; this eval stops them (`close`)."""
        from furlong.core.client import EngineClient
        from furlong.driver.eval_loop import PriorityClient

        self.run, cfg = run, run.cfg
        self.actors, self.urls = [a for a, _ in started], [u for _, u in started]
        self.client = PriorityClient([EngineClient(u, admin_token=run.token) for u in self.urls])
        self.manager = build.rollout_manager(cfg, source, evals, self.client, run.tokenizer, run.version, run.plugs)
        w = cfg.weights
        self.opts = {"bucket_mb": w.bucket_mb, "run_dir": str(run.run_dir), "verify": w.verify}

    async def __call__(self, step: int) -> dict[str, float]:
        await self.run.trainers.push_weights(
            self.urls, step, transport=self.run.cfg.weights.transport, admin_token=self.run.token, opts=self.opts
        )
        self.run.version.advance(step)
        metrics = await self.manager.evaluate(step, client=self.client)
        return {**metrics, "eval/weight_version": float(step)}

    async def close(self) -> None:
        try:
            await self.manager.close()
            await self.client.aclose()
        finally:
            await asyncio.to_thread(build.stop_engines, self.actors)


def save(run: Run, step: int, cursor: dict[str, Any]) -> None:
    path = checkpoint_dir(run.run_dir, step)
    run.log.flush()  # the step's rows on disk before the marker says it is done
    if path.exists():  # a resumed run passing a step it had saved before (maybe damaged): never mix the two
        shutil.rmtree(path)
    run.trainers.save(str(path))
    write_driver_state(path, {"step": step, "version": 0, "sft": cursor, "log": run.log.state_dict()})
    rotate_checkpoints(run.run_dir, run.cfg.train.keep_checkpoints)


async def run_sft(run: Run, t0: float) -> dict[str, Any]:
    """The whole engine-free SFT run (set up by `Run._prepare`); its result, also in `result.json`."""
    from furlong.data.from_config import build_data

    cfg = run.cfg
    engines = None
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
        if cfg.rollout.eval_mode == "dedicated":
            run.log.note(f"starting {build.eval_engines(cfg)} eval engine(s) (rollout.eval_mode=dedicated), no router")
            started = await asyncio.to_thread(build.sft_eval_engines, cfg, run.run_dir, run.model_dir, run.token)
            try:
                engines = EngineEval(run, started, source, list(evals))
            except BaseException:
                await asyncio.to_thread(build.stop_engines, [a for a, _ in started])
                raise

        async def evaluate_all() -> dict[str, float]:
            out = await evaluate(run, held_out)
            return {**out, **(await engines(run.step))} if engines is not None else out

        state = await run.load_newest() if run.resume else None  # trainer, step, metric log; None: from 0
        if state is not None:
            _load_cursor(stream, state.get("sft", {}))
        before = await evaluate_all() if run.step == 0 else {}  # a resumed run was evaluated before
        every = cfg.rollout.eval_every
        with run.log.progress("SFT", cfg.train.total_steps, start=run.step) as advance:
            saved = run.step if state is not None else -1  # the step the newest checkpoint holds
            for step in range(run.step, cfg.train.total_steps):
                t = time.perf_counter()
                m = await run.trainers.sft_step(sft_samples(stream.next_batch(bs), run.tokenizer, chat))
                metrics = {(f"train/{k}" if "/" not in k else k): float(v) for k, v in m.items()}
                metrics["time/step_s"] = time.perf_counter() - t
                run.step = step + 1
                if every and run.step % every == 0:
                    metrics.update(await evaluate_all())
                run.log.write(run.step, metrics)
                advance(f"loss {m.get('loss', float('nan')):.3f}")
                if cfg.train.checkpoint_every and run.step % cfg.train.checkpoint_every == 0:
                    await asyncio.to_thread(save, run, run.step, _cursor(stream))
                    saved = run.step
        if saved != run.step:  # the end, unless that step is saved already
            await asyncio.to_thread(save, run, run.step, _cursor(stream))
        after = await evaluate_all()
        run.log.note("eval (after SFT): " + " ".join(f"{k}={v:.3f}" for k, v in sorted(after.items())))
        result = {
            "steps": run.step,
            "before": before,
            "after": after,
            "engines_started": (0 if run.given_top is not None else len(run.top.engine_urls))
            + (len(engines.urls) if engines is not None else 0),
            "minutes": (time.perf_counter() - t0) / 60,
            "run_dir": str(run.run_dir),
        }
        (run.run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
        return result
    finally:
        if engines is not None:
            await engines.close()
        await run.close()


def _cursor(stream: Any) -> dict[str, Any]:
    state = getattr(stream, "state_dict", None)
    return state() if callable(state) else {}


def _load_cursor(stream: Any, cursor: dict[str, Any]) -> None:
    """Where the checkpointed run was in the demonstrations: the resumed steps take the batches it would have."""
    load = getattr(stream, "load_state_dict", None)
    if cursor and callable(load):
        load(cursor)
