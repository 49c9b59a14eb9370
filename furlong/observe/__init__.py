"""Observability: the event store (spans, metrics, per-token samples) and metric sinks.

`EventStore` is what every process calls; `furlong.dashboard` reads what it wrote.
"""

from furlong.core.spans import PHASES
from furlong.observe.store import DB_NAME, EventStore

__all__ = ["DB_NAME", "PHASES", "EventStore"]
