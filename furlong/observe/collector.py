"""One writer for a multi-node run: a Ray actor that owns `events.sqlite`.

On one node every process opens the SQLite file itself (WAL handles it). On a
Ray cluster the run directory lives on the driver's node, so processes on other
nodes cannot open it; they use `remote_store(actor)` instead — the same
`EventStore` API, batching and drop counting, whose writer thread ships each
encoded batch to the collector rather than to a local file. The collector runs
on the driver's node (pin it there with `options(scheduling_strategy=...)` when
the driver is not a Ray node itself) and writes each batch in one transaction.

    actor = collector_actor(run_dir)                      # driver, once
    store = remote_store(actor, tokenizer=tok)            # any process, any node
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from furlong.observe.store import DB_NAME, EventStore, SqliteWriter

ACTOR_NAME = "furlong-event-collector"


class CollectorActor:
    """The actor class (wrapped with `ray.remote` by `collector_actor`): writes encoded batches to one file."""

    def __init__(self, run_dir: str):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.writer = SqliteWriter(Path(run_dir) / DB_NAME)
        self.batches = 0

    def write(self, rows: Mapping[str, list[tuple]]) -> int:
        self.writer.write(rows)
        self.batches += 1
        return self.batches

    def ping(self) -> str:
        return str(self.writer.path)


def collector_actor(run_dir: str | Path, *, name: str = ACTOR_NAME, **options: Any) -> Any:
    """The run's collector actor: created on first call, found by name afterwards (from any process)."""
    import ray

    cls = ray.remote(num_cpus=0)(CollectorActor)
    actor = cls.options(name=name, get_if_exists=True, max_concurrency=1, **options).remote(str(run_dir))
    ray.get(actor.ping.remote())  # fail here, clearly, if the run directory cannot be opened
    return actor


def remote_store(actor: Any, run_dir: str | Path = "", **kwargs: Any) -> EventStore:
    """An EventStore whose batches go to `actor` (blocking per batch, so the collector applies back-pressure)."""
    import ray

    def write(rows: Mapping[str, list[tuple]]) -> None:
        ray.get(actor.write.remote(dict(rows)))

    return EventStore(run_dir or ".", writer=write, **kwargs)
