"""The timeline's one path into the event store: the driver pulls every process's spans once per step.

Each process records into its own `furlong.core.spans` buffer (cheap, no I/O); `SpanPuller.pull(step)`
reads the spans after its cursor from every source — the driver's own buffer (rollout, rewards,
filters, environments), each engine and the router over HTTP (`SPANS_PATH`), each trainer rank over
Ray (`TrainerGroup.spans`) — names their lanes (`engine/<i>`, `trainer/<r>`, `router`, `driver`,
`env`), stamps the step on spans that did not know it (the step they started in: the driver says
when each step ends), and writes them with the driver's `EventStore`. The driver starts each pull
in the background when its step ends and waits for it only before the next one or a checkpoint.
`furlong.core.spans` says why pull and not push.

The same reads give per-step utilisation metrics: `cpu/<lane>` (cores busy: CPU seconds over wall
seconds of that process since the last pull), `perf/mfu/engine/<i>` and `perf/mfu/trainer/<r>` (FLOPs
counted from the model config over the step's wall time and the peak; `furlong.models.flops`), and
`gpu/<i>/util`, `gpu/<i>/memory_gb` from NVML when present. A source that does not answer (an engine
being replaced, an SGLang engine without the endpoint) is skipped for the step, never fatal.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import httpx

from furlong.core import spans as core_spans
from furlong.core.net import tls_context
from furlong.models.flops import model_flops, peak_flops
from furlong.observe import utilisation

log = logging.getLogger("furlong.observe")
TRAINER_FLOPS_FACTOR = 3.0  # forward + backward (twice the forward) per trained token


class SpanPuller:
    """Reads spans from every process of a run into one `EventStore` (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        *,
        engine_urls: Callable[[], list[str]] = list,
        router_url: str = "",
        trainers: Any = None,
        model_dir: str | None = None,
        timeout_s: float = 5.0,
    ):
        self.store, self.engine_urls, self.router_url, self.trainers = store, engine_urls, router_url, trainers
        self.timeout_s = timeout_s
        self.flops = model_flops(model_dir) if model_dir else None
        self.peak = peak_flops(device="auto")[0] if self.flops else None
        self._cursor: dict[str, tuple[int, int]] = {}  # source -> (pid, seq)
        self._cpu: dict[str, tuple[float, float]] = {}  # lane -> (cpu_s, time) at the last pull
        self.missed = 0
        self._last_pull = time.time()
        self._task: asyncio.Future | None = None
        self._created = time.time()
        self._ends: list[float] = []  # when each step ended (`start`), in order
        self._steps: list[int] = []
        self._flops: dict[int, dict[str, float]] = {}  # step -> lane -> FLOPs counted from its spans
        self.blocked_s = 0.0

    def start(self, step: int, write: Callable[[dict[str, float]], None] | None = None) -> None:
        """`step` ends now: pull in the background, off the driver's critical path. The step's end is kept: a
        span that does not know its step gets the one it started in.

        `write(utilisation)` records the step's row with the pull's metrics merged in (called once, with {}
        when the pull failed), so `metrics.jsonl` keeps one row per step; without it they go to the store
        as a row of their own."""
        self._ends.append(time.time())
        self._steps.append(step)
        self._task = asyncio.ensure_future(self._record(step, write))

    async def wait(self) -> None:
        """Until the background pull (if any) is written: before a checkpoint, and before the next pull."""
        task, self._task = self._task, None
        if task is not None:
            t0 = time.perf_counter()
            await task
            self.blocked_s = time.perf_counter() - t0  # what the background pull cost the driver's loop

    async def _record(self, step: int, write: Callable[[dict[str, float]], None] | None) -> None:
        extra: dict[str, float] = {}
        try:
            extra = await self.pull(step)
        except Exception as e:  # noqa: BLE001 - telemetry never stops a run (nor loses its row)
            log.warning("timeline: the pull of step %d failed: %s", step, e)
        if write is not None:
            write(extra)
        elif extra:
            self.store.metrics(step, extra)

    async def pull(self, step: int, final: bool = False) -> dict[str, float]:
        """Write every source's new spans; the utilisation metrics of `step`.

        A span without a step gets the step it started in (by the ends `start` kept): one that started
        after the last end belongs to the next step, or to `step` when `final` (the run is over) or
        when no step has ended through `start` (a pull driven by hand)."""
        now, t0 = time.time(), time.perf_counter()
        wall, self._last_pull = max(1e-6, now - self._last_pull), now
        if self._ends and self._steps[-1] == step:
            wall = self._ends[-1] - (self._ends[-2] if len(self._ends) > 1 else self._created)
        later = step + 1 if self._ends and not final else step
        reads = [("driver", core_spans.RECORDER.since(self._seq("driver")))]
        urls = list(self.engine_urls())
        if self.router_url:
            urls.append(self.router_url)
        names = [f"engine/{i}" for i in range(len(urls) - bool(self.router_url))] + ["router"] * bool(self.router_url)
        async with httpx.AsyncClient(timeout=self.timeout_s, verify=tls_context()) as client:
            answers = await asyncio.gather(*(self._http(client, n, u) for n, u in zip(names, urls)))
        reads += [(n, a) for n, a in zip(names, answers) if a is not None]
        if self.trainers is not None:
            try:
                ranks = await self.trainers.spans([self._seq(f"trainer/{r}") for r in range(len(self.trainers))])
                reads += [(f"trainer/{r}", a) for r, a in enumerate(ranks)]
            except Exception as e:  # noqa: BLE001 - a dead rank is the restart policy's business, not ours
                log.warning("timeline: trainer spans not read at step %d: %s", step, e)
        metrics: dict[str, float] = {}
        for source, answer in reads:
            metrics.update(self._write(source, answer, later))
        flops = self._flops.pop(step, {})
        for old in [n for n in self._flops if n < step]:  # spans of a past step read late: their step is written
            del self._flops[old]
        if self.peak:
            metrics.update({f"perf/mfu/{lane}": f / (wall * self.peak) for lane, f in flops.items()})
        metrics.update({f"perf/tflops/{lane}": f / wall / 1e12 for lane, f in flops.items()})
        metrics.update(utilisation.gpu_stats())
        metrics["time/timeline_pull_s"] = time.perf_counter() - t0  # the pull's duration (in the background)
        metrics["time/timeline_blocked_s"] = self.blocked_s  # how long the driver waited on the previous pull
        return metrics

    def _seq(self, source: str) -> int:
        return self._cursor.get(source, (0, 0))[1]

    async def _http(self, client: httpx.AsyncClient, source: str, url: str) -> dict[str, Any] | None:
        """One server's spans after the cursor; a restarted process (new pid) is read from its start."""
        try:
            r = await client.get(url.rstrip("/") + core_spans.SPANS_PATH, params={"since": self._seq(source)})
            if r.status_code != 200:
                return None
            answer = r.json()
            if self._cursor.get(source, (answer["pid"], 0))[0] != answer["pid"]:
                self._cursor[source] = (answer["pid"], 0)
                r = await client.get(url.rstrip("/") + core_spans.SPANS_PATH, params={"since": 0})
                answer = r.json()
            return answer
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def _step_of(self, start: float, later: int) -> int:
        i = bisect.bisect_left(self._ends, start)
        return self._steps[i] if i < len(self._ends) else later

    def _write(self, source: str, answer: dict[str, Any], later: int) -> dict[str, float]:
        self._cursor[source] = (answer["pid"], answer["seq"])
        self.missed += answer.get("missed", 0)
        for _seq, worker, device, phase, span_step, start, end, attrs in answer["spans"]:
            lane = self._lane(source, worker)
            s = self._step_of(start, later) if span_step is None else span_step
            self.store.record_span(lane, phase, s, start, end, device=device, **attrs)
            if self.flops and attrs.get("tokens"):
                flops = self._flops.setdefault(s, defaultdict(float))
                if phase in ("prefill", "decode"):
                    flops[lane] += self.flops * attrs["tokens"]
                elif phase == "forward-backward":
                    flops[lane] += TRAINER_FLOPS_FACTOR * self.flops * attrs["tokens"]
        lane = source if source != "driver" else "driver"
        out = {}
        prev = self._cpu.get(lane)
        if prev is not None and answer["time"] > prev[1]:
            out[f"cpu/{lane}"] = max(0.0, answer["cpu_s"] - prev[0]) / (answer["time"] - prev[1])
        self._cpu[lane] = (answer["cpu_s"], answer["time"])
        return out

    @staticmethod
    def _lane(source: str, worker: str) -> str:
        """An engine's spans say only "engine": its lane is the source's (`engine/<i>`); a colocated engine's
        (recorded in trainer rank 0's process) is `engine/0`. Trainer ranks and the driver name their own."""
        if worker == "engine":
            return source if source.startswith("engine/") else "engine/0"
        return worker
