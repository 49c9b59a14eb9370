"""The dashboard: a FastAPI JSON API over a run's event store and a static page (plain JS + SVG, no CDN)."""
