"""`model.dtype` is the dtype the weights are loaded in for training and rollout, unless one side says otherwise.

`resolve` gives it to `train.dtype` and `engine.dtype` when the user leaves them unset
(`checks.DEFAULTS_FROM`); the defaults are all float32, so a config that never names a dtype
is unchanged.
"""

import pytest

from furlong.cluster.launchers import colocated_engine_kwargs, engine_command
from furlong.config import ConfigError, load_config
from furlong.config.schema import Config


def test_defaults_are_unchanged():
    cfg = load_config(None, [])
    assert (cfg.model.dtype, cfg.train.dtype, cfg.engine.dtype) == ("float32", "float32", "float32")


def test_model_dtype_reaches_trainer_and_engines_unless_a_side_is_set():
    cfg = load_config(None, ["model.dtype=bfloat16"])
    assert (cfg.train.dtype, cfg.engine.dtype) == ("bfloat16", "bfloat16")
    assert colocated_engine_kwargs(cfg.engine)["dtype"] == "bfloat16"
    argv = engine_command(cfg.engine, model_dir="m", port=1, admin_token="t", threads=1)
    assert "bfloat16" in argv
    cfg = load_config(None, ["model.dtype=bfloat16", "train.dtype=float32"])
    assert (cfg.train.dtype, cfg.engine.dtype) == ("float32", "bfloat16")
    cfg = load_config(None, ["engine.dtype=bfloat16"])
    assert (cfg.train.dtype, cfg.engine.dtype) == ("float32", "bfloat16")


def test_a_dtype_the_trainer_cannot_take_is_refused_naming_both_fields():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.dtype=float16"])
    assert {"model.dtype", "train.dtype"} <= set(e.value.fields) and "set train.dtype" in str(e.value)
    cfg = load_config(None, ["model.dtype=float16", "train.dtype=bfloat16"])
    assert (cfg.train.dtype, cfg.engine.dtype) == ("bfloat16", "float16")


def test_resolved_dtypes_survive_a_save(tmp_path):
    cfg = load_config(None, ["model.dtype=bfloat16", "engine.dtype=float32"])
    again = load_config(cfg.save(tmp_path / "config.yaml"))
    assert again.to_dict() == cfg.to_dict()
    assert Config.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
