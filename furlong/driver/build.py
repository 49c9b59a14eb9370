"""The composition root: every component of a run, built once, from its typed config section.

torchtune's recipe is `setup(cfg); train(); cleanup()`: one place reads the config.
Here that place is this module. At the start of `furlong train` it

1. resolves and checks every plug point at once (`registry.load_all`): a typo in any
   dotted path, or a function whose signature does not fit, fails before a process
   starts, listing every bad path in one error;
2. builds each component from its own section plus the resolved functions it calls:
   the topology (cluster, engine, router sections; the trainer's train and algo
   sections with `TrainerHooks`), the rollout manager (rollout section, reward,
   filter and post-process functions), the supervisor (router and weights sections),
   the metric log (observe section, sink factories).

No component reads a dotted path or the whole config; `registry.resolve` and
`load_all` are called here only. A plug point the config leaves unset is passed as
None, so each component uses its built-in (the same function the registry names as
the default, or, for a loss-hub plug point, the one `algo.*` names).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.config import registry

if TYPE_CHECKING:
    from furlong.cluster.supervisor import EngineSupervisor
    from furlong.cluster.topology import Topology
    from furlong.config.schema import Config, ModelConfig
    from furlong.core.client import EngineClient
    from furlong.core.version import WeightVersion
    from furlong.driver.metrics import MetricLog
    from furlong.rollout.manager import RolloutManager
    from furlong.train.hooks import TrainerHooks

# Plug points the rollout manager takes as resolved functions (keyword argument -> config key).
MANAGER_PLUGS = {  # written out: the dotted keys are how tools/schema_readers sees these settings read
    "generate_fn": "rollout.generate_fn",
    "reward_fn": "rollout.reward_fn",
    "group_reward_fn": "rollout.group_reward_fn",
    "dynamic_filter_fn": "rollout.dynamic_filter_fn",
    "sample_filter_fn": "rollout.sample_filter_fn",
    "reward_post_fn": "rollout.reward_post_fn",
    "eval_fn": "rollout.eval_fn",
}
# The trainer's plug points (`TrainerHooks` field -> config key); unset ones stay None: the algorithm's built-ins.
TRAINER_PLUGS = {
    "loss_fn": "train.loss_fn",
    "advantage_fn": "train.advantage_fn",
    "correction_fn": "train.correction_fn",
    "reducer_fn": "train.reducer_fn",
    "convert_fn": "train.convert_fn",
    "before_train_step": "train.before_train_step",
}


def plugins(cfg: Config) -> dict[str, Any]:
    """Config key -> resolved function for every plug point the config sets (None, or [] for lists, if unset).

    Every plug point is loaded and checked, defaults included, so a broken default fails here too.
    """
    loaded = registry.load_all(cfg)
    out: dict[str, Any] = {}
    for point in registry.PLUG_POINTS:
        section, field = point.key.split(".")
        value = getattr(getattr(cfg, section), field)
        if point.many:
            out[point.key] = list(loaded[point.key])
        else:
            out[point.key] = loaded[point.key] if value is not None else None
    return out


def model_dir(model: ModelConfig) -> str:
    """The policy's HF directory: `model.path`, or a tiny model built locally (cached) from arch + size."""
    from furlong.models import create_model

    return model.path or str(create_model(model.arch, model.size, seed=model.seed, max_positions=model.max_positions))


def metric_log(cfg: Config, run_dir: Path, tokenizer: Any, plugs: dict[str, Any]) -> MetricLog:
    from furlong.driver.metrics import MetricLog

    sinks = [make(config=cfg) for make in plugs["observe.sinks"]]
    return MetricLog(run_dir, cfg.observe, cfg.model_dump(), tokenizer, extra_sinks=sinks)


def trainer_hooks(plugs: dict[str, Any]) -> TrainerHooks:
    """The trainer's plug points the config sets (`train.loss_fn`, ...) as `TrainerHooks` (failures name their keys)."""
    from furlong.train.hooks import TrainerHooks

    return TrainerHooks(**{arg: plugs[key] for arg, key in TRAINER_PLUGS.items()})


def start_ray(cfg: Config) -> None:
    """Ray, local or `cluster.address`; in the main thread (Ray's signal handlers need it)."""
    from furlong.cluster.topology import bundles_needed, init_ray

    init_ray(cfg.cluster, bundles_needed(cfg.cluster, cfg.train.world_size, cfg.engine.num_engines))


def topology(cfg: Config, run_dir: Path, model: str, admin_token: str, plugs: dict[str, Any]) -> Topology:
    """Trainer ranks, engines and router, started and ready (blocking: the driver runs it in a thread)."""
    from furlong.cluster.topology import Topology, TrainerSpec, threads_per_process

    spec = TrainerSpec(
        model_dir=model,
        train=cfg.train,
        algo=cfg.algo,
        temperature=cfg.rollout.temperature,
        seed=cfg.seed,
        hooks=trainer_hooks(plugs),
    )
    threads = threads_per_process(cfg.cluster, cfg.train.world_size, cfg.engine.num_engines, cfg.rollout.mode)
    return Topology.start(
        cluster=cfg.cluster,
        engine=cfg.engine,
        router=cfg.router,
        trainer=spec,
        run_dir=run_dir,
        admin_token=admin_token,
        threads=threads,
    )


def rollout_manager(
    cfg: Config,
    source: Any,
    evals: list[Any],
    client: EngineClient,
    tokenizer: Any,
    version: WeightVersion,
    plugs: dict[str, Any],
) -> RolloutManager:
    """The manager with every rollout plug point as a function; unset ones None (the manager's built-ins).

    `rollout.agent_fn` (without `rollout.generate_fn`) is run by `furlong.envs.agent.generate`, so the
    manager, a floor below envs, never imports it; `rollout.buffer` gets its offered `config` bound here.
    """
    from furlong.rollout.manager import RolloutManager

    fns = {arg: plugs[key] for arg, key in MANAGER_PLUGS.items()}
    if fns["generate_fn"] is None and plugs["rollout.agent_fn"] is not None:  # a black-box agent, on a TITO session
        from furlong.envs.agent import generate as agent_generate

        fns["generate_fn"] = agent_generate
    buffer = plugs["rollout.buffer"]
    if buffer is not None:
        fns["buffer_factory"] = functools.partial(buffer, config=cfg)
    return RolloutManager(
        cfg.rollout, source, client, tokenizer, seed=cfg.seed, eval_prompts=evals, envs=cfg.envs, weights=version, **fns
    )


def supervisor(
    cfg: Config, top: Topology, admin_token: str, run_dir: Path, version: WeightVersion, note: Any
) -> EngineSupervisor:
    from furlong.cluster.supervisor import EngineSupervisor

    return EngineSupervisor(
        top,
        router=cfg.router,
        weights=cfg.weights,
        cluster=cfg.cluster,
        pause_mode=cfg.engine.pause_mode,
        admin_token=admin_token,
        run_dir=run_dir,
        version=version,
        note=note,
    )
