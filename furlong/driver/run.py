"""The RL run, top to bottom: set up, (resume,) SFT warm-up, evaluate, train, evaluate, clean up.

One loop, whatever the rollout mode (DESIGN §2):

    batch   = await manager.next_batch(step)         # rollouts through router -> engines, rewards shaped
    trained = await trainers.train_rollout(batch)    # FSDP2 ranks on Ray
    await manager.before_weight_sync()               # partial rollouts stop here
    pause engines -> push weights (version step+1) -> continue
    await manager.on_weights_updated(step + 1)

Everything is built in `build.py` (the composition root) from the config's typed
sections; this module only runs it. The run's weight version has one owner, the
`WeightVersion` made here and handed to the supervisor (whose sync advances it) and
the rollout manager (which measures staleness against it).

A checkpoint (`checkpoints/step_<n>/`) holds the trainer's full state and the
driver's: data cursor, rollout buffer, in-flight partial rollouts, counters. It
is taken between `before_weight_sync` and `on_weights_updated`, when nothing is
in flight, so resuming continues exactly where the run stood; every
`train.checkpoint_every` steps or `train.checkpoint_every_min` minutes, whichever
comes first, and at the end.

Exactly-once logs: a step's samples, metrics and eval are recorded (and flushed to
disk) *before* its checkpoint's marker is written, so a checkpoint never names a step
whose rows are missing; a resume rewinds `metrics.jsonl`, `samples/` and the event
store to the checkpoint's step before re-running the steps after it, so none appears
twice. A resume whose newest checkpoint fails to load falls back to the one before,
with a warning.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.cluster.trainer_group import TrainerDied
from furlong.core.version import WeightVersion
from furlong.data.sft import sft_samples, sft_source
from furlong.driver import build
from furlong.driver.restarts import RunStopped, check_finite
from furlong.driver.rundir import (
    admin_token,
    checkpoint_dir,
    complete_checkpoints,
    read_driver_state,
    rotate_checkpoints,
    write_driver_state,
)

if TYPE_CHECKING:
    from furlong.config.schema import Config


class Run:
    """One training run: owns the topology, the rollout manager, the weight version and the logs."""

    def __init__(self, cfg: Config, resume: bool = False, progress: bool = True, topology: Any = None):
        """`topology`: an already started one to run on (its trainer is rebuilt for this run, and it is left
        running at the end), so several short runs share one start-up; None: start and stop our own."""
        self.cfg, self.resume, self.progress = cfg, resume, progress
        self.given_top = topology
        self.teacher = self.teacher_actor = None  # on-policy distillation's teacher engine (algo.teacher_path)
        self.background = None  # rollout.eval_mode=async | dedicated: the eval running beside training
        self.run_dir = Path(cfg.run_dir)
        self.version = WeightVersion(0)
        self.step = 0
        self.saved_at = time.monotonic()  # the last checkpoint (or the start): `train.checkpoint_every_min` counts
        self.top = self.trainers = self.manager = self.supervisor = self.cores = self.dashboard = self.log = None
        self.client = None  # the EngineClient to the router (made in _start)

    async def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self._prepare()
        if self.cfg.algo.name == "sft":  # engine-free: trainer ranks only, on the dataset's references
            from furlong.driver.sft_run import run_sft

            return await run_sft(self, t0)
        try:
            await self._start()
            # The supervisor ends the phases with EnginesLost once no engine (or no router) can serve.
            result = await self.supervisor.guard(self._phases())
            result.update(
                minutes=(time.perf_counter() - t0) / 60,
                run_dir=str(self.run_dir),
                rollout_stats=self.manager.stats(),
                supervisor=self.supervisor.stats(),
            )
            (self.run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
            return result
        finally:
            await self.close()

    async def _phases(self) -> dict[str, Any]:
        if self.resume:
            await self._restore()
        await self.sft_warmup()
        before = await self.evaluate("before RL") if self.step == 0 else {}
        teacher = {}
        if self.teacher is not None and self.evals:  # the mark distillation climbs toward, on the same prompts
            teacher = await self.manager.evaluate(self.step, client=self.teacher)
            self.log.note("eval (teacher): " + " ".join(f"{k}={v:.3f}" for k, v in sorted(teacher.items())))
        result = await self.train()
        if self.background is not None:  # the last background eval, before the final one
            late = await self.background.drain()
            if late:
                self.log.write(self.step, late)
        after = await self.evaluate("after RL")
        return {**result, "before": dict(before), "after": after, **({"teacher": teacher} if teacher else {})}

    # ------------------------------------------------------------------ set-up
    def _prepare(self) -> None:
        """Plug points first (a bad path fails before anything starts), then run dir, model, tokenizer, logs."""
        from transformers import AutoTokenizer

        self.plugs = build.plugins(self.cfg)
        self.after_save = self.plugs["train.after_save"]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.resume:
            self.cfg.save(self.run_dir / "config.yaml")
        self.token = self.given_top.admin_token if self.given_top is not None else admin_token(self.run_dir)
        self.model_dir = build.model_dir(self.cfg.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.log = build.metric_log(self.cfg, self.run_dir, self.tokenizer, self.plugs)
        o = self.cfg.observe
        if o.dashboard:
            from furlong.dashboard.server import serve_in_thread

            self.dashboard = serve_in_thread(self.run_dir, port=o.dashboard_port, follow=True)
            self.log.note(f"dashboard: {self.dashboard.url}")

    async def _start(self) -> None:
        from furlong.cluster.engine_stats import EngineStats
        from furlong.core.client import EngineClient
        from furlong.data.from_config import build_data

        cfg = self.cfg
        self.source, self.evals = build_data(cfg)
        self.log.note(
            f"starting topology: {cfg.train.world_size} trainer rank(s), {cfg.engine.num_engines} "
            f"{cfg.engine.backend} engine(s){' colocated' if cfg.cluster.colocate else ''}, router"
        )
        build.start_ray(cfg)
        if self.given_top is not None:
            await asyncio.to_thread(build.rebuild_trainers, cfg, self.given_top, self.model_dir, self.plugs)
            self.top = self.given_top
        else:
            self.top = await asyncio.to_thread(
                build.topology, cfg, self.run_dir, self.model_dir, self.token, self.plugs
            )
        self.trainers = self.top.trainers
        if cfg.algo.teacher_path:
            self.teacher_actor, url = await asyncio.to_thread(build.teacher_engine, cfg, self.run_dir, self.token)
            self.teacher = EngineClient(url, admin_token=self.token)
        # as many requests in flight as the engines run together: a smaller cap would queue turns the engines have room for
        inflight = cfg.engine.num_engines * cfg.engine.max_running
        self.client = EngineClient(self.top.router_url, admin_token=self.token, max_inflight=inflight)
        self.supervisor = build.supervisor(cfg, self.top, self.token, self.run_dir, self.version, self.log.note)
        self.cores = build.core_sharing(cfg, self.top, self.token)
        await self.cores.start()
        self.manager = build.rollout_manager(
            cfg,
            self.source,
            self.evals,
            self.client,
            self.tokenizer,
            self.version,
            self.plugs,
            self.supervisor.wait_serving,
        )
        if cfg.rollout.eval_mode != "blocking":  # beside training: through the router, or on its own engines
            from furlong.driver.eval_loop import BackgroundEval, PriorityClient

            dedicated = cfg.rollout.eval_mode == "dedicated"
            urls = self.top.eval_engine_urls if dedicated else [self.top.router_url]
            if not urls:
                raise ValueError("rollout.eval_mode=dedicated: the given topology started no eval engines")
            eval_client = PriorityClient([EngineClient(u, admin_token=self.token) for u in urls])
            sync = self.supervisor.sync_eval_engines if dedicated else None
            self.background = BackgroundEval(self.manager, eval_client, self.version, sync)
        self.supervisor.start()  # engine health, replacement, tolerant syncs
        self.engine_stats = EngineStats(self.top.engine_urls)
        self.timeline = build.timeline(cfg, self.log.store, self.top, self.model_dir)
        if (self.given_top is not None and not self.resume) or cfg.train.lora.adapters:  # or lack the adapters
            await self._sync_weights(0)

    async def _sync_weights(self, version: int) -> dict[str, float]:
        """Pause the engines, push the trainer's weights as `version` (the owner advances), continue."""
        t0 = time.perf_counter()
        report = await self.supervisor.sync_weights(version)
        return {
            "weight_sync/seconds": time.perf_counter() - t0,
            **{f"weight_sync/{k}": v for k, v in report.items() if isinstance(v, (int, float))},
        }

    # ------------------------------------------------------------------ phases
    async def sft_warmup(self) -> None:
        steps = self.cfg.train.sft_steps
        if not steps or self.resume:
            return
        chat = self.cfg.data.apply_chat_template
        bs = self.cfg.train.global_batch_size
        source = sft_source(self.cfg.data, self.source, seed=self.cfg.seed)
        with self.log.progress("SFT warm-up", steps) as advance:
            for _ in range(steps):
                m = await self.trainers.sft_step(sft_samples(source.next_batch(bs), self.tokenizer, chat))
                advance(f"loss {m.get('loss', float('nan')):.3f}")
        await self._sync_weights(0)

    async def evaluate(self, label: str) -> dict[str, float]:
        if not self.evals:
            return {}
        if self.background is not None and self.background.sync is not None:  # dedicated: on the eval engines
            metrics = await self.background.now(self.step)
        else:
            metrics = await self.manager.evaluate(self.step)
        self.log.note(f"eval ({label}): " + " ".join(f"{k}={v:.3f}" for k, v in sorted(metrics.items())))
        return metrics

    async def train(self) -> dict[str, Any]:
        with self.log.progress("RL", self.cfg.train.total_steps, start=self.step) as advance:
            while self.step < self.cfg.train.total_steps:
                metrics = await self.rl_step()
                advance(self.log.summary(self.step, metrics))
        await self.manager.before_weight_sync()
        await self.timeline.wait()
        await asyncio.to_thread(self._save, self.step)
        return {"steps": self.step}

    async def rl_step(self) -> dict[str, float]:
        """One RL step: generate, train, sync the weights, record the step (then checkpoint); its metrics."""
        step, train = self.step, self.cfg.train
        n = step + 1  # the step's number in the event store and metrics.jsonl: 1..total
        span = self.log.store.span
        t0, started = time.perf_counter(), time.time()
        with span("driver", "generate", n):
            batch = await self.manager.next_batch(step)
        scored = {}
        if self.teacher is not None:  # distillation: the teacher's log-prob of every sampled token
            from furlong.rollout.teacher import score_batch

            with span("driver", "teacher", n):
                scored = await score_batch(self.teacher, batch)
        t_gen = time.perf_counter()
        with span("driver", "idle", n, waiting="trainers"):  # the ranks' own lanes show what they did
            async with self.cores.trainer_computing(self._engines_idle):  # core sharing, if any
                trained = await self.trainers.train_rollout(batch)
        per_opt = trained["metrics"]
        check_finite(per_opt, train.max_nonfinite_steps, step, self.log.note)  # stops after N NaN/inf in a row
        t_train = time.perf_counter()
        await self.manager.before_weight_sync()
        with span("driver", "weight-sync", n):
            sync = await self._sync_weights(step + 1)
        self.step = step + 1
        self.log.samples(step, batch, trained, step)
        metrics = self.log.step_metrics(batch, per_opt, self.manager.stats(), step)
        metrics.update(sync)
        metrics.update(scored)
        metrics.update(await self.engine_stats.poll())
        metrics.update(
            {
                "time/rollout_wait_s": t_gen - t0,
                "time/train_s": t_train - t_gen,
                "time/step_s": time.perf_counter() - t0,
                # wall clock at the step's start: the row itself is written later, in the background
                "time/started_unix": started,
                "perf/samples_per_s": len(batch) / (time.perf_counter() - t0),
            }
        )
        t_eval = time.time()
        if self.background is not None:  # eval_mode=async | dedicated: a finished eval, and maybe start the next
            ev = self.background.collect()
            every = self.cfg.rollout.eval_every
            if self.evals and every and step % every == 0:
                await self.background.start_synced(step)  # dedicated: its engines get this step's weights first
        else:
            ev = await self.manager.maybe_evaluate(step)
        if ev:
            self.log.store.record_span("driver", "eval", n, t_eval, time.time())
            metrics.update(ev)
        await self.timeline.wait()  # the previous step's pull (one at a time, in step order)

        def write(utilisation: dict[str, float], row: int = self.step) -> None:
            metrics.update(utilisation)  # MFU and CPU per worker, from the spans just pulled: one row per step
            self.log.write(row, metrics)

        # This step's spans from every process, in the background; its row is written when they are in,
        # and always before the checkpoint marks the step done (the waits below): exactly once.
        self.timeline.start(n, write)
        if self._checkpoint_due():
            await self.timeline.wait()  # the step's row and spans are in the store before its checkpoint
            await asyncio.to_thread(self._save, self.step)
        await self.manager.on_weights_updated(self.version.current)
        return metrics

    def _engines_idle(self) -> bool:
        """Nothing for any engine to compute until the next batch: no rollout work left, no eval running."""
        return self.manager.engines_idle() and not (self.background is not None and self.background.busy)

    def _checkpoint_due(self) -> bool:
        """Every `checkpoint_every` steps or `checkpoint_every_min` minutes, whichever first (the end saves anyway)."""
        train = self.cfg.train
        if self.step >= train.total_steps:
            return False
        by_steps = bool(train.checkpoint_every) and self.step % train.checkpoint_every == 0
        minutes = (time.monotonic() - self.saved_at) / 60
        return by_steps or (bool(train.checkpoint_every_min) and minutes >= train.checkpoint_every_min)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, step: int) -> None:
        path = checkpoint_dir(self.run_dir, step)
        self.log.flush()  # the step's rows on disk before the marker (write_driver_state) says it is done
        if path.exists():  # a resumed run passing a step it had saved before (maybe damaged): never mix the two
            shutil.rmtree(path)
        self.trainers.save(str(path))
        # The rollout state holds the data cursor, the buffer and in-flight partial rollouts.
        write_driver_state(
            path,
            {
                "step": step,
                "version": self.version.current,
                "rollout": self.manager.state_dict(),
                "log": self.log.state_dict(),
            },
        )
        if self.after_save is not None:
            self.after_save(step, str(path))
        rotate_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints)
        self.saved_at = time.monotonic()

    async def _restore(self) -> None:
        """Load the newest checkpoint that loads (older ones on failure, with a warning); rewind the logs to it."""
        state = await self.load_newest()
        if state is None:
            return
        self.manager.load_state_dict(state["rollout"])
        self.version.restore(state["version"])
        await self._sync_weights(state["version"])
        await self.manager.on_weights_updated(state["version"])

    async def load_newest(self) -> dict[str, Any] | None:
        """The trainer loaded from the newest checkpoint that loads, the logs rewound to its step and `self.step`
        set; its driver state (the caller restores the rest). None, and `resume` off, when none is complete yet.
        Shared by the RL path and `algo.name=sft` (`sft_run.py`)."""
        found = complete_checkpoints(self.run_dir)
        if not found:
            self.log.note("no complete checkpoint yet: starting from step 0")
            self.resume = False
            self.log.rewind(0)
            return None
        state, errors = None, []
        for ckpt in reversed(found):
            try:
                state = await self._load_checkpoint(ckpt)
                break
            except TrainerDied:
                raise
            except Exception as e:  # noqa: BLE001 - a damaged checkpoint: the one before it may load
                errors.append(f"{ckpt}: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}")
                self.log.note(f"warning: checkpoint {ckpt} failed to load ({errors[-1]}); trying the one before it")
        if state is None:
            raise RunStopped("no checkpoint of this run loads:\n  " + "\n  ".join(errors))
        self.log.rewind(state["step"])  # the steps after it run again: their rows must not appear twice
        self.log.load_state_dict(state.get("log", {}))
        self.step = state["step"]
        self.log.note(f"resumed from {ckpt} at step {self.step}")
        return state

    async def _load_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        """The driver state of `ckpt`, the trainer loaded from it; only a checkpoint inside this run's directory."""
        own = (self.run_dir / "checkpoints").resolve()
        if ckpt.resolve().parent != own:
            raise ValueError(f"{ckpt} resolves to {ckpt.resolve()}, outside {own}: not loading it")
        state = read_driver_state(ckpt)
        await asyncio.to_thread(self.trainers.load, str(ckpt))
        return state

    async def close(self) -> None:
        if getattr(self, "timeline", None) is not None and self.top is not None:
            try:  # the spans after the last step (final eval, checkpoint) before the processes go
                await self.timeline.wait()
                await self.timeline.pull(self.step, final=True)  # spans only: the last step's metrics are written
                self.timeline = None
            except Exception:  # noqa: BLE001 - best effort: closing must go on
                pass
        if self.supervisor is not None:  # first: shutting the engines down is not a fault
            await self.supervisor.stop()
            self.supervisor = None
        if self.cores is not None:
            await self.cores.aclose()
            self.cores = None
        if self.manager is not None:
            try:
                await self.manager.close()
            except Exception:  # noqa: BLE001 - closing must go on to the topology
                pass
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.background is not None:
            await self.background.close()
            self.background = None
        if self.teacher is not None:
            await self.teacher.aclose()
            self.teacher = None
        if self.teacher_actor is not None:
            import ray

            await asyncio.to_thread(ray.get, self.teacher_actor.stop.remote(), timeout=20)
            ray.kill(self.teacher_actor)
            self.teacher_actor = None
        if self.top is not None and self.top is not self.given_top:  # a given topology outlives the run
            await asyncio.to_thread(self.top.shutdown)
        self.top = None
        if self.dashboard is not None:
            self.dashboard.stop()
        if self.log is not None:
            self.log.close()
