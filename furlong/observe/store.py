"""The event store: spans, metrics and per-token samples in `RUN_DIR/events.sqlite`.

Why SQLite in WAL mode: it is embedded, every process of a run can write while the
dashboard reads, and a run directory stays one self-describing folder (on a multi-node
Ray cluster remote processes forward rows to one `CollectorActor`: `collector.py`).

Why a background thread and a bounded queue: the trainer must never wait on disk.
A call such as `store.metrics(step, {...})` only snapshots its arguments into a
tuple and puts it on a queue (microseconds); a writer thread drains the queue in
batches and writes each batch in one transaction with `executemany`. When the
queue is full a call waits at most `max_block_s`, then the event is dropped and
*counted*: `store.dropped` and the `meta` table (`dropped_events:<host>:<pid>`)
say how many, the dashboard shows it, and `close()` logs a warning.

Public API (the driver, trainer ranks, engines and router all call the same):

    store = EventStore(run_dir, tokenizer=tok)          # one per process
    with store.span("trainer/0", "forward-backward", step, device="cpu:0"):
        ...
    store.metrics(step, {"loss/total": 0.3, "rollout/reward_mean": 0.5})
    store.samples(step, samples, train_logprobs=lps, advantages=advs, version=v)
    store.rewind(step)                                  # a resume: rows after `step` go
    store.flush(); store.close()

Per-token provenance is one column-wise JSON blob per sample (`samples.tokens`: ids,
text, rollout and train log-probs, advantage, loss mask, version and source of each
response token), so a 64 × 512-token step is 64 inserts; `reader.py` unpacks it.
"""

from __future__ import annotations

import atexit
import base64
import json
import logging
import math
import os
import queue
import socket
import sqlite3
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from furlong.core.sample import Sample, Status

log = logging.getLogger("furlong.observe")

DB_NAME = "events.sqlite"
SCHEMA_VERSION = 1
# Phases the dashboard knows by colour live with the recorder (furlong/core/spans.py); any other string is drawn grey.

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS spans(
  id INTEGER PRIMARY KEY, worker TEXT NOT NULL, device TEXT NOT NULL, phase TEXT NOT NULL,
  step INTEGER, start REAL NOT NULL, end REAL NOT NULL, attrs TEXT);
CREATE TABLE IF NOT EXISTS metrics(
  id INTEGER PRIMARY KEY, step INTEGER NOT NULL, name TEXT NOT NULL, value REAL, time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS samples(
  id INTEGER PRIMARY KEY, step INTEGER NOT NULL, idx INTEGER NOT NULL, grp INTEGER NOT NULL,
  reward REAL, reward_detail TEXT, status TEXT NOT NULL, status_reason TEXT, staleness INTEGER,
  prompt_length INTEGER NOT NULL, response_length INTEGER NOT NULL, trained_tokens INTEGER NOT NULL,
  version_min INTEGER, version_max INTEGER, prompt_text TEXT, response_text TEXT,
  time REAL NOT NULL, tokens TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS spans_step ON spans(step);
CREATE INDEX IF NOT EXISTS metrics_name_step ON metrics(name, step);
CREATE INDEX IF NOT EXISTS samples_step_grp ON samples(step, grp);
"""

SPAN_SQL = "INSERT INTO spans(worker, device, phase, step, start, end, attrs) VALUES (?,?,?,?,?,?,?)"
METRIC_SQL = "INSERT INTO metrics(step, name, value, time) VALUES (?,?,?,?)"
SAMPLE_SQL = (
    "INSERT INTO samples(step, idx, grp, reward, reward_detail, status, status_reason, staleness, prompt_length,"
    " response_length, trained_tokens, version_min, version_max, prompt_text, response_text, time, tokens)"
    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
)


def connect(path: str | Path, *, timeout_s: float = 10.0) -> sqlite3.Connection:
    """A writing connection in WAL mode with the schema in place (idempotent, safe to race)."""
    conn = sqlite3.connect(str(path), timeout=timeout_s, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints, no fsync per commit
    conn.executescript(SCHEMA)
    conn.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    return conn


class SqliteWriter:
    """Writes encoded rows to one database: one transaction per batch. Used by the store and the collector."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None

    def write(self, rows: Mapping[str, list[tuple]]) -> None:
        if self._conn is None:
            self._conn = connect(self.path)
        c = self._conn
        c.execute("BEGIN IMMEDIATE")
        try:
            for table, sql in (("spans", SPAN_SQL), ("metrics", METRIC_SQL), ("samples", SAMPLE_SQL)):
                if rows.get(table):
                    c.executemany(sql, rows[table])
            if rows.get("meta"):
                c.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?,?)", rows["meta"])
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _floats(values: Any, n: int, name: str, index: int) -> list[float] | None:
    """A per-token float list of length n from a list, tensor, ndarray or scalar (broadcast); None stays None."""
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (int, float)):
        return [float(values)] * n
    out = [float(v) for v in values]
    if len(out) != n:
        raise ValueError(f"EventStore.samples: sample {index}: len({name})={len(out)} != response_length={n}")
    return out


def _nullable(x: float) -> float | None:
    return x if math.isfinite(x) else None


class _Flush:
    """Queue marker: the writer sets `done` once every item queued before it is written."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class EventStore:
    """See the module docstring. `enabled=False` keeps the API but writes nothing (sinks still receive metrics)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tokenizer: Any = None,
        sinks: Sequence[Any] = (),
        enabled: bool = True,
        queue_size: int = 10_000,
        batch_size: int = 512,
        flush_interval_s: float = 0.25,
        max_block_s: float = 0.05,
        writer: Callable[[Mapping[str, list[tuple]]], None] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        self.tokenizer = tokenizer
        self.sinks = list(sinks)
        self.enabled = enabled
        self.queue_size, self.batch_size = queue_size, batch_size
        self.flush_interval_s, self.max_block_s = flush_interval_s, max_block_s
        self.dropped = 0  # events lost to a full queue or a failed write; never silent
        self.written = 0
        self._custom_writer = writer
        self._text_cache: dict[int, str] = {}
        self._dropped_key = f"dropped_events:{socket.gethostname()}:{os.getpid()}"
        self._reported_dropped = 0
        self._drop_lock = threading.Lock()
        self._closed = False
        self._pid = -1
        if enabled:
            if writer is None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                connect(self.path).close()  # schema now, so readers and bad paths fail early and clearly
            self._start()
            atexit.register(self.close)

    # ---------------------------------------------------------------- public API
    @contextmanager
    def span(
        self, worker: str, phase: str, step: int | None = None, *, device: str = "", **attrs: Any
    ) -> Iterator[None]:
        """Time a block as one span of `worker` (a timeline lane) in `phase` during `step`."""
        start = time.time()
        try:
            yield
        except BaseException as e:
            attrs["error"] = type(e).__name__
            raise
        finally:
            self.record_span(worker, phase, step, start, time.time(), device=device, **attrs)

    def record_span(
        self, worker: str, phase: str, step: int | None, start: float, end: float, *, device: str = "", **attrs: Any
    ) -> None:
        """A span timed elsewhere (e.g. an engine reporting its own generate time); times are Unix seconds."""
        if end < start:
            raise ValueError(f"EventStore.record_span: end {end} is before start {start} ({worker}/{phase})")
        if not self.enabled:
            return
        extra = json.dumps(attrs, default=str) if attrs else None
        self._put(("spans", (str(worker), str(device), str(phase), step, float(start), float(end), extra)))

    def metric(self, step: int, name: str, value: float) -> None:
        self.metrics(step, {name: value})

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Record several scalars of one step (tensors and numpy scalars are fine); also sent to every sink."""
        now = time.time()
        clean = {str(k): float(v) for k, v in values.items()}
        if clean:
            self._put(("metrics", [(int(step), k, _nullable(v), now) for k, v in clean.items()]))
        for sink in self.sinks:
            sink.log(int(step), clean)

    def samples(
        self,
        step: int,
        samples: Iterable[Sample],
        train_logprobs: Sequence[Any] | None = None,
        advantages: Sequence[Any] | None = None,
        *,
        version: int | None = None,
    ) -> None:
        """Record samples with per-token provenance.

        `train_logprobs[i]` and `advantages[i]` are per response token (lists or tensors);
        an advantage may also be one scalar per sample (GRPO), broadcast to its tokens.
        Staleness is `metadata["staleness"]` when the rollout manager set it, else
        `version - oldest policy token version` when `version` (the trainer's) is given.
        """
        if not self.enabled:
            return
        samples = list(samples)
        for name, per in (("train_logprobs", train_logprobs), ("advantages", advantages)):
            if per is not None and len(per) != len(samples):
                raise ValueError(f"EventStore.samples: {len(per)} {name} for {len(samples)} samples")
        now = time.time()
        batch = []
        for i, s in enumerate(samples):
            n = s.response_length
            stale = s.metadata.get("staleness")
            if stale is None and version is not None and s.oldest_version() is not None:
                stale = version - s.oldest_version()
            policy_versions = [v for v, src in zip(s.token_versions, s.token_sources) if src == "policy" and v >= 0]
            batch.append(
                {
                    "step": int(step),
                    "index": s.index,
                    "group": s.group_index,
                    "reward": s.reward,
                    "status": Status(s.status).value,
                    "reason": s.status_reason,
                    "staleness": stale,
                    "prompt": s.prompt,
                    "prompt_length": s.prompt_length,
                    "response_length": n,
                    "response_text": s.metadata.get("response_text"),
                    "time": now,
                    "versions": (min(policy_versions), max(policy_versions)) if policy_versions else (None, None),
                    "ids": list(s.response_tokens),
                    "logprob": list(s.rollout_logprobs),
                    "train_logprob": _floats(
                        train_logprobs[i] if train_logprobs is not None else None, n, "train_logprobs", s.index
                    ),
                    "advantage": _floats(advantages[i] if advantages is not None else None, n, "advantages", s.index),
                    "loss_mask": list(s.loss_mask),
                    "version": list(s.token_versions),
                    "source": list(s.token_sources),
                    "teacher_logprob": list(s.teacher_logprobs) if s.teacher_logprobs is not None else None,
                }
            )
        if batch:
            self._put(("samples", batch))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything recorded so far is written; False if that took longer than `timeout_s`."""
        if not self.enabled or self._closed:
            return True
        self._ensure_writer()
        marker = _Flush()
        try:
            self._queue.put(marker, timeout=timeout_s)
        except queue.Full:
            return False
        self._wake.set()
        return marker.done.wait(timeout_s)

    def rewind(self, step: int) -> None:
        """Delete the rows of every step after `step`: a resumed run records them again, once."""
        if not self.enabled or self._custom_writer is not None:
            return
        if not self.flush():
            raise RuntimeError(f"event store {self.path}: the queued events were not written; not rewinding")
        cut = "".join(f"DELETE FROM {t} WHERE step > {int(step)};" for t in ("spans", "metrics", "samples"))
        conn = connect(self.path)
        try:
            conn.executescript(f"BEGIN IMMEDIATE;{cut}COMMIT;")
        finally:
            conn.close()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, stop the writer thread and close every sink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.enabled and self._pid == os.getpid() and self._thread.is_alive():
            self._queue.put(_STOP)
            self._wake.set()
            self._thread.join(timeout_s)
        for sink in self.sinks:
            sink.close()
        if self.dropped:
            log.warning("event store %s: %d events were dropped (queue full or write failed)", self.path, self.dropped)

    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _start(self) -> None:
        self._pid = os.getpid()
        self._queue: queue.Queue = queue.Queue(self.queue_size)
        self._wake = threading.Event()
        self._sink_rows = self._custom_writer or SqliteWriter(self.path).write
        self._thread = threading.Thread(target=self._run, name="furlong-events", daemon=True)
        self._thread.start()

    def _ensure_writer(self) -> None:
        # After a fork the child has the queue but no writer thread (threads do not survive fork): start its own.
        if self._pid != os.getpid():
            self._start()

    def _put(self, item: tuple) -> None:
        if not self.enabled or self._closed:
            return
        self._ensure_writer()
        try:
            self._queue.put_nowait(item)
            if self._queue.qsize() > self.queue_size // 2:
                self._wake.set()
        except queue.Full:
            self._wake.set()
            try:
                self._queue.put(item, timeout=self.max_block_s)
            except queue.Full:
                self._count_dropped(len(item[1]) if isinstance(item[1], list) else 1)

    def _count_dropped(self, n: int) -> None:
        with self._drop_lock:
            self.dropped += n

    def _run(self) -> None:
        """Take the first event, linger `flush_interval_s` so a step's writes form one batch (and the encoding
        runs while the trainer is back in its GIL-free compute), then write what is queued in one transaction.
        flush(), close() and a queue half full cut the lingering short."""
        q = self._queue
        while True:
            items = [q.get()]
            if isinstance(items[0], tuple):
                self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            while len(items) < self.batch_size:
                try:
                    items.append(q.get_nowait())
                except queue.Empty:
                    break
            data = [it for it in items if isinstance(it, tuple)]
            if data or self.dropped != self._reported_dropped:
                self._write(data)
            for it in items:
                if isinstance(it, _Flush):
                    it.done.set()
            if any(it is _STOP for it in items):
                return

    def _write(self, items: list[tuple]) -> None:
        n_events = sum(len(payload) if isinstance(payload, list) else 1 for _, payload in items)
        dropped = self.dropped
        try:
            rows = self._encode(items)
            if dropped != self._reported_dropped:
                rows["meta"] = [(self._dropped_key, str(dropped))]
            self._sink_rows(rows)
            self._reported_dropped = dropped
            self.written += n_events
        except Exception as e:  # a failed write must not kill the writer thread or the trainer: count it
            self._count_dropped(n_events)
            log.warning("event store %s: a write of %d events failed: %s", self.path, n_events, e)

    def _encode(self, items: list[tuple]) -> dict[str, list[tuple]]:
        rows: dict[str, list[tuple]] = {"spans": [], "metrics": [], "samples": []}
        for table, payload in items:
            if table == "spans":
                rows["spans"].append(payload)
            elif table == "metrics":
                rows["metrics"].extend(payload)
            else:
                rows["samples"].extend(self._sample_row(d) for d in payload)
        return rows

    def _token_text(self, ids: list[int]) -> list[str] | None:
        if self.tokenizer is None:
            return None
        cache, out = self._text_cache, []
        for t in ids:
            text = cache.get(t)
            if text is None:
                text = cache[t] = self.tokenizer.decode([t])
            out.append(text)
        return out

    def _sample_row(self, d: dict[str, Any]) -> tuple:
        reward, detail = d["reward"], None
        if isinstance(reward, dict):
            detail = json.dumps(reward)
            reward = reward.get("score")
        reward = _nullable(float(reward)) if reward is not None else None
        prompt = d["prompt"] if isinstance(d["prompt"], str) else json.dumps(d["prompt"], ensure_ascii=False)
        text = self._token_text(d["ids"])
        response = d["response_text"]
        if response is None and self.tokenizer is not None:
            response = self.tokenizer.decode(d["ids"])
        tokens = {k: pack(d[k], code) for k, code in PACKED.items()}
        tokens.update(source=d["source"], text=text)
        blob = json.dumps(tokens, separators=(",", ":"), default=_json_default)
        vmin, vmax = d["versions"]
        return (
            d["step"],
            d["index"],
            d["group"],
            reward,
            detail,
            d["status"],
            d["reason"],
            d["staleness"],
            d["prompt_length"],
            d["response_length"],
            sum(d["loss_mask"]),
            vmin,
            vmax,
            prompt,
            response,
            d["time"],
            blob,
        )


# Per-token numbers are stored as base64 of little-endian arrays (int32 'i', float32 'f'): ~4x smaller than
# JSON numbers and ~5x cheaper to encode, which is most of the writer's work. float32 is ample for log-probs.
PACKED = {
    "ids": "i",
    "logprob": "f",
    "train_logprob": "f",
    "advantage": "f",
    "loss_mask": "b",
    "version": "i",
    "teacher_logprob": "f",
}


def pack(values: list[Any] | None, code: str) -> str | None:
    if values is None:
        return None
    a = array(code, values)
    if sys.byteorder == "big":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def unpack(blob: str | list | None, code: str) -> list[Any] | None:
    """The inverse of `pack`; a plain list (or None) passes through."""
    if blob is None or isinstance(blob, list):
        return blob
    a = array(code)
    a.frombytes(base64.b64decode(blob))
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def _json_default(x: Any) -> Any:
    raise TypeError(f"cannot store {type(x).__name__} in the event store")
