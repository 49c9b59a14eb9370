"""Ray actors: trainer ranks and server processes, placed on a placement group's bundles.

On a laptop `ray.init()` starts a local cluster and every bundle lands on this
machine; with `cluster.address` the same actors land on cluster nodes. Nothing
here knows which: that is the promise of running one topology everywhere.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray


@ray.remote
class ProcessActor:
    """Owns one server process (an engine or the router) on the node Ray placed it."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: str, threads: int | None):
        from furlong.cluster.processes import ManagedProcess

        host = "127.0.0.1" if "--host" not in argv else argv[argv.index("--host") + 1]
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


@ray.remote
class TrainerActor:
    """One FSDP2 rank. Every rank receives the whole global batch (the trainer shards it itself)."""

    def __init__(self, rank: int, world_size: int, master_port: int, threads: int | None, seed: int):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(master_port)
        self.rank, self.world_size, self.threads, self.seed = rank, world_size, threads, seed
        self.trainer = None
        self.sender = None
        self.engine = None  # a colocated engine (cluster.colocate) lives here, in rank 0
        # The version the engines stamp on exactly these weights; None once a step changed them
        # and no sync has named the result yet (the supervisor's re-sync then waits for the next sync).
        self.weights_version: int | None = 0

    def build(self, model_dir: str, train_cfg: Any, algo_cfg: Any, temperature: float) -> int:
        import torch

        from furlong.train.trainer import Trainer

        if self.threads:
            torch.set_num_threads(self.threads)
        torch.manual_seed(self.seed)
        self.trainer = Trainer(model_dir, train_cfg, algo_cfg, self.rank, self.world_size, temperature=temperature)
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def train_rollout(self, samples: list, step: int) -> dict:
        """Optimiser steps on one rollout batch; rank 0 also returns per-token provenance for the event store."""
        self.weights_version = None
        t0 = time.time()
        metrics = self.trainer.train_rollout(samples)
        out = {"metrics": metrics, "span": (t0, time.time())}
        batch = self.trainer.last_batch
        if self.rank == 0:
            n = [s.response_length for s in batch.samples]
            if batch.advantages is not None:
                out["advantages"] = [batch.advantages[i, : n[i]].tolist() for i in range(len(n))]
            if batch.old_logprobs is not None:
                out["train_logprobs"] = [batch.old_logprobs[i, : n[i]].tolist() for i in range(len(n))]
            elif all(id(s) in self.trainer.seen_logprobs for s in batch.samples):  # rank 0 saw every sample
                out["train_logprobs"] = [self.trainer.seen_logprobs[id(s)] for s in batch.samples]
        return out

    def sft_step(self, samples: list) -> dict[str, float]:
        self.weights_version = None
        return self.trainer.sft_step(samples)

    def compute_logprobs(self, samples: list) -> list[list[float]]:
        return self.trainer.compute_logprobs(samples)

    def save(self, path: str) -> str:
        return str(self.trainer.save(path))

    def load(self, path: str) -> int:
        self.weights_version = None
        self.trainer.load(path)
        return self.trainer.step

    def start_colocated_engine(self, model_dir: str, engine_args: dict, admin_token: str, port: int) -> str:
        """cluster.colocate: the engine shares this process (and its device) with rank 0."""
        from furlong.engine.scheduler import Engine
        from furlong.engine.server import ServerThread

        engine = Engine(model_dir, **engine_args)
        engine.start()
        self.engine = (engine, ServerThread(engine, admin_token, port=port).__enter__())
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
            report = self.sender.push(self.trainer.state_dict_for_sync(), version)
        except Exception:
            self._drop_sender()  # an engine died under it: the next push reconnects
            raise
        self.weights_version = version
        return {k: v for k, v in vars(report).items() if isinstance(v, (int, float, str))}

    def resync_engine(self, transport: str, url: str, admin_token: str, opts: dict) -> int | None:
        """Give a replaced engine these weights at their version; None if no sync has named them yet."""
        if self.weights_version is None:
            return None
        version = self.weights_version
        self.push_weights(transport, [url], admin_token, version, opts)
        return version

    def _drop_sender(self) -> None:
        if self.sender is not None:
            try:
                self.sender.close()
            except Exception:  # noqa: BLE001 - best effort: its engine may be gone
                pass
            self.sender = None

    def weight_checksums(self) -> dict[str, int]:
        from furlong.weights.tensors import checksum

        return {name: checksum(t) for name, t in self.trainer.state_dict_for_sync()}

    def shutdown(self) -> None:
        if self.sender is not None and hasattr(self.sender, "close"):
            self.sender.close()
        if self.engine is not None:
            engine, server = self.engine
            server.__exit__(None, None, None)
            engine.stop()
