"""Connectors: environments from other agent-RL packages, each driven in its own virtual environment.

    openenv     OpenEnv environment servers (reset / step over HTTP)
    verifiers   Verifiers tasksets
    nemo-gym    NeMo Gym resources servers and agents
    harbor      Harbor trials

Each connector module defines `SPEC` (a `venvs.VenvSpec`: the package's Python and
pinned requirements) and what furlong calls: an `Environment` (`envs.name`) or an
agent (`rollout.agent_fn`). `furlong envs setup NAME` builds its environment ahead of
time; otherwise the first use does. See docs/connectors.md.
"""

from __future__ import annotations

import importlib
from typing import Any

CONNECTORS = {
    "openenv": "furlong.envs.connectors.openenv",
    "verifiers": "furlong.envs.connectors.verifiers",
    "nemo-gym": "furlong.envs.connectors.nemo_gym",
    "harbor": "furlong.envs.connectors.harbor",
}


def connector(name: str) -> Any:
    """The connector module for `name`, or ValueError listing the known ones."""
    if name not in CONNECTORS:
        raise ValueError(f"unknown connector {name!r}; known: {sorted(CONNECTORS)}")
    return importlib.import_module(CONNECTORS[name])


def spec(name: str) -> Any:
    return connector(name).SPEC
