"""Settings the schema accepts for features that are not built yet are refused, naming the field."""

import pytest

from furlong.config import ConfigError, load_config


@pytest.mark.parametrize("override, field", [
    ("engine.quantization=fp8", "engine.quantization"),
    ("train.qat=int4", "train.qat"),
    ("rollout.routing_replay=true", "rollout.routing_replay"),
    ("rollout.rollout_fn=furlong.rollout.generate:generate", "rollout.rollout_fn"),
    ("train.convert_fn=furlong.rollout.generate:generate", "train.convert_fn"),
])
def test_unbuilt_feature_is_refused(override, field):
    with pytest.raises(ConfigError, match=f"{field}.*not built yet"):
        load_config(None, [override])
