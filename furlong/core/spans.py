"""Per-process span recording: what each worker (engine, router, trainer rank, driver, environment) was doing.

Why a process-local ring buffer read by the driver, and not each process writing the event store:

- engines and the router are plain subprocesses (no Ray, maybe another node, maybe no access to the
  run directory); every process already answers the driver over HTTP or Ray, so the driver *pulls*
  their spans (`SPANS_PATH` on servers, `TrainerActor.spans` on ranks) and writes them with its own
  `EventStore`: one writer, one path into `events.sqlite`, whatever the topology;
- recording must be cheap enough to leave on: `record` appends one list to a `deque` under a lock
  (about a microsecond); nothing is encoded, sent or written on the hot path;
- reading is idempotent (`since(seq)` returns the spans after a sequence number and never clears), so
  a failed or repeated pull loses nothing and two readers do not steal each other's spans;
- it is bounded: the oldest spans fall off a full buffer and the reader is told how many it missed.

Consecutive scheduler steps of the same kind (`merge=True`) are folded into one span while nobody
has read them yet, summing their counters: a lane of 300 decode steps becomes a few spans, not 300.

Spans use wall-clock Unix seconds (`time.time()`): lanes from different processes share one axis on
one node; across nodes the axis is as good as the nodes' clock sync.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Phases the dashboard knows by colour (any other string is accepted and drawn grey), by who records them.
PHASES = (
    *("generate", "reward", "filter", "buffer-wait", "idle", "weight-sync", "eval", "cores-lent"),  # driver
    *("prefill", "decode", "paused", "weight-apply"),  # engines
    *("route", "retry"),  # router
    *("old-logprob", "ref-logprob", "forward-backward", "optimiser", "checkpoint-save", "weight-push"),  # ranks
    *("tool-call", "env-step", "sandbox-run"),  # environments
)
SPANS_PATH = "/get_spans"  # GET ?since=SEQ on the built-in engine and the router: {"seq", "spans", "missed", ...}
MERGE_GAP_S = 0.005  # steps closer than this (and of the same worker, phase and step) fold into one span
SUMMED = ("tokens", "steps", "preempted", "samples", "calls", "groups")  # counters a merge adds up
MAXED = ("batch", "kv_usage")  # gauges a merge keeps the maximum of


class SpanRecorder:
    """A bounded, thread-safe buffer of spans: `[seq, worker, device, phase, step, start, end, attrs]`."""

    def __init__(self, capacity: int = 50_000):
        self._buf: deque[list[Any]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq = 0
        self._read = 0  # the highest seq a reader has seen: spans up to it are never merged into again
        self.enabled = os.environ.get("FURLONG_SPANS", "1") != "0"

    def record(
        self,
        worker: str,
        phase: str,
        start: float,
        end: float,
        step: int | None = None,
        *,
        device: str = "",
        merge: bool = False,
        **attrs: Any,
    ) -> None:
        """One span, timed by the caller (Unix seconds). `merge`: fold into the previous span when contiguous."""
        if not self.enabled:
            return
        with self._lock:
            last = self._buf[-1] if self._buf else None
            if (
                merge
                and last is not None
                and last[0] > self._read
                and last[1] == worker
                and last[3] == phase
                and last[4] == step
                and 0 <= start - last[6] <= MERGE_GAP_S
            ):
                last[6] = end
                old = last[7]
                for k, v in attrs.items():
                    if k in SUMMED and k in old:
                        old[k] += v
                    elif k in MAXED and k in old:
                        old[k] = max(old[k], v)
                    else:
                        old[k] = v
                return
            self._seq += 1
            self._buf.append([self._seq, worker, device, phase, step, start, end, dict(attrs)])

    @contextmanager
    def span(
        self, worker: str, phase: str, step: int | None = None, *, device: str = "", **attrs: Any
    ) -> Iterator[dict]:
        """Time a block; the yielded dict takes attributes known only at the end (e.g. tokens)."""
        start = time.time()
        extra: dict[str, Any] = dict(attrs)
        try:
            yield extra
        except BaseException as e:
            extra["error"] = type(e).__name__
            raise
        finally:
            self.record(worker, phase, start, time.time(), step, device=device, **extra)

    def since(self, seq: int = 0) -> dict[str, Any]:
        """The spans after `seq`, how many of them fell off the buffer, and this process's CPU time."""
        with self._lock:
            spans = [list(s[:7]) + [dict(s[7])] for s in self._buf if s[0] > seq]
            first = self._buf[0][0] if self._buf else self._seq + 1
            self._read = max(self._read, self._seq)
            last = self._seq
        missed = max(0, first - seq - 1) if seq < last else 0
        t = os.times()
        return {
            "seq": last,
            "spans": spans,
            "missed": missed,
            "pid": os.getpid(),
            "cpu_s": t[0] + t[1],
            "time": time.time(),
        }


RECORDER = SpanRecorder()  # the process's one recorder; every instrumented module records here
record = RECORDER.record
span = RECORDER.span
