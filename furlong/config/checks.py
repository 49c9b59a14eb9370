"""Resolve what the user left unset, then reject every contradiction at start.

`resolve` fills derived fields (algorithm presets, the batch-size invariant, the
staleness implied by the rollout mode, the trainer's and engines' dtype from
`model.dtype`, run_dir), touching only fields absent from each section's
`model_fields_set`. `check` returns every cross-field problem at
once, each naming its dotted fields, so a user fixes a recipe in one pass instead
of discovering one error per run. A problem is `(fields, message)`.
"""

from __future__ import annotations

import functools
import importlib.util
import typing
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, Protocol

from furlong.config.checks_lora import check_lora

Problem = tuple[tuple[str, ...], str]


class ConfigView(Protocol):
    """What `resolve` and `check` read of a whole config; `schema.Config` is the one implementation.

    Declared here rather than imported: `schema.Config` calls these functions from its validator,
    so importing the schema back would close an import loop inside config/. The sections are read
    by attribute (`cfg.rollout.mode`); their types live in `schema.py`.
    """

    name: str
    run_dir: str
    model_fields_set: set[str]
    model: Any
    data: Any
    rollout: Any
    engine: Any
    train: Any
    algo: Any
    weights: Any
    cluster: Any
    observe: Any
    envs: Any


# Values each algorithm implies, applied only where the user did not set the field.
# The schema's own defaults are GRPO's, so a preset lists only what differs or matters.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {"algo": {"advantage": "grpo", "norm_adv_by_std": True, "loss_reducer": "sample_mean"}},
    "dr_grpo": {"algo": {"advantage": "dr_grpo", "norm_adv_by_std": False, "loss_reducer": "constant"}},
    "gspo": {
        "algo": {
            "advantage": "grpo",
            "ratio_type": "sequence",
            "clip_eps_low": 3e-4,
            "clip_eps_high": 4e-4,
            "loss_reducer": "sample_mean",
        }
    },
    "dapo": {
        "algo": {"advantage": "grpo", "clip_eps_low": 0.2, "clip_eps_high": 0.28, "loss_reducer": "token_mean"},
        "rollout": {"dynamic_filter": True},
    },
    "rloo": {"algo": {"advantage": "rloo", "norm_adv_by_std": False, "loss_reducer": "sample_mean"}},
    "reinforce_pp": {"algo": {"advantage": "reinforce_pp", "loss_reducer": "token_mean", "kl_in_reward": True}},
    "reinforce_pp_baseline": {"algo": {"advantage": "reinforce_pp_baseline", "loss_reducer": "token_mean"}},
    "ppo": {"algo": {"advantage": "gae", "loss_reducer": "token_mean"}},
    "sft": {"algo": {"advantage": "none", "loss_reducer": "token_mean"}},
    "distill": {"algo": {"advantage": "none", "loss_reducer": "token_mean"}},
}

# The four batch fields, in the order a missing one is derived when fewer than three are given.
BATCH_FIELDS = (
    ("train", "global_batch_size"),
    ("train", "num_steps_per_rollout"),
    ("rollout", "rollout_batch_size"),
    ("rollout", "n_samples_per_prompt"),
)
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")

# A field left unset takes another field's value: (field, the field it defaults to). `model.dtype` is
# the dtype the weights are loaded in for training and rollout; `train.dtype` and `engine.dtype` set
# one side apart. The scan for settings nothing reads (tools/schema_readers.py) counts a source here
# as read wherever its field is read, so keep this a literal table.
DEFAULTS_FROM: tuple[tuple[str, str], ...] = (
    ("train.dtype", "model.dtype"),
    ("engine.dtype", "model.dtype"),
)

# Settings the schema accepts for features not built yet: (field, is it in use?, what it would build).
# Refused at start, naming the field, rather than silently ignored; tools/schema_readers.py counts a
# field named here as read (the user is told), so keep this a literal table and drop a row once the
# feature is built.
NOT_BUILT: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("rollout.rollout_fn", lambda v: v is not None, "replacing the whole rollout step"),
)


@functools.cache
def cuda_available() -> bool:
    """Imported lazily: only configs that ask for a GPU pay for importing torch."""
    import torch

    return torch.cuda.is_available()


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _set(cfg: ConfigView, section: str, field: str) -> bool:
    return field in getattr(cfg, section).model_fields_set


def _value(cfg: ConfigView, dotted: str) -> Any:
    section, field = dotted.split(".")
    return getattr(getattr(cfg, section), field)


def _choices(cfg: ConfigView, dotted: str) -> tuple[Any, ...]:
    """The values a Literal field admits (empty for any other field)."""
    section, field = dotted.split(".")
    annotation = type(getattr(cfg, section)).model_fields[field].annotation
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()


def resolve(cfg: ConfigView) -> list[Problem]:
    """Fill derived fields in place; returns problems found while deriving."""
    if "run_dir" not in cfg.model_fields_set:
        cfg.run_dir = f"runs/{cfg.name}"
    for section, values in PRESETS[cfg.algo.name].items():
        for field, value in values.items():
            if not _set(cfg, section, field):
                setattr(getattr(cfg, section), field, value)
    algo, ro, data = cfg.algo, cfg.rollout, cfg.data
    if algo.loss_reducer == "constant" and algo.reducer_constant is None:
        algo.reducer_constant = float(ro.max_new_tokens)
    if not _set(cfg, "rollout", "max_staleness"):
        ro.max_staleness = 0 if ro.mode == "sync" else 1
    if (data.path is not None or data.mix) and not _set(cfg, "data", "task"):
        data.task = None
    if data.eval_path is None and not _set(cfg, "data", "eval_task"):
        data.eval_task = data.task
    if ro.routing_replay and cfg.train.compile == "auto":
        cfg.train.compile = False  # a compiled layer would not run R3's replay hooks (train/compiled.py)
    if cfg.engine.backend == "sglang" and not _set(cfg, "weights", "transport"):
        cfg.weights.transport = "broadcast"  # SGLang's own sync path (the default shm is furlong's engine only)
    return _resolve_defaults_from(cfg) + _resolve_batch(cfg)


def _resolve_defaults_from(cfg: ConfigView) -> list[Problem]:
    """Each unset field of `DEFAULTS_FROM` takes its source's value, when that value is one the field admits."""
    problems: list[Problem] = []
    for dotted, source in DEFAULTS_FROM:
        section, field = dotted.split(".")
        if _set(cfg, section, field):
            continue
        value, choices = _value(cfg, source), _choices(cfg, dotted)
        if choices and value not in choices:
            problems.append(
                (
                    (source, dotted),
                    f"{source}={value} cannot be {dotted}, which takes {' or '.join(map(str, choices))}: set {dotted}",
                )
            )
        else:
            setattr(getattr(cfg, section), field, value)
    return problems


def _resolve_batch(cfg: ConfigView) -> list[Problem]:
    """Invariant: rollout_batch_size × n_samples_per_prompt = global_batch_size × num_steps_per_rollout."""
    dotted = [f"{s}.{f}" for s, f in BATCH_FIELDS]
    value = {d: getattr(getattr(cfg, s), f) for d, (s, f) in zip(dotted, BATCH_FIELDS)}
    unset = [d for d, (s, f) in zip(dotted, BATCH_FIELDS) if not _set(cfg, s, f)]
    gbs, steps, rbs, n = dotted

    def show(d: str) -> str:
        return f"{d}={value[d]}" + (" (default)" if d in unset else "")

    if not unset:
        if value[rbs] * value[n] != value[gbs] * value[steps]:
            return [
                (
                    tuple(dotted),
                    f"{rbs} × {n} must equal {gbs} × {steps}: {show(rbs)} × {show(n)} = {value[rbs] * value[n]} "
                    f"samples per step, but {show(gbs)} × {show(steps)} = {value[gbs] * value[steps]}; "
                    "change one, or leave one unset to derive it",
                )
            ]
        return []
    target = unset[0]
    produced = Fraction(value[rbs] * value[n])
    derived = {
        gbs: produced / value[steps],
        steps: produced / value[gbs],
        rbs: Fraction(value[gbs] * value[steps], value[n]),
        n: Fraction(value[gbs] * value[steps], value[rbs]),
    }[target]
    if derived.denominator != 1 or derived < 1:
        used = ", ".join(show(d) for d in dotted if d != target)
        return [
            (
                tuple(dotted),
                f"cannot derive {target} from {used}: {rbs} × {n} = {gbs} × {steps} gives {target}="
                f"{float(derived):g}, not a positive integer; set it, or change the others",
            )
        ]
    section, field = BATCH_FIELDS[dotted.index(target)]
    setattr(getattr(cfg, section), field, int(derived))
    return []


Bad = Callable[[tuple[str, ...], str], None]  # records one problem: (fields, message)


def check(cfg: ConfigView) -> list[Problem]:
    """Every cross-field contradiction of a resolved config, all at once, in a stable order."""
    out: list[Problem] = []
    parts = (_check_rollout, _check_algo, _check_train, _check_not_built, _check_hardware, _check_data, _check_sglang)
    for part in parts:
        part(cfg, lambda fields, msg: out.append((fields, msg)))
    return out


def _check_rollout(cfg: ConfigView, bad: Bad) -> None:
    """The async spectrum, multi-turn and routing replay."""
    ro = cfg.rollout
    if ro.partial_rollout and ro.mode == "sync":
        bad(
            ("rollout.partial_rollout", "rollout.mode"),
            "rollout.partial_rollout=true needs rollout.mode=async or overlap "
            "(got sync: nothing is in flight at a weight sync)",
        )
    if ro.mode == "sync" and ro.max_staleness > 0:
        bad(
            ("rollout.max_staleness", "rollout.mode"),
            f"rollout.max_staleness={ro.max_staleness} needs rollout.mode=async or overlap "
            "(sync is always 0 versions stale)",
        )
    if ro.mode == "overlap" and ro.max_staleness == 0:
        bad(
            ("rollout.max_staleness", "rollout.mode"),
            "rollout.mode=overlap generates batch k+1 while training on batch k, so samples are 1 version stale: "
            "rollout.max_staleness=0 contradicts it (use mode=sync, or async with max_staleness=0)",
        )
    if ro.max_turns > 1 and not (
        cfg.envs.name or cfg.envs.environment or cfg.envs.tools or ro.agent_fn or ro.generate_fn or ro.rollout_fn
    ):
        bad(
            ("rollout.max_turns",),
            f"rollout.max_turns={ro.max_turns} but nothing produces a second turn: set envs.name, envs.environment, "
            "envs.tools, rollout.agent_fn, rollout.generate_fn or rollout.rollout_fn",
        )
    if cfg.engine.eval_num_engines != 1 and ro.eval_mode != "dedicated":  # 1: the default a saved config holds
        why = f"engine.eval_num_engines is the engines of rollout.eval_mode=dedicated (got {ro.eval_mode})"
        bad(("engine.eval_num_engines", "rollout.eval_mode"), why)
    if ro.eval_mode == "dedicated" and cfg.cluster.colocate:  # its engines need bundles; colocate has none
        why = "rollout.eval_mode=dedicated starts engines of its own; cluster.colocate runs one inside the trainer"
        bad(("rollout.eval_mode", "cluster.colocate"), why + " (use eval_mode=async)")
    if cfg.cluster.lend_idle_cores and cfg.cluster.share_cores:
        why = "cluster.lend_idle_cores lends the trainer's share of split cores; cluster.share_cores splits none (choose one)"
        bad(("cluster.lend_idle_cores", "cluster.share_cores"), why)
    if cfg.cluster.borrow_idle_cores and cfg.cluster.share_cores:
        why = "cluster.borrow_idle_cores lends the engines' share of split cores; cluster.share_cores splits none (choose one)"
        bad(("cluster.borrow_idle_cores", "cluster.share_cores"), why)
    no_experts = cfg.model.path is None and cfg.model.arch not in ("qwen3_moe", "mixtral")  # a path: the engine checks
    for field, broken, why in (  # R3 needs experts, engines that record routes, no recompute (routing_replay.py)
        ("model.arch", no_experts, f"model.arch={cfg.model.arch} has no experts"),
        ("engine.backend", cfg.engine.backend == "sglang", "engine.backend=sglang does not record routes yet"),
        ("train.gradient_checkpointing", cfg.train.gradient_checkpointing, "checkpoint recompute skips replay"),
        ("train.compile", cfg.train.compile is True, "train.compile=true: a compiled layer does not run its hooks"),
    ):
        if ro.routing_replay and broken:
            bad(("rollout.routing_replay", field), f"rollout.routing_replay=true replays MoE expert routing; {why}")


def _check_algo(cfg: ConfigView, bad: Bad) -> None:
    """The algorithm and its estimator, ratio, reducer and correction."""
    algo, ro = cfg.algo, cfg.rollout
    if algo.name == "ppo" and algo.advantage != "gae":
        bad(("algo.name", "algo.advantage"), f"algo.name=ppo needs algo.advantage=gae (got {algo.advantage})")
    if algo.advantage == "gae" and algo.name != "ppo":
        bad(
            ("algo.advantage", "algo.name"),
            f"algo.advantage=gae needs a critic, which only algo.name=ppo trains (got {algo.name})",
        )
    if algo.name in ("sft", "distill") and algo.advantage != "none":
        bad(
            ("algo.advantage", "algo.name"),
            f"algo.name={algo.name} uses no advantage estimator; algo.advantage must be none",
        )
    if algo.name == "sft" and ro.eval_mode == "async":  # an SFT run starts no rollout engines to share with eval
        why = "algo.name=sft starts no rollout engines for rollout.eval_mode=async to share"
        bad(
            ("rollout.eval_mode", "algo.name"), why + " (blocking: teacher-forced eval only; dedicated: + eval engines)"
        )
    if algo.name not in ("sft", "distill") and algo.advantage == "none":
        bad(
            ("algo.advantage", "algo.name"),
            f"algo.advantage=none gives every token zero advantage, so algo.name={algo.name} would learn nothing",
        )
    if algo.advantage == "dr_grpo" and algo.norm_adv_by_std:
        bad(
            ("algo.norm_adv_by_std", "algo.advantage"),
            "algo.advantage=dr_grpo never divides by the group std; algo.norm_adv_by_std=true contradicts it",
        )
    if algo.name == "gspo" and algo.ratio_type != "sequence":
        bad(
            ("algo.ratio_type", "algo.name"),
            "algo.name=gspo is defined by a sequence-level ratio; algo.ratio_type must be sequence",
        )
    if algo.reducer_constant is not None and algo.loss_reducer != "constant":
        bad(
            ("algo.reducer_constant", "algo.loss_reducer"),
            f"algo.reducer_constant is only used by algo.loss_reducer=constant (got {algo.loss_reducer})",
        )
    if algo.correction != "none" and algo.correction_low >= algo.correction_high:
        bad(
            ("algo.correction_low", "algo.correction_high"),
            f"algo.correction_low={algo.correction_low} must be below algo.correction_high={algo.correction_high}",
        )
    needs_groups = algo.advantage in GROUP_ADVANTAGES or ro.dynamic_filter
    if needs_groups and algo.name not in ("sft", "distill") and ro.n_samples_per_prompt < 2:
        why = (
            "rollout.dynamic_filter=true drops"
            if ro.dynamic_filter
            else f"algo.advantage={algo.advantage} gives zero advantage to"
        )
        bad(
            ("rollout.n_samples_per_prompt", "rollout.dynamic_filter" if ro.dynamic_filter else "algo.advantage"),
            f"rollout.n_samples_per_prompt=1: {why} every group of one sample; use 2 or more",
        )


def _check_train(cfg: ConfigView, bad: Bad) -> None:
    """The schedule and what a weight transport can carry."""
    tr = cfg.train
    total_opt = tr.total_steps * tr.num_steps_per_rollout
    if tr.warmup_steps > total_opt:
        bad(
            ("train.warmup_steps", "train.total_steps"),
            f"train.warmup_steps={tr.warmup_steps} exceeds the run's {total_opt} optimiser steps "
            f"(train.total_steps={tr.total_steps} × train.num_steps_per_rollout={tr.num_steps_per_rollout})",
        )
    check_lora(cfg, bad)  # train.lora and multi-LoRA (checks_lora.py)


def _check_not_built(cfg: ConfigView, bad: Bad) -> None:
    """Settings the schema accepts but nothing builds yet (`NOT_BUILT`): refused rather than silently ignored."""
    for field, used, what in NOT_BUILT:
        if used(_value(cfg, field)):
            bad((field,), f"{field}: {what} is not built yet; remove the setting (see docs/features.yaml for status)")
    if cfg.algo.name == "distill" and cfg.algo.teacher_path is None:
        bad(
            ("algo.name", "algo.teacher_path"),
            "algo.name=distill scores every sample with a teacher: set algo.teacher_path to its local HF model dir",
        )
    if cfg.algo.teacher_path is not None and cfg.algo.name != "distill":
        bad(
            ("algo.teacher_path", "algo.name"),
            f"algo.teacher_path is read only by algo.name=distill (got {cfg.algo.name}); remove it or set algo.name",
        )
    if cfg.algo.name == "distill" and cfg.rollout.temperature != 1.0:
        bad(
            ("algo.name", "rollout.temperature"),
            "algo.name=distill: the teacher scores at temperature 1, so the student must sample at "
            f"rollout.temperature=1 (got {cfg.rollout.temperature}) for the two log-probs to compare",
        )


# What SGLang's HTTP API has no endpoint for: furlong's shared-memory handle body (shm, delta) and its per-shard
# p2p protocol; weights.verify reads every tensor's CRC32 from /get_weights_checksum, which SGLang does not serve.
SGLANG_TRANSPORTS = ("broadcast", "disk")


def _check_sglang(cfg: ConfigView, bad: Bad) -> None:
    """Settings `engine.backend=sglang` cannot honour, each refused naming the fields."""
    if cfg.engine.backend != "sglang":
        return
    if cfg.weights.transport not in SGLANG_TRANSPORTS:
        bad(
            ("engine.backend", "weights.transport"),
            f"engine.backend=sglang: weights.transport={cfg.weights.transport} needs an endpoint only the built-in "
            f"engine has; use weights.transport={' or '.join(SGLANG_TRANSPORTS)} "
            "(SGLang's update_weights_from_distributed / update_weights_from_disk)",
        )
    if cfg.weights.verify:
        bad(
            ("engine.backend", "weights.verify"),
            "engine.backend=sglang: weights.verify=true compares every engine tensor's CRC32 "
            "(/get_weights_checksum), which SGLang does not serve; set weights.verify=false",
        )
    if (q := cfg.engine.quantization) != "none":  # codes + scales at sync: the built-in engine's store only
        why = f"engine.quantization={q} is built for the built-in engine, not yet for SGLang; set it to none"
        bad(("engine.backend", "engine.quantization"), f"engine.backend=sglang: {why}")


def _check_hardware(cfg: ConfigView, bad: Bad) -> None:
    """GPUs and optional packages the settings need."""
    tr, eng = cfg.train, cfg.engine
    gpu_users = []
    if tr.backend == "nccl":
        gpu_users.append(("train.backend", "train.backend=nccl"))
        if cfg.weights.transport == "broadcast":
            gpu_users.append(("weights.transport", "weights.transport=broadcast over it"))
    if cfg.weights.transport == "cuda_ipc":
        gpu_users.append(("weights.transport", "weights.transport=cuda_ipc"))
        if cfg.cluster.colocate:
            bad(
                ("weights.transport", "cluster.colocate"),
                "weights.transport=cuda_ipc opens the trainer's GPU memory from another process; with "
                "cluster.colocate the engine is in the trainer's own process (CUDA cannot open its own IPC handle)",
            )
    if eng.backend == "sglang" and eng.device != "cpu":  # SGLang's CPU backend (--device cpu) needs no GPU
        gpu_users.append(("engine.backend", "engine.backend=sglang"))
    if (
        eng.device.startswith("cuda") and cfg.cluster.address is None
    ):  # a cluster's nodes may have GPUs the driver lacks
        gpu_users.append(("engine.device", f"engine.device={eng.device}"))
    if cfg.cluster.address is None and (cfg.cluster.num_gpus or 0) > 0:
        gpu_users.append(("cluster.num_gpus", f"cluster.num_gpus={cfg.cluster.num_gpus} on a local Ray"))
    on_cpu = eng.device == "cpu" or (eng.device == "auto" and cfg.cluster.address is None and not cuda_available())
    if eng.cuda_graphs and (eng.backend == "sglang" or on_cpu):  # the built-in engine's own graphs (engine/graphs.py)
        why = "SGLang captures its own" if eng.backend == "sglang" else f"engine.device={eng.device} is the CPU here"
        bad(
            ("engine.cuda_graphs", "engine.backend" if eng.backend == "sglang" else "engine.device"),
            f"engine.cuda_graphs=true replays the built-in engine's decode as CUDA graphs, but {why}: set "
            "engine.cuda_graphs=false, or run the built-in engine with engine.device=cuda[:N] on a GPU machine",
        )
    if eng.compile and (eng.backend == "sglang" or eng.cuda_graphs):  # one way to run the built-in decode step
        other = "engine.backend" if eng.backend == "sglang" else "engine.cuda_graphs"
        bad(
            ("engine.compile", other),
            f"engine.compile=true compiles the built-in engine's decode step, but {other} "
            f"{'is sglang, which has its own' if other == 'engine.backend' else 'already replays it as CUDA graphs'}: "
            "set one of them",
        )
    if gpu_users and not cuda_available():
        bad(
            tuple(f for f, _ in gpu_users),
            f"{' and '.join(m for _, m in gpu_users)} {'needs' if len(gpu_users) == 1 else 'need'} a CUDA GPU, "
            "and none is visible "
            "(on CPU use train.backend=gloo or auto, engine.backend=builtin)",
        )
    if eng.backend == "sglang" and not installed("sglang"):
        bad(
            ("engine.backend",),
            "engine.backend=sglang but the sglang package is not installed (pip install 'furlong[gpu]')",
        )
    for flag in ("wandb", "mlflow"):
        if getattr(cfg.observe, flag) and not installed(flag):
            bad((f"observe.{flag}",), f"observe.{flag}=true but the {flag} package is not installed")
    if cfg.observe.dashboard and not cfg.observe.event_store:
        bad(
            ("observe.dashboard", "observe.event_store"),
            "observe.dashboard=true reads the event store; set observe.event_store=true",
        )


def _check_data(cfg: ConfigView, bad: Bad) -> None:
    """Data, eval data, environments and the files they name."""
    algo, ro, data = cfg.algo, cfg.rollout, cfg.data
    if data.path is not None and data.task is not None:
        bad(("data.path", "data.task"), "set one of data.path and data.task, not both")
    if data.path is None and data.task is None and not data.mix and algo.name != "distill":
        bad(("data.path", "data.task"), "no training data: set data.path or data.task")
    if data.eval_path is not None and data.eval_task is not None:
        bad(("data.eval_path", "data.eval_task"), "set one of data.eval_path and data.eval_task, not both")
    if ro.eval_every > 0 and data.eval_path is None and data.eval_task is None and not data.mix:
        bad(
            ("rollout.eval_every", "data.eval_path"),
            f"rollout.eval_every={ro.eval_every} but there is no eval data: set data.eval_path or data.eval_task",
        )
    if cfg.envs.name and cfg.envs.environment:
        bad(
            ("envs.name", "envs.environment"), "set one of envs.name (built-in) and envs.environment (custom), not both"
        )
    for field, value, kind in (
        ("model.path", cfg.model.path, "dir"),
        ("data.path", data.path, "any"),
        ("data.eval_path", data.eval_path, "any"),
    ):
        if value is None:
            continue
        p = Path(value).expanduser()
        if not p.exists():
            bad((field,), f"{field}: {value!r} does not exist (relative paths are relative to {Path.cwd()})")
        elif kind == "dir" and not p.is_dir():
            bad((field,), f"{field}: {value!r} is not a directory")
