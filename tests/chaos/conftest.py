"""Fixtures of the chaos tests (their helpers are in `chaos_run.py`)."""

from __future__ import annotations

import chaos_run  # noqa: F401 - sets PYTHONPATH before any Ray worker starts
import pytest


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """Ray stays up across a module's runs (the first run starts it) and is shut down after."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
