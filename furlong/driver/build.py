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
    """The policy's HF directory: `model.path`, or a tiny model built locally (cached) from arch + size.

    A `model.path` is checked here, before any process starts: a missing config, shard or tokenizer
    file fails the run at once with its path (`models.check_model_dir`)."""
    from furlong.models import check_model_dir, create_model

    if model.path:
        return str(check_model_dir(model.path))
    return str(create_model(model.arch, model.size, seed=model.seed, max_positions=model.max_positions))


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

    init_ray(cfg.cluster, bundles_needed(cfg.cluster, cfg.train.world_size, cfg.engine.num_engines + eval_engines(cfg)))


def eval_engines(cfg: Config) -> int:
    """The engines `rollout.eval_mode=dedicated` starts beside the training ones (0 in any other mode)."""
    return cfg.engine.eval_num_engines if cfg.rollout.eval_mode == "dedicated" else 0


def _cores_shape(cfg: Config) -> tuple[tuple, int]:
    """(cluster, trainer ranks, engines, rollout mode), and the threads each process gets."""
    from furlong.cluster.topology import threads_per_process

    shape = (cfg.cluster, cfg.train.world_size, cfg.engine.num_engines + eval_engines(cfg), cfg.rollout.mode)
    return shape, threads_per_process(*shape)


def topology(cfg: Config, run_dir: Path, model: str, admin_token: str, plugs: dict[str, Any]) -> Topology:
    """Trainer ranks, engines and router, started and ready (blocking: the driver runs it in a thread)."""
    from furlong.cluster.topology import Topology, engine_niceness

    spec = trainer_spec(cfg, model, plugs)
    n_eval = eval_engines(cfg)
    shape, threads = _cores_shape(cfg)
    return Topology.start(
        cluster=cfg.cluster,
        engine=cfg.engine,
        router=cfg.router,
        trainer=spec,
        run_dir=run_dir,
        admin_token=admin_token,
        threads=threads,
        weights=cfg.weights,
        eval_engines=n_eval,
        niceness=engine_niceness(*shape, threads),
    )


def rollout_manager(
    cfg: Config,
    source: Any,
    evals: list[Any],
    client: EngineClient,
    tokenizer: Any,
    version: WeightVersion,
    plugs: dict[str, Any],
    serving: Any = None,
) -> RolloutManager:
    """The manager with every rollout plug point as a function; unset ones None (the manager's built-ins).

    `rollout.agent_fn` (without `rollout.generate_fn`) is run by `furlong.envs.agent.generate`, so the
    manager, a floor below envs, never imports it; `rollout.buffer` gets its offered `config` bound here.
    `serving` is the supervisor's `wait_serving` (an outage delays prompts rather than dropping them).
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
        cfg.rollout,
        source,
        client,
        tokenizer,
        seed=cfg.seed,
        eval_prompts=evals,
        envs=cfg.envs,
        weights=version,
        serving=serving,
        **fns,
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


def core_sharing(cfg: Config, top: Topology, admin_token: str) -> Any:
    """What happens to the cores around each train step: the engines frozen where the cores are time-shared
    (`cluster.share_cores` and the threads oversubscribe them); where an async run splits them, the engines'
    lent cores taken back (`cluster.lend_idle_cores`) and the trainer lent theirs once they are idle
    (`cluster.borrow_idle_cores`). A colocated engine has no process of its own."""
    from furlong.cluster.core_sharing import EngineYield
    from furlong.cluster.topology import threads_per_process, time_shared

    c = cfg.cluster
    shape, threads = _cores_shape(cfg)
    enabled = time_shared(*shape, threads) and not c.colocate
    idle = threads_per_process(*shape[:3], "sync")  # what each process gets when they take turns on the cores
    split = not c.colocate and not enabled and idle > threads
    lend = (threads, idle) if c.lend_idle_cores and split else None
    borrow = (idle, lambda n: top.trainers.borrow_cores(n)) if c.borrow_idle_cores and split else None
    return EngineYield(lambda: list(top.engine_urls), admin_token, enabled, lend, borrow)


def timeline(cfg: Config, store: Any, top: Topology, model: str) -> Any:
    """The span puller: every engine, the router and every rank into the driver's event store.

    A colocated engine lives in trainer rank 0's process: its spans come with the rank's, not over HTTP."""
    from furlong.observe.timeline import SpanPuller

    engines = (lambda: []) if cfg.cluster.colocate else (lambda: list(top.engine_urls))
    return SpanPuller(store, engine_urls=engines, router_url=top.router_url, trainers=top.trainers, model_dir=model)


class TrainersOnly:
    """Trainer ranks without engines or a router: what an engine-free SFT run starts."""

    def __init__(self, trainers: Any, placement: Any) -> None:
        self.trainers, self.placement = trainers, placement
        self.engines: list[Any] = []
        self.engine_urls: list[str] = []
        self.router_url = ""

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self.trainers.shutdown(timeout_s=20)
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None


def trainer_spec(cfg: Config, model: str, plugs: dict[str, Any]) -> Any:
    from furlong.cluster.topology import TrainerSpec

    return TrainerSpec(
        model_dir=model,
        train=cfg.train,
        algo=cfg.algo,
        temperature=cfg.rollout.temperature,
        seed=cfg.seed,
        hooks=trainer_hooks(plugs),
    )


def trainers_only(cfg: Config, model: str, plugs: dict[str, Any]) -> TrainersOnly:
    """`train.world_size` trainer ranks on their own placement group, built and ready (blocking)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from furlong.cluster.actors import TrainerActor
    from furlong.cluster.topology import threads_per_process
    from furlong.cluster.trainer_group import TrainerGroup
    from furlong.core.net import free_port

    spec, ws = trainer_spec(cfg, model, plugs), cfg.train.world_size
    threads = threads_per_process(cfg.cluster, ws, 0, "sync")
    gpu = 1 if (cfg.cluster.num_gpus or 0) > 0 else 0
    pg = placement_group([{"CPU": 1, **({"GPU": gpu} if gpu else {})} for _ in range(ws)], strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    port = free_port()
    group = TrainerGroup(
        [
            TrainerActor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
                num_cpus=1,
                num_gpus=gpu,
            ).remote(r, ws, port, threads, spec.seed)
            for r in range(ws)
        ]
    )
    out = TrainersOnly(group, pg)
    try:
        group.wait_built(group.build_refs(spec.model_dir, spec.train, spec.algo, spec.temperature, spec.hooks))
    except BaseException:
        out.shutdown()
        raise
    return out


def rebuild_trainers(cfg: Config, top: Any, model: str, plugs: dict[str, Any]) -> None:
    """Build this run's trainer (its own train and algo sections) on the ranks of an already started topology.

    A warm topology serves several short runs in a row (recipe tests, sweeps): each gets fresh trainer
    state on the same actors, and its weights are pushed to the engines before its first rollout."""
    spec = trainer_spec(cfg, model, plugs)
    top.trainers.wait_built(
        top.trainers.build_refs(spec.model_dir, spec.train, spec.algo, spec.temperature, spec.hooks)
    )


def teacher_engine(cfg: Config, run_dir: Path, admin_token: str) -> tuple[Any, str]:
    """On-policy distillation's teacher: one engine serving `algo.teacher_path`, no router; (actor, url).

    It only scores (prompt log-probs over the student's tokens), so it takes no weight syncs."""
    from furlong.cluster.topology import threads_per_process

    teacher = Path(str(cfg.algo.teacher_path)).expanduser()
    if not (teacher / "config.json").is_file():  # checked at start: a recipe names the teacher a run trains first
        raise ValueError(
            f"algo.teacher_path: {str(teacher)!r} is not a HF model directory (no config.json); "
            "train a teacher and export it (see recipes/opd_reverse.yaml)"
        )
    _same_vocab(str(teacher), model_dir(cfg.model))
    threads = threads_per_process(cfg.cluster, cfg.train.world_size, cfg.engine.num_engines + 1, cfg.rollout.mode)
    return _engine_process(cfg, "teacher-0", str(cfg.algo.teacher_path), run_dir, admin_token, threads)


def sft_eval_engines(cfg: Config, run_dir: Path, model: str, admin_token: str) -> list[tuple[Any, str]]:
    """An `algo.name=sft` run's `rollout.eval_mode=dedicated` engines: `engine.eval_num_engines` serving the
    policy, no router and no rollout engine; [(actor, url)]. They start on the base model; the SFT loop pushes
    the trainer's weights before each generation eval."""
    from furlong.cluster.topology import threads_per_process

    n = eval_engines(cfg)
    threads = threads_per_process(cfg.cluster, cfg.train.world_size, n, "sync")
    started: list[tuple[Any, str]] = []
    try:
        for j in range(n):
            started.append(_engine_process(cfg, f"eval-engine-{j}", model, run_dir, admin_token, threads))
    except BaseException:
        stop_engines([a for a, _ in started])
        raise
    return started


def stop_engines(actors: list[Any]) -> None:
    """Stop engine processes started outside a topology (best effort, then kill the actors)."""
    import ray

    for actor in actors:
        try:
            ray.get(actor.stop.remote(), timeout=20)
        except Exception:  # noqa: BLE001 - a dead engine has nothing left to stop
            pass
        ray.kill(actor)


def _engine_process(
    cfg: Config, name: str, model: str, run_dir: Path, admin_token: str, threads: int
) -> tuple[Any, str]:
    """One `furlong serve` process of `model` outside the topology (logs/<name>.log); (actor, url)."""
    import ray

    from furlong.cluster.actors import ProcessActor
    from furlong.cluster.launchers import engine_command
    from furlong.core.net import free_port

    port = free_port()
    argv = engine_command(cfg.engine, model_dir=model, port=port, admin_token=admin_token, threads=threads)
    actor = ProcessActor.options(num_cpus=0).remote(
        name, argv, port, str(Path(run_dir) / "logs" / f"{name}.log"), threads
    )
    try:
        return actor, ray.get(actor.start.remote())
    except BaseException:
        ray.kill(actor)
        raise


def _same_vocab(teacher: str, student: str) -> None:
    """The teacher reads the student's token ids: both must tokenise alike, or every score is of other text."""
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(teacher).get_vocab() != AutoTokenizer.from_pretrained(student).get_vocab():
        raise ValueError(
            f"algo.teacher_path: the teacher's tokenizer ({teacher}) differs from the student's ({student}); "
            "distillation scores the student's token ids, so both need one vocabulary (a locally built model's "
            "tokenizer depends on model.seed: give the student the teacher's)"
        )
