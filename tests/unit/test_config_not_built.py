"""Settings the schema accepts for features that are not built yet are refused, naming the field."""

import pytest

from furlong.config import ConfigError, load_config, registry
from furlong.train.batch import TrainBatch


@pytest.mark.parametrize(
    "override, field",
    [
        ("rollout.rollout_fn=furlong.rollout.generate:generate", "rollout.rollout_fn"),
    ],
)
def test_unbuilt_feature_is_refused(override, field):
    with pytest.raises(ConfigError, match=f"{field}.*not built yet"):
        load_config(None, [override])


def test_distill_names_the_teacher_it_lacks():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algo.name=distill"])
    assert {"algo.name", "algo.teacher_path"} <= set(e.value.fields)


def test_distill_is_built_and_accepted_with_a_teacher(tmp_path):
    """`algo.name=distill` and `algo.teacher_path` were refused here until a teacher engine scored samples
    (rollout/teacher.py, driver/run.py); a teacher path without distillation is still refused, naming both."""
    cfg = load_config(None, ["algo.name=distill", f"algo.teacher_path={tmp_path}"])
    assert (cfg.algo.name, cfg.algo.teacher_path, cfg.algo.advantage) == ("distill", str(tmp_path), "none")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"algo.teacher_path={tmp_path}"])
    assert {"algo.teacher_path", "algo.name"} <= set(e.value.fields)


def test_convert_fn_is_built_and_accepted():
    """`train.convert_fn` was refused here until the trainer called it (train/hooks.py, train/trainer.py)."""
    path = "furlong.train.batch:TrainBatch.from_samples"
    cfg = load_config(None, [f"train.convert_fn={path}"])
    assert cfg.train.convert_fn == path
    assert registry.load_plugin("train.convert_fn", path) == TrainBatch.from_samples


def test_qat_is_built_and_accepted():
    """`train.qat=int4` was refused here until the trainer fake-quantised its linears (train/qat.py)."""
    assert load_config(None, ["train.qat=int4"]).train.qat == "int4"


def test_qat_with_lora_is_refused_naming_both():
    with pytest.raises(ConfigError, match="train.qat=int4 with train.lora.enabled=true") as e:
        load_config(None, ["train.qat=int4", "train.lora.enabled=true"])
    assert {"train.qat", "train.lora.enabled"} <= set(e.value.fields)
