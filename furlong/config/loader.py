"""Load a run's config: a YAML recipe plus `a.b.c=value` overrides.

Every problem is reported with where it came from — `recipe.yaml:LINE` or the
override as typed — and an unknown key gets a "did you mean", because a typo in
a recipe must fail at start, not silently fall back to a default for an hour.
Override values are YAML scalars, so `8`, `true`, `[1, 2]`, `null` and `3e-4`
arrive typed exactly as they would from the recipe file.
"""

from __future__ import annotations

import functools
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from furlong.config.schema import Config, ConfigError, all_paths, did_you_mean, section_type

__all__ = ["load_config", "parse_overrides", "ConfigError"]

Problem = tuple[tuple[str, ...], str]


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` as a float (YAML 1.2), as everyone writing a learning rate expects."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_config(recipe: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The resolved, validated Config; raises one ConfigError listing every problem."""
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}  # dotted key -> "file:line" or "override 'a=b'"
    problems: list[Problem] = []
    origin = ""
    if recipe is not None:
        origin = str(recipe)
        raw, sources, problems = _read_recipe(Path(recipe))
        if "name" not in raw and not problems:
            raw["name"] = Path(recipe).stem
    override_problems, override_sources = parse_overrides(overrides, raw)  # messages name their override
    sources.update(override_sources)
    try:
        cfg = Config.from_dict(raw)
    except ConfigError as e:
        problems += e.problems
    else:
        if not problems and not override_problems:
            return cfg
    problems = [(fields, _with_origin(msg, fields, sources)) for fields, msg in problems]
    raise ConfigError(override_problems + problems, origin)


def parse_overrides(
    overrides: list[str] | tuple[str, ...], raw: dict[str, Any]
) -> tuple[list[Problem], dict[str, str]]:
    """Apply `a.b.c=value` items to `raw` in place; values are parsed as YAML."""
    problems: list[Problem] = []
    sources: dict[str, str] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(((item,), f"override {item!r}: expected key=value, e.g. rollout.n_samples_per_prompt=8"))
            continue
        wrong = _schema_problem(key)
        if wrong:
            problems.append(((key,), f"{wrong} [override {item!r}]"))
            continue
        try:
            value = _yaml(text)
        except yaml.YAMLError as e:
            problems.append(((key,), f"override {item!r}: the value is not valid YAML ({_first_line(e)})"))
            continue
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):  # absent, or a recipe value that the schema says is a section
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
        sources[key] = f"override {item!r}"
    return problems, sources


def _schema_problem(key: str) -> str | None:
    """Why a dotted override key names nothing in the schema, or None if it does."""
    model: type[BaseModel] = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        fields = model.model_fields
        if part not in fields:
            dotted = f"{prefix}.{part}" if prefix else part
            return f"{dotted}: unknown key{did_you_mean(part, prefix + '.' if prefix else '', list(fields))}"
        annotation = fields[part].annotation
        sub = section_type(annotation)
        if i == len(parts) - 1 or typing.get_origin(annotation) is dict:
            return None  # the leaf, or a free-form dict (e.g. envs.connector) that takes any sub-key
        if sub is None:
            return f"{'.'.join(parts[: i + 1])} is a value, not a section, so {key} names nothing"
        model = sub
    return None


def _read_recipe(path: Path) -> tuple[dict[str, Any], dict[str, str], list[Problem]]:
    if not path.is_file():
        raise ConfigError([((str(path),), f"recipe {str(path)!r} does not exist or is not a file")])
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = _yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError([((str(path),), f"{where}: not valid YAML: {_first_line(e)}")]) from None
    if data is None:
        return {}, {}, []
    if not isinstance(data, dict):
        why = f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}"
        raise ConfigError([((str(path),), why)])
    sources: dict[str, str] = {}
    problems: list[Problem] = []
    _map_lines(node, "", path, sources, problems)
    return data, sources, problems


def _map_lines(node: Any, prefix: str, path: Path, sources: dict[str, str], problems: list[Problem]) -> None:
    """Record `file:line` for every key, and reject duplicate keys (PyYAML keeps the last silently)."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        line = key_node.start_mark.line + 1
        if key in seen:
            problems.append(((key,), f"{key}: duplicate key at {path}:{seen[key]} and {path}:{line}"))
        seen[key] = line
        sources[key] = f"{path}:{line}"
        _map_lines(value_node, key + ".", path, sources, problems)


@functools.cache
def _section_paths() -> frozenset[str]:
    """Dotted paths that are sections: a recipe line that opens a section does not set its fields."""
    return frozenset(p for p in all_paths(Config) if section_type(_field(p).annotation) is not None)


def _field(dotted: str) -> Any:
    model: Any = Config
    for part in dotted.split(".")[:-1]:
        model = section_type(model.model_fields[part].annotation)
    return model.model_fields[dotted.split(".")[-1]]


def _with_origin(msg: str, fields: tuple[str, ...], sources: dict[str, str]) -> str:
    """Append where each named field was set: the longest known prefix of its dotted path."""
    found = []
    sections = _section_paths()
    for field in fields:
        parts = field.split(".")
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            src = sources.get(prefix)
            if src is not None and (i == len(parts) or prefix not in sections or src.startswith("override")):
                if src not in found and src not in msg:
                    found.append(src)
                break
    return f"{msg} [{'; '.join(found)}]" if found else msg


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0]
