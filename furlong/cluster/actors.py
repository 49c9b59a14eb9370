"""Ray actors: trainer ranks and server processes, placed on a placement group's bundles.

On a laptop `ray.init()` starts a local cluster and every bundle lands on this
machine; with `cluster.address` the same actors land on cluster nodes. Nothing
here knows which: that is the promise of running one topology everywhere.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from furlong.core import profiling, spans


@ray.remote
class ProcessActor:
    """Owns one server process (an engine or the router) on the node Ray placed it."""

    def __init__(
        self, name: str, argv: list[str], port: int, log_path: str, threads: int | None, url_host: str | None = None
    ):
        """`url_host`: the host its URL names (a node's IP when it binds a wildcard); None: the `--host` it binds."""
        from furlong.core.processes import ManagedProcess

        host = url_host or ("127.0.0.1" if "--host" not in argv else argv[argv.index("--host") + 1])
        self.proc = ManagedProcess(name, argv, f"http://{host}:{port}", log_path, threads)

    def start(self, timeout_s: float = 180.0) -> str:
        self.proc.start(timeout_s)
        return self.proc.url

    def url(self) -> str:
        return self.proc.url

    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.alive()

    def kill(self, sig: int = 9) -> None:
        self.proc.signal(sig)

    def restart(self, timeout_s: float = 180.0) -> str:
        self.proc.restart(timeout_s)
        return self.proc.url

    def stop(self) -> None:
        self.proc.stop()


@ray.remote(concurrency_groups={"control": 1})
class TrainerActor:
    """One FSDP2 rank. Every rank receives the whole global batch (the trainer shards it itself).

    Its methods run one at a time, on one thread, except `borrow_cores` (the "control" group, a thread
    of its own), which must reach a rank while it trains.

    The actor keeps no weight version: the driver's `WeightVersion` owns it. It keeps only
    whether its weights changed since the last successful push (`dirty`): a replaced engine
    may be re-synced at the owner's version only while the weights are still exactly the
    ones that version names.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_port: int,
        threads: int | None,
        seed: int,
        master_addr: str = "127.0.0.1",
    ):
        """`master_addr`: rank 0's node IP (the FSDP rendezvous); loopback when every rank is on one node."""
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        self.rank, self.world_size, self.threads, self.seed = rank, world_size, threads, seed
        self.trainer = None
        self.sender = None
        self.resident = None  # the policy's parameters in shared memory (None: not yet; False: not here)
        self.engine = None  # a colocated engine (cluster.colocate) lives here, in rank 0
        self.dirty = False  # the weights changed since the last push (the engines start on these very weights)

    def build(self, model_dir: str, train_cfg: Any, algo_cfg: Any, temperature: float, hooks: Any = None) -> int:
        """`hooks`: the trainer's resolved plug points (`furlong.train.hooks.TrainerHooks`), or None."""
        import torch

        from furlong.train.trainer import Trainer

        if self.threads:
            torch.set_num_threads(self.threads)
        torch.manual_seed(self.seed)
        profiling.start(f"trainer-{self.rank}")  # only under `furlong profile` (FURLONG_PROFILE_DIR)
        self.trainer = Trainer(
            model_dir, train_cfg, algo_cfg, self.rank, self.world_size, temperature=temperature, hooks=hooks
        )
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def spans(self, since: int = 0) -> dict:
        """This rank's timeline spans after `since` (`furlong.core.spans`): the driver pulls them each step."""
        return spans.RECORDER.since(since)

    def train_rollout(self, samples: list) -> dict:
        """Optimiser steps on one rollout batch: metrics, time span and (rank 0) per-token provenance."""
        from furlong.train.threads import LEASE

        self.dirty = True
        with LEASE.step(self.threads):
            out = self.trainer.train_rollout(samples)
        for m in out["metrics"]:
            m["perf/borrowed_micro_batches"] = float(LEASE.borrowed)  # on cores lent by idle engines
        return out

    @ray.method(concurrency_group="control")
    def borrow_cores(self, threads: int) -> None:
        """The engines have nothing to generate until this step ends: compute on `threads` from the next
        micro-batch; 0 gives them back (`cluster.borrow_idle_cores`, furlong/train/threads.py)."""
        from furlong.train.threads import LEASE

        LEASE.lend(threads)

    def sft_step(self, samples: list) -> dict[str, float]:
        self.dirty = True
        return self.trainer.sft_step(samples)

    def compute_logprobs(self, samples: list) -> list[list[float]]:
        return self.trainer.compute_logprobs(samples)

    def save(self, path: str) -> str:
        return str(self.trainer.save(path))

    def load(self, path: str) -> int:
        self.dirty = True
        self.trainer.load(path)
        return self.trainer.step

    def start_colocated_engine(
        self, model_dir: str, engine_args: dict, admin_token: str, port: int, host: str = "127.0.0.1"
    ) -> str:
        """cluster.colocate: the engine shares this process (and its device) with rank 0; `host`: its bind address."""
        from furlong.engine.engine import Engine
        from furlong.engine.server import ServerThread

        engine = Engine(model_dir, **engine_args)
        engine.start()
        self.engine = (engine, ServerThread(engine, admin_token, host=host, port=port).__enter__())
        return self.engine[1].url

    def push_weights(self, transport: str, urls: list[str], admin_token: str, version: int, opts: dict) -> dict:
        """Send this rank's weights to the engines (a collective: every rank must call it)."""
        from furlong.weights import make_sender

        if self.sender is not None and self.sender.urls != [u.rstrip("/") for u in urls]:
            self._drop_sender()  # an engine left or came back: connect afresh (new groups, new baselines)
        try:
            if self.sender is None:
                self.sender = make_sender(transport, rank=self.rank, world_size=self.world_size, **opts)
                self.sender.connect(urls, admin_token)
                if hasattr(self.sender, "resident"):  # shm, delta: engines read the parameters in place
                    self.sender.resident = self._resident()
            with spans.span(f"trainer/{self.rank}", "weight-push", version=version, engines=len(urls)):
                report = self.sender.push(self.trainer.state_dict_for_sync(), version)
        except Exception:
            self._drop_sender()  # an engine died under it: the next push reconnects
            raise
        self.dirty = False
        return {k: v for k, v in vars(report).items() if isinstance(v, (int, float, str))}

    def resync_engine(self, transport: str, url: str, admin_token: str, version: int, opts: dict) -> int | None:
        """Give a replaced engine these weights as `version` (the owner's); None if they changed since the last push."""
        if self.dirty:
            return None
        self.push_weights(transport, [url], admin_token, version, opts)
        return version

    def _drop_sender(self) -> None:
        if self.sender is not None:
            try:
                self.sender.close()
            except Exception:  # noqa: BLE001 - best effort: its engine may be gone
                pass
            self.sender = None

    def _resident(self):
        """The policy's parameters moved into shared memory, once (`weights/resident.py`): one rank, and a
        sync that sends the parameters themselves (not LoRA merges or QAT's fake-quantised weights)."""
        from furlong.weights.resident import ResidentWeights

        t = self.trainer
        if self.resident is None:
            plain = self.world_size == 1 and not t.lora and t.qat == "none"
            self.resident = (ResidentWeights.adopt(t.policy) if plain else None) or False
        return self.resident or None

    def weight_checksums(self) -> dict[str, int]:
        from furlong.weights.tensors import checksum

        return {name: checksum(t) for name, t in self.trainer.state_dict_for_sync()}

    def shutdown(self) -> None:
        profiling.stop()  # the actor is killed next: its atexit would not run
        if self.sender is not None and hasattr(self.sender, "close"):
            self.sender.close()
        if self.resident:
            self.resident.close()
        if self.engine is not None:
            engine, server = self.engine
            server.__exit__(None, None, None)
            engine.stop()
