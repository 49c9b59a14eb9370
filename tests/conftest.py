"""Shared fixtures: tiny models built locally (cached), thread limits for a 2-core machine."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    from furlong.models import create_model

    return create_model("qwen3", "tiny")


@pytest.fixture(scope="session")
def tiny_moe_dir():
    from furlong.models import create_model

    return create_model("qwen3_moe", "tiny")
