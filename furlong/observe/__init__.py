"""Observability: the event store (spans, metrics, per-token samples) and metric sinks.

`EventStore` is what every process calls; `furlong.dashboard` reads what it wrote.
"""

from furlong.observe.store import DB_NAME, PHASES, EventStore

__all__ = ["DB_NAME", "PHASES", "EventStore"]
