"""Counts the docs may state, each computed from the code that defines it.

Docs write a count as `<!-- count:NAME -->N<!-- /count -->`; the checker compares N with
`COUNTERS[NAME](root)`. To make a new count checkable, add one function here and one entry
to COUNTERS, and to the `UNMARKED` nouns if a bare "N things" should be flagged. A counter
raises CountUnavailable when the code it counts does not exist yet: stating such a count is
then an error, because nothing can back it.
"""

from __future__ import annotations

import importlib
import importlib.util
import typing
from collections.abc import Callable
from pathlib import Path


class CountUnavailable(Exception):
    """The code a count is computed from does not exist (yet)."""


def _import(module: str):
    try:
        if importlib.util.find_spec(module) is None:
            raise CountUnavailable(f"module {module} does not exist yet")
    except ModuleNotFoundError as e:
        raise CountUnavailable(f"module {module} does not exist yet") from e
    return importlib.import_module(module)


def plug_points(root: Path) -> int:
    """Entries of the plug-point registry (`furlong.config.registry.PLUG_POINTS`)."""
    return len(_import("furlong.config.registry").PLUG_POINTS)


def recipes(root: Path) -> int:
    """YAML recipes shipped in `recipes/`."""
    return len(list((root / "recipes").glob("*.yaml")))


def algorithms(root: Path) -> int:
    """Algorithm names the config accepts.

    Read from the schema: `ALGORITHMS` in `furlong.config.schema` if it defines one, else the
    `Literal[...]` choices of the algo section's `name` field.
    """
    schema = _import("furlong.config.schema")
    names = getattr(schema, "ALGORITHMS", None)
    if names is None:
        algo = schema.Config.model_fields["algo"].annotation
        field = algo.model_fields.get("name") if hasattr(algo, "model_fields") else None
        if field is None or typing.get_origin(field.annotation) is not typing.Literal:
            raise CountUnavailable("furlong.config.schema has neither ALGORITHMS nor a Literal algo.name")
        names = typing.get_args(field.annotation)
    return len(names)


def connectors(root: Path) -> int:
    """Agent-environment connectors (`furlong.envs.connectors.CONNECTORS`)."""
    return len(_import("furlong.envs.connectors").CONNECTORS)


COUNTERS: dict[str, Callable[[Path], int]] = {
    "plug_points": plug_points,
    "recipes": recipes,
    "algorithms": algorithms,
    "connectors": connectors,
}

# Nouns that, preceded by a number outside a count marker, are an unbacked count.
UNMARKED: dict[str, str] = {
    r"plug[- ]points?": "plug_points",
    r"recipes?": "recipes",
    r"algorithms?": "algorithms",
    r"connectors?": "connectors",
}
