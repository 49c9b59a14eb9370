"""Shared fixtures: tiny models built locally (cached), thread limits for a 2-core machine."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest

from tests.fixtures.real_run import real_run_dir  # noqa: F401 - one shared real 2x2 run (session)


@pytest.fixture(scope="session")
def tiny_model_dir():
    from furlong.models import create_model

    return create_model("qwen3", "tiny")


@pytest.fixture(scope="session")
def tiny_moe_dir():
    from furlong.models import create_model

    return create_model("qwen3_moe", "tiny")


def pytest_collection_modifyitems(config, items):
    """Files with a `slow` test first, each file kept whole: with `-n 2 --dist loadfile` (scripts/run-tests.sh)
    the long runs start at once on both workers instead of leaving one worker a long tail at the end."""
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.nodeid.split("::")[0] not in slow_files, order[id(item)]))
