"""The `Sender` base class every transport extends, and the bucketing it shares.

Every transport shares the same contract, so the driver never branches on it:

* **versioned once per sync** — the engine stamps `weight_version` on every
  request it applies, so all buckets but the last carry the engine's *current*
  version and only the last carries the new one: a token can never carry the
  new version before every bucket has landed. (Tokens generated *between*
  buckets see mixed weights under the old stamp unless the engines are paused
  — `pause_mode` does that for callers that have no pause of their own.)
* **all or nothing for bad input** — the engine checks names and shapes per
  request, but a sync is many requests. The sender therefore checks the whole
  sync against the engine's parameter schema (`schema.engine_schema`) before
  the first byte moves, and a bad name or shape raises `WeightSyncError`
  naming the tensor while every engine keeps its old weights.
* **ordered per engine, overlapped across engines** — each engine has one
  lane (a one-thread executor), so bucket k+1 reaches it after bucket k was
  applied, while different engines load in parallel and the sender prepares
  the next bucket.

* **verified on request** — with `verify=True` (`weights.verify`) every push
  ends by comparing the engines' CRC32s with the pushed tensors (`checksums.verify`).
* **quantised once, on the way out** — with `quantization` (`engine.quantization`: fp8, mxfp8, nvfp4,
  int4) every weight the engines hold quantised (`weights.quant.payload.quantizable`) is replaced by
  its codes + scales before bucketing, so every transport moves (and `report.bytes` counts) the
  quantised bytes, and the engines copy the codes as they are. DTensor shards (p2p) travel dense and the
  engines quantise them with the same functions; `verify` compares the quantised tensors either way.

The transports (`shm`, `delta`, `broadcast`, `p2p`, `disk`) only decide how
one bucket travels; see their modules, and `factory.make_sender` for choosing
one by name. Every engine call goes through `core.client.EngineControl`, one per
engine. The driver's use, per sync:

    sender = make_sender(cfg.weights.transport, bucket_mb=cfg.weights.bucket_mb, verify=cfg.weights.verify)
    sender.connect(engine_urls, admin_token)          # once, and again after an engine is replaced
    report = sender.push(trainer.state_dict_for_sync(), version, pause_mode="retract")
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
import torch.distributed as dist

from furlong.core.api import PAUSE_MODES
from furlong.core.client import EngineControl, EngineError
from furlong.weights.checksums import compare
from furlong.weights.quant.payload import quantize_for_sync
from furlong.weights.report import EngineResult, SyncReport, WeightSyncError
from furlong.weights.schema import Schema, check_against, engine_schema
from furlong.weights.tensors import dtype_name


class WeightSender(Protocol):
    def connect(self, engine_urls: list[str], admin_token: str | None) -> None: ...

    def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, pause_mode: str | None = None
    ) -> SyncReport: ...

    def close(self) -> None: ...


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layout(group: list[tuple[str, torch.Tensor]], align: int) -> tuple[list[dict[str, Any]], int]:
    """Where each tensor of a bucket goes in one flat buffer: its spec (name, dtype, shape, offset, nbytes)
    and the buffer's size, every offset a multiple of `align` (what the transport's memory needs)."""
    specs, offset = [], 0
    for name, t in group:
        n = nbytes(t)
        specs.append(
            {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": n}
        )
        offset += -(-n // align) * align
    return specs, offset


def buckets(items: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most `bucket_bytes` (a bigger tensor travels alone); never empty."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = bucket_bytes
    for name, t in items:
        if not out or size + nbytes(t) > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes(t)
    return out


class Sender:
    """Shared machinery: engine connections, schema check, versions, pause, per-engine lanes.

    Subclasses implement `_send(items, report)`; inside it they call
    `_post_all(request, last, **body)` per bucket, with `request` an `EngineControl`
    weight-update method. Pass engine URLs, not the router's: versions and failures
    are tracked per engine.
    """

    transport = ""
    every_rank_sends = False  # p2p: True; else only trainer rank 0 talks to the engines

    def __init__(
        self,
        bucket_mb: float = 64,
        timeout_s: float = 600.0,
        check_schema: bool = True,
        verify: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        engine_api: str = "furlong",
        quantization: str = "none",
    ):
        """`engine_api`: whose request shapes the engines take: `furlong` (the built-in engine) or `sglang`,
        whose weight-update requests carry `weight_version` as a string (its io_struct: Optional[str]).
        `quantization`: the engines' `engine.quantization`; other than none, weights go as codes + scales."""
        if engine_api not in ("furlong", "sglang"):
            raise ValueError(f"engine_api: {engine_api!r} is not furlong or sglang")
        if quantization != "none":
            quantize_for_sync([], quantization)  # an unknown format fails here, naming engine.quantization
        self.engine_api = engine_api
        self.quantization = quantization
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb: must be positive, got {bucket_mb}")
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: {self.rank} is outside world_size={self.world_size}")
        # Every trainer rank holds a sender and calls push (the state dict is a collective under
        # FSDP); a rank that sends nothing only drains the iterable.
        self.active = self.every_rank_sends or self.rank == 0
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s = timeout_s
        self.check_schema = check_schema
        self.verify = verify
        self.admin_token: str | None = None
        self._sent: list[tuple[str, torch.Tensor]] | None = None  # set by a transport whose input is not full tensors
        self.urls: list[str] = []
        self.engines: dict[str, EngineControl] = {}
        self.schema: dict[str, Schema | None] = {}
        self._lanes: dict[str, ThreadPoolExecutor] = {}
        self._current: dict[str, int] = {}
        self._new_version = 0
        self._report: SyncReport | None = None

    # ------------------------------------------------------------------ lifecycle
    def connect(self, engine_urls: list[str], admin_token: str | None) -> None:
        if not engine_urls:
            raise ValueError("engine_urls: at least one engine is needed")
        self.close()
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.admin_token = admin_token
        if not self.active:
            return
        self.engines = {u: EngineControl(u, admin_token=admin_token, timeout_s=self.timeout_s) for u in self.urls}
        self._lanes = {u: ThreadPoolExecutor(1, thread_name_prefix="weight-sync") for u in self.urls}
        if self.check_schema:
            self.schema = {u: engine_schema(e) for u, e in self.engines.items()}

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=True)
        self._lanes = {}
        for engine in self.engines.values():
            engine.close()
        self.engines = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ push
    def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, pause_mode: str | None = None
    ) -> SyncReport:
        """Send one full (or delta) set of weights and stamp `version` once on every engine.

        The iterable is drained first (references only: no copy) so the whole
        sync is checked before anything is sent.
        """
        if not self.urls:
            raise RuntimeError("push: call connect(engine_urls, admin_token) first")
        if pause_mode is not None and pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode: unknown mode {pause_mode!r}; choose one of {list(PAUSE_MODES)} or None")
        if not self.active:
            for _ in named_tensors:  # take part in the collective that produces the tensors
                pass
            return SyncReport(self.transport, int(version))
        items = self._prepare(named_tensors)
        if self.quantization != "none":
            items = self._quantize(items)
        self._sent = None
        report = SyncReport(self.transport, int(version), engines={u: EngineResult(u) for u in self.urls})
        self._report, self._new_version = report, int(version)
        self._current = self._on_lanes(EngineControl.weight_version)
        if pause_mode:
            self._on_lanes(EngineControl.pause, pause_mode)
        t0 = time.perf_counter()
        try:
            self._send(items, report)
        finally:
            report.seconds = time.perf_counter() - t0
            if pause_mode:
                self._on_lanes(EngineControl.resume)
        if not report.ok:
            raise WeightSyncError(f"weight sync failed: {report.summary()}", report)
        if self.verify:
            sent = items if self._sent is None else self._sent
            if self.quantization != "none":  # what the engines hold: codes + scales (a no-op for quantised items)
                sent = quantize_for_sync(sent, self.quantization)
            compare(list(self.engines.values()), sent)
            report.verified = True
        return report

    def _quantize(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Every full tensor the engines hold quantised, as codes + scales; DTensor shards stay dense."""
        from torch.distributed.tensor import DTensor

        out: list[tuple[str, torch.Tensor]] = []
        for name, t in items:
            out.extend([(name, t)] if isinstance(t, DTensor) else quantize_for_sync([(name, t)], self.quantization))
        return out

    def _prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        items: list[tuple[str, torch.Tensor]] = []
        seen: set[str] = set()
        for i, pair in enumerate(named_tensors):
            if not (
                isinstance(pair, tuple)
                and len(pair) == 2
                and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)
            ):
                raise WeightSyncError(f"named_tensors[{i}]: expected a (name, Tensor) pair, got {type(pair).__name__}")
            if pair[0] in seen:
                raise WeightSyncError(f"tensor {pair[0]!r}: given twice in one sync")
            seen.add(pair[0])
            items.append(pair)
        if not items:
            raise WeightSyncError("named_tensors: nothing to send")
        for url, schema in self.schema.items():
            # A quantised engine's checksum schema lists its quantised weights by payload name ("x@fp8.data"):
            # those weights are checked by the engine itself, on arrival.
            held_quantised = {n.split("@", 1)[0] for n in schema or () if "@" in n}
            dense = [(n, tuple(t.shape), t.dtype) for n, t in items if n not in held_quantised]
            check_against(schema, dense, url)
        return items

    def _send(self, items: list[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for transports
    def _post_all(self, request: Callable[..., dict[str, Any]], last: bool, **body: Any) -> dict[str, Future]:
        """Queue `request(engine, **body)` on every engine's lane, stamped with the new version only if `last`.

        The engine's current version goes on every other request (see the module docstring);
        a failure is recorded in the report, not raised, so the other engines carry on.
        """
        stamp = str if self.engine_api == "sglang" else (lambda v: v)
        return {
            u: self._lanes[u].submit(
                self._lane_post,
                u,
                request,
                {**body, "weight_version": stamp(self._new_version if last else self._current[u])},
            )
            for u in self.urls
        }

    def _lane_post(self, url: str, request: Callable[..., dict[str, Any]], body: dict[str, Any]) -> None:
        res = self._report.engines[url]
        if not res.ok:  # an earlier bucket failed on this engine: do not pile more on it
            return
        try:
            out = request(self.engines[url], **body)
            res.weight_version = out.get("weight_version", res.weight_version)
            res.requests += 1
        except EngineError as e:
            res.ok, res.error = False, str(e)

    def _on_lanes(self, request: Callable[..., Any], *args: Any, **kw: Any) -> dict[str, Any]:
        """`request(engine, ...)` on every engine's lane, waited for: each engine's answer, by URL."""
        return self._wait({u: self._lanes[u].submit(request, self.engines[u], *args, **kw) for u in self.urls})

    @staticmethod
    def _wait(futures: dict[str, Future]) -> dict[str, Any]:
        """Each future's result, by URL; the first engine that failed raises `WeightSyncError` naming it."""
        out = {}
        for url, f in futures.items():
            try:
                out[url] = f.result()
            except EngineError as e:
                raise WeightSyncError(str(e)) from None
        return out
