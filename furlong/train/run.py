"""`furlong train RECIPE [key=value ...]` and `furlong train --resume RUN_DIR`: the RL driver.

One loop, whatever the mode (DESIGN §2):

    batch   = await manager.next_batch(step)         # rollouts through router -> engines
    metrics = await trainers.train_rollout(batch)    # FSDP2 ranks on Ray
    await manager.before_weight_sync()               # partial rollouts stop here
    pause engines -> push weights (version step+1) -> continue
    await manager.on_weights_updated(step + 1)

A checkpoint (`checkpoints/step_<n>/`) holds the trainer's full state and the
driver's: data cursor, rollout buffer, in-flight partial rollouts, counters. It
is taken between `before_weight_sync` and `on_weights_updated`, when nothing is
in flight, so resuming continues exactly where the run stood.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from furlong.cluster.supervisor import RunStopped, check_finite, run_with_restarts
from furlong.train.logging import MetricLog

DRIVER_STATE = "driver_state.json"


def _run_dir(cfg: Any) -> Path:
    return Path(cfg.run_dir)


def admin_token(run_dir: Path) -> str:
    """The run's admin token for control endpoints: generated once, file mode 0600."""
    path = run_dir / "admin_token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / DRIVER_STATE).exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def sft_samples(prompts: list[Any], tokenizer: Any, chat: bool) -> list[Any]:
    """Warm-up samples: prompt + demonstrated response + end of turn; only the response is trained.

    A prompt's response is its `metadata["response"]` (a demonstrations file, `data.sft_path`)
    or else its synthetic task's reference answer. A whole demonstrated conversation
    (`metadata["conversation"]`: tool calls, tool results, several assistant turns) becomes
    the token ids a multi-turn rollout produces, with only the assistant turns trained.
    """
    from furlong.data.tasks import get_task
    from furlong.envs.chat import conversation_sample
    from furlong.rollout.generate import encode_prompt
    from furlong.rollout.sample import Sample

    end = tokenizer.convert_tokens_to_ids("<|im_end|>" if chat else "<|endoftext|>")
    out = []
    for i, p in enumerate(prompts):
        if p.metadata.get("conversation"):
            s = conversation_sample(tokenizer, p.prompt, p.metadata.get("tools"))
            s.index = s.group_index = i
            out.append(s)
            continue
        s = Sample(index=i, group_index=i, prompt=p.prompt, tokens=encode_prompt(tokenizer, p.prompt))
        response = p.metadata.get("response")
        if response is None:
            response = get_task(p.metadata["task"]).answer(p.label, chat)
        s.append(tokenizer.encode(response, add_special_tokens=False) + [end], version=0)
        out.append(s)
    return out


def _first_record(path: str) -> Any:
    """The first JSON line of a `.jsonl` demonstrations file (None otherwise): which form its demonstrations take."""
    if not str(path).endswith((".jsonl", ".ndjson")) or not os.path.isfile(path):
        return None
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None  # load_dataset reports it, naming the line
    return None


def sft_source(cfg: Any, train_source: Any) -> Any:
    """Where warm-up prompts come from: the demonstrations file, or the RL train stream itself."""
    from furlong.data import DataSource, Prompt, load_dataset

    d = cfg.data
    if not d.sft_path:
        return train_source
    first = _first_record(d.sft_path)
    key = d.messages_key or "messages"
    turns = first.get(key) if isinstance(first, dict) else None
    if isinstance(turns, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in turns):
        # Whole conversations: `messages` with the assistant turns (and `tools` when the first line has them).
        demos = load_dataset(d.sft_path, messages_key=key, label_key=None, on_error=d.on_error,
                             metadata_keys=["tools"] if "tools" in first else [])
        return DataSource([Prompt(p.index, p.prompt, None, {**p.metadata, "conversation": True}) for p in demos],
                          seed=cfg.seed)
    demos = load_dataset(d.sft_path, prompt_key=None if d.messages_key else d.prompt_key, messages_key=d.messages_key,
                         label_key=d.sft_response_key, on_error=d.on_error)
    prompts = []
    for p in demos:
        prompt = [{"role": "user", "content": p.prompt}] if d.apply_chat_template and isinstance(p.prompt, str) else p.prompt
        prompts.append(Prompt(p.index, prompt, None, {**p.metadata, "response": str(p.label)}))
    return DataSource(prompts, seed=cfg.seed)


class Run:
    """One training run: owns the topology, the rollout manager and the logs."""

    def __init__(self, cfg: Any, resume: bool = False, progress: bool = True):
        self.cfg, self.resume, self.progress = cfg, resume, progress
        self.run_dir = _run_dir(cfg)
        self.top = None
        self.manager = None
        self.dashboard = None
        self.supervisor = None

    # ------------------------------------------------------------------ set-up
    def _prepare(self) -> None:
        from furlong.models import create_model

        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.resume:
            self.cfg.save(self.run_dir / "config.yaml")
        self.token = admin_token(self.run_dir)
        m = self.cfg.model
        self.model_dir = m.path or str(create_model(m.arch, m.size, seed=m.seed, max_positions=m.max_positions))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.log = MetricLog(self.run_dir, self.cfg, self.tokenizer)
        if self.cfg.observe.dashboard:
            from furlong.dashboard.server import serve_in_thread

            self.dashboard = serve_in_thread(self.run_dir, port=self.cfg.observe.dashboard_port, follow=True)
            self.log.note(f"dashboard: {self.dashboard.url}")

    async def _start(self) -> None:
        from furlong.cluster.topology import Topology, bundles_needed, init_ray
        from furlong.data.from_config import build_data
        from furlong.rollout.client import EngineClient
        from furlong.rollout.manager import RolloutManager

        self.source, self.evals = build_data(self.cfg)
        self.log.note(f"starting topology: {self.cfg.train.world_size} trainer rank(s), "
                      f"{self.cfg.engine.num_engines} engine(s){' colocated' if self.cfg.cluster.colocate else ''}, router")
        init_ray(self.cfg, bundles_needed(self.cfg))  # in the main thread: Ray's signal handlers need it
        self.top = await asyncio.to_thread(Topology.start, self.cfg, self.run_dir, self.model_dir, self.token)
        self.client = EngineClient(self.top.router_url, admin_token=self.token)
        self.manager = RolloutManager(self.cfg.rollout, self.source, self.client, self.tokenizer, seed=self.cfg.seed,
                                      eval_prompts=self.evals, envs=self.cfg.envs)
        from furlong.cluster.supervisor import EngineSupervisor  # engine health, replacement, tolerant syncs

        self.supervisor = EngineSupervisor(self.top, self.cfg, self.token, self.run_dir, note=self.log.note)
        self.supervisor.start()
        self.version = 0
        self.step = 0
        from furlong.cluster.engine_stats import EngineStats
        from furlong.config.registry import resolve

        self.reward_post_fn = resolve(self.cfg, "rollout.reward_post_fn")
        self.after_save = resolve(self.cfg, "train.after_save")

        self.engine_stats = EngineStats(self.top.engine_urls)

    async def _sync_weights(self, version: int) -> dict:
        """Pause the engines, push the trainer's weights as `version`, continue."""
        t0 = time.perf_counter()
        report = await self.supervisor.sync_weights(version)  # pause, push to the engines that are up, continue
        self.version = version
        return {"weight_sync/seconds": time.perf_counter() - t0, **{f"weight_sync/{k}": v for k, v in report.items()
                                                                     if isinstance(v, (int, float))}}

    # ------------------------------------------------------------------ phases
    async def sft_warmup(self) -> None:
        steps = self.cfg.train.sft_steps
        if not steps or self.resume:
            return
        chat = self.cfg.data.apply_chat_template
        bs = self.cfg.train.global_batch_size
        source = sft_source(self.cfg, self.source)
        with self.log.progress("SFT warm-up", steps) as advance:
            for i in range(steps):
                prompts = source.next_batch(bs)
                m = await self.top.acall("sft_step", sft_samples(prompts, self.tokenizer, chat))
                advance(f"loss {m.get('loss', float('nan')):.3f}")
        await self._sync_weights(0)

    async def evaluate(self, label: str) -> dict[str, float]:
        if not self.evals:
            return {}
        metrics = await self.manager.evaluate(self.step)
        self.log.note(f"eval ({label}): " + " ".join(f"{k}={v:.3f}" for k, v in sorted(metrics.items())))
        return metrics

    def _save(self, step: int) -> None:
        path = self.run_dir / "checkpoints" / f"step_{step}"
        self.top.call("save", str(path))
        # The rollout state holds the data cursor, the buffer and in-flight partial rollouts.
        state = {"step": step, "version": self.version, "rollout": self.manager.state_dict(), "log": self.log.state_dict()}
        tmp = path / (DRIVER_STATE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.rename(path / DRIVER_STATE)  # written last: its presence marks the checkpoint complete
        if self.after_save is not None:
            self.after_save(step, str(path))
        keep = self.cfg.train.keep_checkpoints
        if keep:
            done = sorted((p for p in path.parent.glob("step_*") if (p / DRIVER_STATE).exists()),
                          key=lambda p: int(p.name.split("_")[1]))
            for old in done[:-keep]:
                import shutil

                shutil.rmtree(old, ignore_errors=True)

    async def _restore(self) -> None:
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            self.log.note("no complete checkpoint yet: starting from step 0")
            self.resume = False
            return
        state = json.loads((ckpt / DRIVER_STATE).read_text())
        self.step = await asyncio.to_thread(self.top.call, "load", str(ckpt))
        self.manager.load_state_dict(state["rollout"])
        self.log.load_state_dict(state.get("log", {}))
        self.step = state["step"]
        await self._sync_weights(state["version"])
        await self.manager.on_weights_updated(state["version"])
        self.log.note(f"resumed from {ckpt} at step {self.step}")

    async def train(self) -> dict[str, Any]:
        cfg = self.cfg
        total = cfg.train.total_steps
        every = cfg.train.checkpoint_every
        with self.log.progress("RL", total, start=self.step) as advance:
            while self.step < total:
                step = self.step
                n = step + 1  # the step's number in the event store and metrics.jsonl: 1..total
                t0 = time.perf_counter()
                span = self.log.store.span
                with span("driver", "generate", n):
                    batch = await self.manager.next_batch(step)
                if self.reward_post_fn is not None:  # reward shaping over the whole batch
                    for s, r in zip(batch, self.reward_post_fn(batch), strict=True):
                        s.reward = float(r)
                t_gen = time.perf_counter()
                trained = await self.top.acall("train_rollout", batch, step)
                self.log.store.record_span("trainer/0", "forward-backward", n, *trained["span"], device="cpu:0")
                per_opt = trained["metrics"]
                check_finite(per_opt, cfg.train.max_nonfinite_steps, step, self.log.note)  # stops after N NaN/inf in a row
                t_train = time.perf_counter()
                await self.manager.before_weight_sync()
                with span("driver", "weight-sync", n):
                    sync = await self._sync_weights(step + 1)
                self.step = step + 1
                if every and self.step % every == 0 and self.step < total:
                    await asyncio.to_thread(self._save, self.step)
                await self.manager.on_weights_updated(self.step)
                self.log.samples(step, batch, trained, step)
                metrics = self.log.step_metrics(batch, per_opt, self.manager.stats(), step)
                metrics.update(sync)
                metrics.update(await self.engine_stats.poll())
                metrics.update({"time/rollout_wait_s": t_gen - t0, "time/train_s": t_train - t_gen,
                                "time/step_s": time.perf_counter() - t0,
                                "perf/samples_per_s": len(batch) / (time.perf_counter() - t0)})
                t_eval = time.time()
                ev = await self.manager.maybe_evaluate(step)
                if ev:
                    self.log.store.record_span("driver", "eval", n, t_eval, time.time())
                    metrics.update(ev)
                self.log.write(self.step, metrics)
                advance(self.log.summary(self.step, metrics))
        await self.manager.before_weight_sync()
        await asyncio.to_thread(self._save, self.step)
        return {"steps": self.step}

    async def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self._prepare()
        try:
            await self._start()
            if self.resume:
                await self._restore()
            await self.sft_warmup()
            before = await self.evaluate("before RL") if self.step == 0 else {}
            result = await self.train()
            after = await self.evaluate("after RL")
            result.update(before={k: v for k, v in before.items()}, after=after,
                          minutes=(time.perf_counter() - t0) / 60, run_dir=str(self.run_dir),
                          rollout_stats=self.manager.stats(), supervisor=self.supervisor.stats())
            (self.run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
            return result
        finally:
            await self.close()

    async def close(self) -> None:
        if self.supervisor is not None:  # first: shutting the engines down is not a fault
            await self.supervisor.stop()
            self.supervisor = None
        if self.manager is not None:
            try:
                await self.manager.close()
            except Exception:
                pass
        if self.top is not None:
            await asyncio.to_thread(self.top.shutdown)
            self.top = None
        if self.dashboard is not None:
            self.dashboard.stop()
        if getattr(self, "log", None) is not None:
            self.log.close()


def load_run_config(run_dir: str | Path, overrides: list[str]) -> Any:
    from furlong.config import load_config

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise SystemExit(f"--resume: {path} does not exist (not a furlong run directory)")
    return load_config(str(path), overrides)


def main(argv: list[str]) -> int:
    from furlong.config import ConfigError, load_config

    p = argparse.ArgumentParser(prog="furlong train", description=__doc__.split("\n")[0])
    p.add_argument("recipe", nargs="?", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n_samples_per_prompt=8")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its directory alone")
    args = p.parse_args(argv)
    overrides = list(args.overrides)
    if args.recipe and "=" in args.recipe:
        overrides.insert(0, args.recipe)
        args.recipe = None
    try:
        cfg = load_run_config(args.resume, overrides) if args.resume else load_config(args.recipe, overrides)
    except ConfigError as e:
        print(f"furlong train: {e}", file=sys.stderr)
        return 2
    run = Run(cfg, resume=bool(args.resume))

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        result = asyncio.run(run_with_restarts(run))  # a dead trainer: clean stop, or auto-restart
    except RunStopped as e:
        print(f"furlong train: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("furlong train: interrupted; the run can continue with --resume " + str(run.run_dir), file=sys.stderr)
        return 130
    print(json.dumps({k: result[k] for k in ("steps", "before", "after", "minutes", "run_dir")}, default=str))
    return 0
