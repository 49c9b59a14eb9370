"""The schema-reader scan counts the two tables of config/checks.py, read from its source.

A field `NOT_BUILT` refuses at start is no silent knob (the user is told), and a `DEFAULTS_FROM`
source is read wherever the field it defaults is read. Both are found with `ast` in whatever
checks.py the scanned package holds, so a row added there counts and a row deleted stops counting.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tools.schema_readers import unread_fields


def _package(root: Path, checks: str) -> Path:
    pkg = root / "furlong"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "mod.py").write_text(
        textwrap.dedent("""
        from furlong.config.schema import EngineConfig

        def launch(engine: EngineConfig):
            return engine.dtype
    """)
    )
    (pkg / "config").mkdir()
    (pkg / "config" / "checks.py").write_text(textwrap.dedent(checks))
    return pkg


def test_not_built_and_defaults_from_count(tmp_path):
    pkg = _package(
        tmp_path,
        """
        DEFAULTS_FROM: tuple[tuple[str, str], ...] = (("engine.dtype", "model.dtype"), ("train.dtype", "model.seed"))
        NOT_BUILT = (
            ("train.qat", lambda v: v != "none", "INT4 quantisation-aware training"),
            ("no.such_field", bool, "ignored: not in the schema"),
        )

        def check(cfg):
            return cfg.engine.quantization, "rollout.top_p"  # config/ mentions still do not count
    """,
    )
    unread = set(unread_fields(package=pkg))
    assert not {"engine.dtype", "model.dtype", "train.qat"} & unread
    assert "model.seed" in unread  # its field, train.dtype, has no reader here
    assert {"engine.quantization", "rollout.top_p", "train.dtype"} <= unread


def test_without_the_tables_nothing_extra_counts(tmp_path):
    unread = set(unread_fields(package=_package(tmp_path, "def check(cfg):\n    return None\n")))
    assert {"model.dtype", "train.qat"} <= unread and "engine.dtype" not in unread


def test_the_real_tables_are_found():
    from furlong.config.checks import DEFAULTS_FROM, NOT_BUILT

    unread = set(unread_fields())
    assert not {field for field, _, _ in NOT_BUILT} & unread
    assert not {source for _, source in DEFAULTS_FROM} & unread
