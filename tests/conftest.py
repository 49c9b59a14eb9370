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


def _share_tls_context() -> None:
    """In this process, httpx clients made without a TLS context (the tests' `httpx.get` health polls, the
    OpenAI SDK's client) get furlong's shared one: httpx would load the CA bundle for each (~45 ms of CPU),
    and a poll every 50 ms then takes most of a core from the server it waits for. furlong's own code passes
    the context itself (tests/unit/test_net.py checks every call and undoes this patch to count builds)."""
    import httpx._transports.default as transports

    from furlong.core.net import tls_context

    build = transports.create_ssl_context

    def shared(verify=True, cert=None, trust_env=True):
        return tls_context() if verify is True and cert is None else build(verify, cert, trust_env)

    transports.create_ssl_context = shared


_share_tls_context()

try:  # the run-tests.sh scheduler: `--dist loadfile` that does not hang after a crashed worker
    from tests.xdist_scheduling import pytest_xdist_make_scheduler  # noqa: F401
except ImportError:  # pytest-xdist not installed: serial runs need no scheduler
    pass


@pytest.fixture(scope="session")
def tiny_model_dir():
    from furlong.models import create_model

    return create_model("qwen3", "tiny")


@pytest.fixture(scope="session")
def tiny_moe_dir():
    from furlong.models import create_model

    return create_model("qwen3_moe", "tiny")


def pytest_collection_modifyitems(config, items):
    """Files with a `slow` test first, the one with the largest pytest timeout first among them (the
    timeout is the best duration estimate collection has), each file kept whole. With `-n 2 --dist loadfile
    --no-loadscope-reorder` (scripts/run-tests.sh) the longest runs start at once on both workers instead
    of leaving one worker a long tail at the end (xdist's default reorder puts files with many tests first).
    Files marked `envs` go last of all: `make test` builds their connectors' environments while the rest runs."""

    def file_of(item) -> str:
        return item.nodeid.split("::")[0]

    slow_files = {file_of(item) for item in items if item.get_closest_marker("slow")}
    env_files = {file_of(item) for item in items if item.get_closest_marker("envs")}
    longest: dict[str, float] = {}
    for item in items:
        mark = item.get_closest_marker("timeout")
        t = float(mark.args[0]) if mark is not None and mark.args else float(config.getini("timeout") or 0)
        longest[file_of(item)] = max(longest.get(file_of(item), 0.0), t)
    order = {id(item): i for i, item in enumerate(items)}
    first = {}
    for item in items:
        first.setdefault(file_of(item), order[id(item)])
    items.sort(
        key=lambda item: (
            file_of(item) in env_files,
            file_of(item) not in slow_files,
            -longest[file_of(item)] if file_of(item) in slow_files else 0.0,
            first[file_of(item)],
            order[id(item)],
        )
    )
