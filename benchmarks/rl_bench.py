"""Shared by the RL benchmarks (`vs_trl.py`, `async_speedup.py`): one fixed amount of GRPO work,
run by furlong's real driver (`furlong.driver.run.Run`: Ray, router, engine process, trainer actor,
weight sync), and its steady-state throughput read back from the run's `metrics.jsonl`.

What is timed: the driver writes one `metrics.jsonl` line per RL step, stamped with the wall
clock when the step ended (rollout + train + weight sync + logging). The steady-state window
runs from the end of the last warm-up step to the end of the last step, so it excludes Ray and
engine start-up, model building/loading, the warm-up step(s), the before/after eval and the
final checkpoint. samples/s = samples trained in the window / window seconds.

Every response is exactly `new_tokens` long (`ignore_eos`, via the `generate_fn` plug point
below), so every system and mode does the same token work whatever the random model samples.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from furlong.core.sample import Sample, Source, Status
from furlong.rollout.generate import RolloutContext, generate

MODES = ("sync", "overlap", "async")


async def exact_length_generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """The default generate function with end-of-sequence ignored: responses are exactly max_new_tokens long."""
    return await generate(ctx, sample, {**sampling_params, "ignore_eos": True})


TOOL_TURNS = 4  # tool calls per episode of the environment-latency workload
TOOL_LATENCY_S = (0.1, 0.3)


async def env_latency_generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """An agentic episode with environment latency: the response's `max_new_tokens` policy tokens come in
    TOOL_TURNS + 1 turns, and between turns a tool call takes 100-300 ms (a sleep standing in for a
    calculator or a sandboxed interpreter) and answers with 4 tool tokens (loss-masked). The token work
    equals `exact_length_generate`'s; what differs is the waiting, which only overlap/async can hide."""
    total = int(sampling_params["max_new_tokens"])
    per_turn = max(1, total // (TOOL_TURNS + 1))
    rng = random.Random(sum(sample.tokens[: sample.prompt_length]) * 7919 + sample.prompt_length)
    policy = lambda: sum(1 for src in sample.token_sources if src == Source.POLICY)
    for turn in range(TOOL_TURNS + 1):
        want = total if turn == TOOL_TURNS else min(total, policy() + per_turn)
        budget = sample.response_length + (want - policy())
        if want <= policy():
            continue
        await generate(ctx, sample, {**sampling_params, "ignore_eos": True, "max_new_tokens": budget})
        if Status(sample.status) == Status.ABORTED or turn == TOOL_TURNS:
            return sample
        await asyncio.sleep(rng.uniform(*TOOL_LATENCY_S))  # the tool call
        sample.append(sample.tokens[:4], source=Source.TOOL)
    return sample


@dataclass(frozen=True)
class Work:
    """The GRPO work every system and mode is given."""

    size: str = "m25"
    task: str = "arithmetic"
    prompts: int = 8  # per step
    group: int = 8  # samples per prompt
    new_tokens: int = 64  # exactly, per sample
    steps: int = 3  # timed steps
    warmup: int = 1  # untimed steps before them
    lr: float = 1e-5
    threads: int = 2  # cores given to the whole system
    n_train: int = 256  # prompt pool
    seed: int = 0
    generate_fn: str = "rl_bench:exact_length_generate"  # or rl_bench:env_latency_generate

    @property
    def samples_per_step(self) -> int:
        return self.prompts * self.group


def furlong_overrides(work: Work, mode: str, run_dir: Path) -> list[str]:
    """The config of one furlong run: `furlong train` with these overrides does the same work."""
    return [
        f"name=bench-{mode}",
        f"run_dir={run_dir}",
        f"seed={work.seed}",
        "model.arch=qwen3",
        f"model.size={work.size}",
        f"data.task={work.task}",
        f"data.n_train={work.n_train}",
        "data.n_eval=1",
        f"rollout.mode={mode}",
        f"rollout.rollout_batch_size={work.prompts}",
        f"rollout.n_samples_per_prompt={work.group}",
        f"rollout.max_new_tokens={work.new_tokens}",
        f"rollout.generate_fn={work.generate_fn}",
        f"train.global_batch_size={work.samples_per_step}",
        "train.num_steps_per_rollout=1",
        f"train.total_steps={work.warmup + work.steps}",
        f"train.lr={work.lr}",
        f"cluster.num_cpus={work.threads}",
        "observe.tensorboard=false",
    ]


def steady_state(rows: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """samples/s over the steps after `warmup`, and the mean per-step time split the driver logs.

    Only RL-step rows count (those with `rollout/samples`): the driver also writes other rows per
    step (e.g. the timeline's own `time/timeline_*` costs) that are no step of their own."""
    rows = [r for r in rows if "rollout/samples" in r]
    if len(rows) <= warmup or warmup < 1:
        raise ValueError(f"need at least {warmup + 1} logged steps with warmup >= 1, got {len(rows)}")
    timed = rows[warmup:]
    # From the first timed step's start to the last one's end, by the driver's clock. Not the rows'
    # `time`: a row is written when its step's spans are in (in the background, during the next
    # step), so that lag differs between modes and once made fully async look 16% faster.
    start = timed[0]["time/started_unix"]
    window = timed[-1]["time/started_unix"] + timed[-1]["time/step_s"] - start
    samples = sum(r["rollout/samples"] for r in timed)

    def mean(key: str) -> float:
        vals = [r[key] for r in timed if r.get(key) is not None]
        return statistics.fmean(vals) if vals else float("nan")

    step_s = window / len(timed)
    parts = {
        "rollout_wait_s": mean("time/rollout_wait_s"),
        "train_s": mean("time/train_s"),
        "weight_sync_s": mean("weight_sync/seconds"),
    }
    return {
        "samples_per_s": samples / window,
        "window_s": window,
        "samples": samples,
        "step_s": step_s,
        **parts,
        "other_s": step_s - sum(parts.values()),
        "response_len_mean": mean("rollout/response_len_mean"),
        "window_start_unix": start,
    }


def busy_per_step(run_dir: Path, start: float, window: float, steps: int) -> dict[str, float]:
    """Seconds per timed step the engines and the trainer ranks computed, from the run's timeline: the union
    of their work spans (`observe.balance`'s phases) inside the steady-state window, per kind.

    Why: on cores the two take turns on, a step can take no less than engine work + trainer work. Measured in
    a sync run, `ceiling` (sync step / that sum) is the most any overlap of the two can gain there; what the
    rest of a sync step is (tool latency, a step's stragglers) is what async can hide. `engine_prefill_s` and
    `engine_decode_s` split the engines' seconds (summed over engines) between steps that prefill something
    (eager, and in agent episodes every turn) and decode-only steps (the compiled step with `engine.compile`)."""
    from furlong.observe.balance import ENGINE_WORK, TRAINER_WORK, _union
    from furlong.observe.reader import RunReader

    end = start + window
    spans: dict[str, list[tuple[float, float]]] = {"engine": [], "trainer": []}
    by_phase = dict.fromkeys(ENGINE_WORK, 0.0)  # engine seconds in steps with a prefill / decode-only steps
    for lane in RunReader(run_dir).timeline(limit=1_000_000)["lanes"]:
        kind = lane["worker"].split("/")[0]
        work = {"engine": ENGINE_WORK, "trainer": TRAINER_WORK}.get(kind, ())
        for sp in lane["spans"]:
            if sp["phase"] in work and sp["end"] > start and sp["start"] < end:
                spans[kind].append((max(sp["start"], start), min(sp["end"], end)))
                if kind == "engine":
                    by_phase[sp["phase"]] += spans[kind][-1][1] - spans[kind][-1][0]
    busy = {f"{kind}_busy_s": _union(iv) / steps for kind, iv in spans.items()}
    phases = {f"engine_{phase}_s": s / steps for phase, s in by_phase.items()}
    return {**busy, **phases, "ceiling": window / steps / max(1e-9, sum(busy.values()))}


def run_furlong(work: Work, mode: str, run_dir: Path | None = None, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """Run furlong in `mode` on `work` in this process tree and return its steady-state figures.

    `extra`: more `key=value` overrides, for trying a setting on the same work (e.g. `train.micro_batch_tokens=512`)."""
    from furlong.config import load_config
    from furlong.driver.run import Run

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if run_dir is None:  # a throw-away run: its checkpoint alone is hundreds of MB at m25
        with tempfile.TemporaryDirectory(prefix=f"furlong-bench-{mode}-") as tmp:
            return run_furlong(work, mode, Path(tmp), extra)
    run_dir = Path(run_dir)
    cfg = load_config(None, [*furlong_overrides(work, mode, run_dir), *extra])
    asyncio.run(Run(cfg, progress=False).run())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # Groups generated again because their weights fell out of `max_staleness` (whole run, warm-up included):
    # wasted token work the samples/s figure hides, so it is reported beside it.
    stats = json.loads((run_dir / "result.json").read_text())["rollout_stats"]
    steady = steady_state(rows, work.warmup)
    busy = busy_per_step(run_dir, steady["window_start_unix"], steady["window_s"], work.steps)
    return {**steady, **busy, "stale_regenerations": stats["regenerated"].get("stale", 0)}


def median_run(fn: Callable[[], dict[str, float]], runs: int) -> dict[str, float]:
    """The figures of the median run (by samples/s) of `runs` runs of `fn`; `all_samples_per_s` lists every run."""
    return _median([fn() for _ in range(max(1, runs))])


def median_rounds(
    fns: dict[str, Callable[[], dict[str, float]]], runs: int, done: Callable[[str, dict], None] = lambda n, r: None
) -> dict[str, dict[str, float]]:
    """`median_run` of every entry of `fns`, run in rounds (each entry once per round, `done` told after each run).

    Why rounds: a shared machine's speed drifts by 10-20% over minutes (other tenants' load), and runs of one
    mode after another would give that drift to whichever mode ran in the slow minutes; in rounds every mode
    meets it alike. Each result's `round_samples_per_s` lists its runs in round order, so ratios between
    modes can be read round by round."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in fns}
    for _ in range(max(1, runs)):
        for name, fn in fns.items():
            results[name].append(fn())
            done(name, results[name][-1])
    return {
        name: {**_median(rs), "round_samples_per_s": [r["samples_per_s"] for r in rs]} for name, rs in results.items()
    }


def _median(results: list[dict[str, float]]) -> dict[str, float]:
    results = sorted(results, key=lambda r: r["samples_per_s"])
    return {**results[len(results) // 2], "all_samples_per_s": [r["samples_per_s"] for r in results]}


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def breakdown(name: str, r: dict[str, float]) -> str:
    """One line: where a furlong step's wall time went, as the driver sees it."""
    return (
        f"  {name:<15} step {r['step_s']:6.2f} s = rollout wait {r['rollout_wait_s']:6.2f} + train {r['train_s']:6.2f}"
        f" + weight sync {r['weight_sync_s']:5.2f} + other {r['other_s']:5.2f}"
        f"; stale groups regenerated {r.get('stale_regenerations', 0):g}"
        + (
            f"\n  {'':<15} computing: engines {r['engine_busy_s']:6.3f} s (steps with a prefill "
            f"{r.get('engine_prefill_s', 0):.3f}, decode-only {r.get('engine_decode_s', 0):.3f}), "
            f"trainer {r['trainer_busy_s']:6.3f} s a step"
            if "engine_busy_s" in r
            else ""
        )
    )
