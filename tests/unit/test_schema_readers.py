"""Every setting in the config schema has a reader, so a knob that silently does nothing cannot come back.

The scan (`tools/schema_readers.py`) walks the whole schema (`Config` and its nested sections) and
looks, in furlong/ outside config/, for a read of each field through that section: `cfg.engine.x`,
`engine_cfg.x` where `engine_cfg: EngineConfig`, an alias of either, or the dotted key as a string.
The other tests show the scan failing on a new unused field and telling a section read from an
unrelated object with an attribute of the same name.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from pydantic import Field

from furlong.config.schema import Config, TrainConfig
from tools.schema_readers import unread_fields


def test_every_setting_has_a_reader():
    unread = unread_fields()
    assert not unread, (
        f"{len(unread)} setting(s) of furlong.config.schema.Config that nothing in furlong/ reads "
        "(wire each to the component it configures, or remove it):\n" + "\n".join(f"  {p}" for p in unread)
    )


class _KnobbedTrain(TrainConfig):
    totally_unused_knob: int = 0


class _KnobbedConfig(Config):
    totally_unused_knob: int = 0
    train: _KnobbedTrain = Field(default_factory=_KnobbedTrain)


def test_a_new_unused_field_is_reported():
    unread = unread_fields(_KnobbedConfig)
    assert "totally_unused_knob" in unread  # on the whole config
    assert "train.totally_unused_knob" in unread  # inside a section
    assert "train.lr" not in unread  # what the real code reads still counts through the subclass
    assert "totally_unused_knob" not in unread_fields()


def _package(root: Path, text: str) -> Path:
    pkg = root / "furlong"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "mod.py").write_text(textwrap.dedent(text))
    (pkg / "config").mkdir()
    (pkg / "config" / "checks.py").write_text("def check(cfg):\n    return cfg.engine.num_engines\n")
    return pkg


def test_what_counts_as_a_read(tmp_path):
    pkg = _package(
        tmp_path,
        """
        from furlong.config.schema import Config, EngineConfig, RolloutConfig

        def launch(engine: EngineConfig, whole: Config):
            local = engine
            return local.max_context, whole.engine.prefix_cache, getattr(engine, "dtype")

        class Manager:
            def __init__(self, config: RolloutConfig):
                self.settings = config

            def step(self):
                return self.settings.temperature

        def plug(loaded):
            return loaded["train.loss_fn"]

        def unrelated(server):
            return server.engine.max_running, server.kv_cache_mb  # not a section: does not count
    """,
    )
    unread = set(unread_fields(package=pkg))
    read = {
        "engine.max_context",
        "engine.prefix_cache",
        "engine.dtype",
        "rollout.temperature",
        "train.loss_fn",
        "engine",
        "rollout",
        "train",
    }
    assert not read & unread, read & unread
    assert {"engine.max_running", "engine.kv_cache_mb", "rollout.top_p"} <= unread
    assert "engine.num_engines" in unread  # config/ validates fields; that is not a read
