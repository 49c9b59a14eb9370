"""Start and stop the whole topology of a run: Ray, trainer ranks, engines, router.

    Topology.start(cluster=..., engine=..., router=..., trainer=TrainerSpec(...), ...)
      ├─ ray.init()            local by default; cluster.address joins a cluster
      ├─ placement group       one bundle per trainer rank and per engine (CPU, or GPU when present)
      ├─ TrainerGroup          N TrainerActor ranks of FSDP2 (gloo on CPU, NCCL on GPU)
      ├─ engines × M           engine processes (launcher by engine.backend), each owned by a ProcessActor;
      │                        with cluster.colocate, one engine inside trainer rank 0 instead
      ├─ eval engines × E      the same launcher, for `rollout.eval_mode=dedicated`: not behind the router
      └─ router                `furlong router` process in front of the engines

Threads: each process gets `cluster.threads_per_process`, or the cores divided by
the processes that compute at the same time (in sync mode engines and trainer take
turns, so each may use every core). An `OMP_NUM_THREADS` in the environment caps the
derived count: a user (or a test runner sharing the machine) who asked for one thread
per process gets one.

Time-shared cores (`cluster.share_cores=true`, async modes; off by default): splitting two
cores 1 + 1 between trainer and engine costs the trainer 1.7x per step (it scales 1.73x from
one thread to two). Shared, every process takes the threads a sync run gives it, and where that
oversubscribes the cores the engines freeze in place while the trainer computes (the driver's
`furlong/cluster/core_sharing.py`) and run at lower priority (`cluster.engine_niceness`, nice
+10) the rest of the time: the trainer has the cores whenever it computes, the engines the cycles
it leaves idle. Off by default because a two-thread trainer beside other busy programs stalls at its
OpenMP barriers (docs/async.md#time-shared-cores).

Priority: the local Ray starts its workers at nice 0 (`RAY_worker_niceness`; Ray's default is
15), since they are the run's compute, not background work. At nice 15 any other busy program
on the machine took the core from one thread of a trainer's two-thread parallel region and the
other spun at the barrier: an SFT step went from 2 s to about 50 s on a 2-core machine with one
busy core (12 SFT steps + 2 RL steps: over 500 s at nice 15, 135 s at nice 0, 90 s at one thread).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from furlong.cluster import nodes
from furlong.cluster.launchers import check_backend, colocated_engine_kwargs, engine_command, router_command
from furlong.cluster.trainer_group import TrainerGroup
from furlong.core.net import free_port
from furlong.core.processes import REAPER_MARK, reaper_mark, start_reaper

if TYPE_CHECKING:
    from furlong.config.schema import AlgoConfig, ClusterConfig, EngineConfig, RouterConfig, TrainConfig, WeightsConfig


NICENESS = "RAY_worker_niceness"  # read by the raylet when it starts


def _cores(cluster: ClusterConfig) -> int:
    return cluster.num_cpus or os.cpu_count() or 1


def threads_per_process(cluster: ClusterConfig, world_size: int, num_engines: int, mode: str) -> int:
    if cluster.threads_per_process:
        return cluster.threads_per_process
    turns = mode == "sync" or cluster.share_cores  # take turns on the cores, or time-share them by priority
    busy = max(world_size, num_engines) if turns else world_size + num_engines
    derived = max(1, _cores(cluster) // busy)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(derived, int(cap)) if cap.isdigit() and int(cap) > 0 else derived


def time_shared(cluster: ClusterConfig, world_size: int, num_engines: int, mode: str, threads: int) -> bool:
    """Whether an async run's trainer and engines time-share the cores: `cluster.share_cores` and their threads
    together oversubscribe them (see the module docstring)."""
    if mode == "sync" or not cluster.share_cores:
        return False
    return threads * (world_size + num_engines) > _cores(cluster)


def engine_niceness(cluster: ClusterConfig, world_size: int, num_engines: int, mode: str, threads: int) -> int:
    """How much lower the engines' CPU priority is: `cluster.engine_niceness` where the cores are time-shared."""
    return cluster.engine_niceness if time_shared(cluster, world_size, num_engines, mode, threads) else 0


def bundles_needed(cluster: ClusterConfig, world_size: int, num_engines: int) -> int:
    return world_size + (0 if cluster.colocate else num_engines)


def init_ray(cluster: ClusterConfig, bundles: int) -> None:
    """Start (or reuse) this process's Ray with room for `bundles` one-CPU bundles.

    A Ray already started in this process (an earlier run in the same interpreter: a notebook, a test
    worker) is reused when it has the CPUs; when it has fewer, the placement group would wait forever
    for CPUs that never come, so a local Ray in which nothing holds CPUs is restarted bigger, and anything
    else is a clear error instead of a placement timeout."""
    if ray.is_initialized():
        have = ray.cluster_resources().get("CPU", 0)
        if have >= bundles:
            return
        if cluster.address or _live_actors():
            raise RuntimeError(
                f"Ray in this process has {have:g} CPUs but this run places {bundles} one-CPU bundles "
                "(trainer ranks + engines); shut the other run down first, or set cluster.num_cpus"
            )
        ray.shutdown()
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}}
    if cluster.address:
        ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
    else:
        # Logical CPUs: one per bundle at least, so a 2-core laptop can place 3 processes;
        # real sharing of the cores is set by thread counts, not by Ray.
        cpus = max(bundles, cluster.num_cpus or os.cpu_count() or 1)
        # This Ray is ours: everything under it dies with the driver, even a SIGKILLed one. Its workers
        # run at the driver's priority (see the module docstring) unless the user set RAY_worker_niceness.
        os.environ[REAPER_MARK] = mark = reaper_mark()
        nice_given = NICENESS in os.environ
        os.environ.setdefault(NICENESS, "0")
        try:
            ctx = ray.init(
                address="local",  # a Ray of our own even when `ray start` (or RAY_ADDRESS) left one running
                num_cpus=cpus,
                num_gpus=cluster.num_gpus,
                include_dashboard=False,
                runtime_env=env,
                log_to_driver=False,
                configure_logging=False,
            )
        finally:
            del os.environ[REAPER_MARK]  # Ray's head processes have it; later children of the driver need not
            if not nice_given:
                del os.environ[NICENESS]
        start_reaper(mark, ctx.address_info["session_dir"])


def _live_actors() -> bool:
    """Whether anything holds CPUs in this Ray (a placement group or an actor): then it is not ours to restart."""
    return ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0)


@dataclass(frozen=True)
class TrainerSpec:
    """What every trainer rank is built from: the model, its typed sections and its resolved plug points."""

    model_dir: str
    train: TrainConfig
    algo: AlgoConfig
    temperature: float  # the rollout temperature: training log-probs are taken at it
    seed: int
    hooks: Any = None  # furlong.train.hooks.TrainerHooks, or None: the algorithm's built-ins


@dataclass
class Topology:
    run_dir: Path
    admin_token: str
    trainers: TrainerGroup = field(default_factory=lambda: TrainerGroup([]))
    engines: list[Any] = field(default_factory=list)  # ProcessActor handles (empty when colocated)
    engine_urls: list[str] = field(default_factory=list)
    eval_engines: list[Any] = field(default_factory=list)  # dedicated eval engines (ProcessActor handles)
    eval_engine_urls: list[str] = field(default_factory=list)  # not behind the router
    router: Any = None
    router_url: str = ""
    placement: Any = None
    transport: str | None = None  # the weight transport the run uses (nodes.weight_transport); None: weights.transport
    weight_opts: dict[str, Any] = field(default_factory=dict)  # sender options the placement implies
    multi_node: bool = False

    @classmethod
    def start(
        cls,
        *,
        cluster: ClusterConfig,
        engine: EngineConfig,
        router: RouterConfig,
        trainer: TrainerSpec,
        run_dir: Path,
        admin_token: str,
        threads: int,
        weights: WeightsConfig | None = None,
        eval_engines: int = 0,
        niceness: int = 0,
    ) -> Topology:
        """`weights`: where the run's transport is checked against the placement (None: not checked).
        `eval_engines`: engines for `rollout.eval_mode=dedicated`, placed after the others, not routed.
        `niceness`: the engines' lower CPU priority on time-shared cores (`engine_niceness`)."""
        top = cls(Path(run_dir), admin_token)
        try:
            top._launch(cluster, engine, router, trainer, threads, weights, eval_engines, niceness)
        except BaseException:
            top.shutdown()  # a half-started topology must not keep its actors and bundles (shared Ray, auto-restart)
            raise
        return top

    def _launch(
        self,
        cluster: ClusterConfig,
        engine: EngineConfig,
        router: RouterConfig,
        trainer: TrainerSpec,
        threads: int,
        weights: WeightsConfig | None,
        n_eval: int = 0,
        niceness: int = 0,
    ) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        from furlong.cluster.actors import ProcessActor, TrainerActor

        ws, ne = trainer.train.world_size, engine.num_engines
        if cluster.colocate:
            colocated = colocated_engine_kwargs(engine)  # the built-in engine only: refused before anything starts
        else:
            check_backend(engine)
        gpu = 1 if (cluster.num_gpus or 0) > 0 else 0
        n_bundles = bundles_needed(cluster, ws, ne) + n_eval
        init_ray(cluster, n_bundles)  # no-op when the driver already started Ray in its main thread
        self.multi_node = multi = nodes.is_multi_node(cluster)
        nodes.require_token(self.admin_token, multi)
        if weights is not None:
            self.transport = nodes.weight_transport(weights, multi, len(nodes.alive_nodes()))
        nodes.check_resources(cluster)
        wanted = nodes.bundles(cluster, ws, 0 if cluster.colocate else ne + n_eval, gpu)
        self.placement = placement_group(wanted, strategy="PACK")
        ray.get(self.placement.ready(), timeout=120)
        placed = nodes.bundle_nodes(self.placement)
        if multi and self.transport == "broadcast":  # engines dial rank 0's rendezvous from their own nodes
            self.weight_opts["master_address"] = placed[0][1]
        if (self.transport or (weights.transport if weights else None)) == "broadcast":
            gpus = gpu > 0 or any(n.get("Resources", {}).get("GPU", 0) for n in nodes.alive_nodes())
            self.weight_opts["backend"] = nodes.broadcast_backend(trainer.train.backend, engine.device, gpus)
        if engine.backend == "sglang":  # SGLang's request shapes (weight_version as a string)
            self.weight_opts["engine_api"] = "sglang"
        if engine.quantization != "none":  # the sender quantises once per sync; engines load the codes
            self.weight_opts["quantization"] = engine.quantization

        def at(i: int, **kw: Any) -> dict[str, Any]:
            where = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i)
            return dict(scheduling_strategy=where, **kw)

        master_port = free_port()
        self.trainers = TrainerGroup(
            [
                TrainerActor.options(**at(r, num_cpus=1, num_gpus=gpu)).remote(
                    r, ws, master_port, threads, trainer.seed, placed[0][1] if multi else "127.0.0.1"
                )
                for r in range(ws)
            ]
        )
        built = self.trainers.build_refs(
            trainer.model_dir, trainer.train, trainer.algo, trainer.temperature, trainer.hooks
        )
        logs = self.run_dir / "logs"
        if cluster.colocate:
            bind, url_host = nodes.bind_host(engine.host, placed[0][1], multi)  # across nodes: rank 0's node address
            start = self.trainers.actors[0].start_colocated_engine.remote(
                trainer.model_dir, colocated, self.admin_token, 0, bind
            )
            url = ray.get(start)  # a wildcard bind names the node's address instead
            self.engine_urls = [url if url_host == bind else f"http://{url_host}:{url.rsplit(':', 1)[1]}"]
        else:
            for i in range(ne + n_eval):  # the eval engines last: eval-engine-j is engine ne + j
                port = engine.port_base + i if engine.port_base else free_port()
                bind, url_host = nodes.bind_host(engine.host, placed[ws + i][1], multi)
                opts = dict(port=port, admin_token=self.admin_token, threads=threads, host=bind, niceness=niceness)
                argv = engine_command(engine, model_dir=trainer.model_dir, **opts)
                name = f"engine-{i}" if i < ne else f"eval-engine-{i - ne}"
                actor = ProcessActor.options(**at(ws + i, num_cpus=1, num_gpus=gpu)).remote(
                    name, argv, port, str(logs / f"{name}.log"), threads, url_host
                )
                (self.engines if i < ne else self.eval_engines).append(actor)
            urls = ray.get([a.start.remote() for a in self.engines + self.eval_engines])
            self.engine_urls, self.eval_engine_urls = urls[:ne], urls[ne:]
        self.trainers.wait_built(built)
        port = router.port or free_port()
        here = ray.get_runtime_context().get_node_id()  # the router serves the driver: it runs on the driver's node
        bind, url_host = nodes.bind_host(router.host, ray.util.get_node_ip_address(), multi)
        argv = router_command(router, engine_urls=self.engine_urls, port=port, admin_token=self.admin_token, host=bind)
        self.router = ProcessActor.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)
        ).remote("router", argv, port, str(logs / "router.log"), 1, url_host)
        self.router_url = ray.get(self.router.start.remote())
        roles = [f"trainer-{r}" for r in range(ws)] + [f"engine-{i}" for i in range(len(self.engines))]
        roles += [f"eval-engine-{j}" for j in range(len(self.eval_engines))]
        urls = [""] * ws + self.engine_urls + self.eval_engine_urls
        placement = {role: {"node_id": nid, "node_ip": ip, "url": u} for role, (nid, ip), u in zip(roles, placed, urls)}
        placement["router"] = {"node_id": here, "node_ip": ray.util.get_node_ip_address(), "url": self.router_url}
        nodes.write_placement(self.run_dir, placement, multi=multi, transport=self.transport)

    def shutdown(self) -> None:
        for handle in [self.router, *self.engines, *self.eval_engines]:
            if handle is not None:
                try:
                    ray.get(handle.stop.remote(), timeout=20)
                except Exception:
                    pass
        self.trainers.shutdown(timeout_s=20)
        for handle in [self.router, *self.engines, *self.eval_engines]:
            if handle is not None:
                ray.kill(handle)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
