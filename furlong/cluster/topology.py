"""Start and stop the whole topology of a run: Ray, trainer ranks, engines, router.

    Topology.start(cfg, run_dir, model_dir, admin_token)
      ├─ ray.init()            local by default; cluster.address joins a cluster
      ├─ placement group       one bundle per trainer rank and per engine (CPU, or GPU when present)
      ├─ TrainerActor × N      FSDP2 ranks (gloo on CPU, NCCL on GPU)
      ├─ engines × M           `furlong serve` processes, each owned by a ProcessActor;
      │                        with cluster.colocate, one engine inside trainer rank 0 instead
      └─ router                `furlong router` process in front of the engines

Threads: each process gets `cluster.threads_per_process`, or the cores divided by
the processes that compute at the same time (in sync mode engines and trainer take
turns, so each may use every core), so two cores are never oversubscribed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from furlong.cluster.processes import REAPER_MARK, free_port, furlong_argv, reaper_mark, start_reaper


def threads_per_process(cfg: Any) -> int:
    if cfg.cluster.threads_per_process:
        return cfg.cluster.threads_per_process
    cores = cfg.cluster.num_cpus or os.cpu_count() or 1
    ws, ne = cfg.train.world_size, cfg.engine.num_engines
    busy = max(ws, ne) if cfg.rollout.mode == "sync" else ws + ne
    return max(1, cores // busy)


def bundles_needed(cfg: Any) -> int:
    return cfg.train.world_size + (0 if cfg.cluster.colocate else cfg.engine.num_engines)


def init_ray(cfg: Any, bundles: int) -> None:
    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}}
    if cfg.cluster.address:
        ray.init(address=cfg.cluster.address, runtime_env=env, log_to_driver=False)
    else:
        # Logical CPUs: one per bundle at least, so a 2-core laptop can place 3 processes;
        # real sharing of the cores is set by thread counts, not by Ray.
        cpus = max(bundles, cfg.cluster.num_cpus or os.cpu_count() or 1)
        # This Ray is ours: everything under it dies with the driver, even a SIGKILLed one.
        os.environ[REAPER_MARK] = mark = reaper_mark()
        try:
            ctx = ray.init(num_cpus=cpus, num_gpus=cfg.cluster.num_gpus, include_dashboard=False,
                           runtime_env=env, log_to_driver=False, configure_logging=False)
        finally:
            del os.environ[REAPER_MARK]  # Ray's head processes have it; later children of the driver need not
        start_reaper(mark, ctx.address_info["session_dir"])


@dataclass
class Topology:
    cfg: Any
    run_dir: Path
    admin_token: str
    trainers: list[Any] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)  # ProcessActor handles (empty when colocated)
    engine_urls: list[str] = field(default_factory=list)
    router: Any = None
    router_url: str = ""
    placement: Any = None

    @classmethod
    def start(cls, cfg: Any, run_dir: Path, model_dir: str, admin_token: str) -> "Topology":
        top = cls(cfg, run_dir, admin_token)
        try:
            top._launch(model_dir)
        except BaseException:
            top.shutdown()  # a half-started topology must not keep its actors and bundles (shared Ray, auto-restart)
            raise
        return top

    def _launch(self, model_dir: str) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from furlong.cluster.actors import ProcessActor, TrainerActor

        top, cfg, run_dir, admin_token = self, self.cfg, self.run_dir, self.admin_token
        ws, ne = cfg.train.world_size, cfg.engine.num_engines
        colocate = cfg.cluster.colocate
        gpu = 1 if (cfg.cluster.num_gpus or 0) > 0 else 0
        n_bundles = ws + (0 if colocate else ne)
        init_ray(cfg, n_bundles)  # no-op when the driver already started Ray in its main thread
        bundle = {"CPU": 1, **({"GPU": gpu} if gpu else {})}
        top.placement = placement_group([dict(bundle) for _ in range(n_bundles)], strategy="PACK")
        ray.get(top.placement.ready(), timeout=120)

        def at(i: int, **kw: Any):
            return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(top.placement, placement_group_bundle_index=i), **kw)

        threads = threads_per_process(cfg)
        master_port = free_port()
        top.trainers = [
            TrainerActor.options(**at(r, num_cpus=1, num_gpus=gpu)).remote(r, ws, master_port, threads, cfg.seed)
            for r in range(ws)
        ]
        build = [t.build.remote(model_dir, cfg.train, cfg.algo, cfg.rollout.temperature) for t in top.trainers]
        logs = run_dir / "logs"
        e = cfg.engine
        if colocate:
            args = dict(dtype=e.dtype, kv_cache_mb=e.kv_cache_mb, max_running=e.max_running)
            top.engine_urls = [ray.get(top.trainers[0].start_colocated_engine.remote(model_dir, args, admin_token, 0))]
        else:
            for i in range(ne):
                port = e.port_base + i if e.port_base else free_port()
                argv = furlong_argv("serve", "--model", model_dir, "--host", e.host, "--port", str(port),
                                    "--dtype", e.dtype, "--kv-cache-mb", str(e.kv_cache_mb),
                                    "--max-running", str(e.max_running), f"--admin-token={admin_token}",
                                    "--threads", str(threads))
                actor = ProcessActor.options(**at(ws + i, num_cpus=1, num_gpus=gpu)).remote(
                    f"engine-{i}", argv, port, str(logs / f"engine-{i}.log"), threads)
                top.engines.append(actor)
            top.engine_urls = ray.get([a.start.remote() for a in top.engines])
        ray.get(build)
        r = cfg.router
        port = r.port or free_port()
        argv = furlong_argv("router", *sum((["--engine", u] for u in top.engine_urls), []), "--host", r.host,
                            "--port", str(port), "--policy", r.policy, f"--admin-token={admin_token}",
                            "--health-interval", str(r.health_interval_s), "--health-timeout", str(r.health_timeout_s),
                            "--unhealthy-after", str(r.unhealthy_after), "--max-retries", str(r.max_retries))
        top.router = ProcessActor.options(num_cpus=0).remote("router", argv, port, str(logs / "router.log"), 1)
        top.router_url = ray.get(top.router.start.remote())

    # ---- trainer group: every rank gets the same call; rank 0's answer is returned
    # A rank whose process died raises TrainerDied (see cluster/supervisor.py).
    def call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get([getattr(t, method).remote(*args) for t in self.trainers])[0]
        except ray.exceptions.RayActorError as e:
            raise trainer_died(method, e) from e

    async def acall(self, method: str, *args: Any) -> Any:
        refs = [getattr(t, method).remote(*args) for t in self.trainers]
        try:
            return (await asyncio_gather(refs))[0]
        except ray.exceptions.RayActorError as e:
            raise trainer_died(method, e) from e

    def shutdown(self) -> None:
        for handle in [self.router, *self.engines]:
            if handle is not None:
                try:
                    ray.get(handle.stop.remote(), timeout=20)
                except Exception:
                    pass
        for t in self.trainers:
            try:
                ray.get(t.shutdown.remote(), timeout=20)
            except Exception:
                pass
        for handle in [self.router, *self.engines, *self.trainers]:
            if handle is not None:
                ray.kill(handle)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)


def trainer_died(method: str, e: BaseException) -> Exception:
    from furlong.cluster.supervisor import TrainerDied

    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return TrainerDied(f"a trainer rank died during {method}() ({why})")


async def asyncio_gather(refs: list[Any]) -> list[Any]:
    import asyncio

    return list(await asyncio.gather(*refs))
