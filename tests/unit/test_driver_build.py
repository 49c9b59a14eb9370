"""The composition root and its parts that need no topology: plug points, launchers, the weight version."""

from __future__ import annotations

import pytest

from furlong.cluster.launchers import colocated_engine_kwargs, engine_command, router_command
from furlong.config import ConfigError, load_config
from furlong.config.schema import EngineConfig, RouterConfig
from furlong.core.version import WeightVersion
from furlong.driver import build


def test_plugins_checks_every_path_at_start_and_passes_only_those_set():
    cfg = load_config(None, ["rollout.reward_post_fn=tests.integration.driver_hook_plugins:shift_rewards"])
    plugs = build.plugins(cfg)
    from tests.integration.driver_hook_plugins import shift_rewards

    assert plugs["rollout.reward_post_fn"] is shift_rewards
    # Unset plug points stay None (each component's built-in), though their defaults were loaded and checked.
    assert plugs["rollout.reward_fn"] is None and plugs["train.loss_fn"] is None and plugs["observe.sinks"] == []
    hooks = build.trainer_hooks(plugs)
    assert hooks.loss_fn is None and hooks.before_train_step is None
    bad = load_config(None, ["train.loss_fn=no_such_module:loss", "rollout.reward_fn=furlong.rollout.rewards:nope"])
    with pytest.raises(ConfigError) as e:
        build.plugins(bad)
    assert {"train.loss_fn", "rollout.reward_fn"} <= set(e.value.fields)


def test_trainer_hooks_carry_the_resolved_loss_hub_functions():
    cfg = load_config(
        None,
        [
            "train.loss_fn=furlong.train.losses.policy:ppo_clip_loss",
            "train.before_train_step=tests.chaos.chaos_plugins:nan_at_1_and_from_3",
        ],
    )
    from furlong.train.losses.policy import ppo_clip_loss

    hooks = build.trainer_hooks(build.plugins(cfg))
    assert hooks.loss_fn is ppo_clip_loss and hooks.before_train_step.__name__ == "nan_at_1_and_from_3"


def test_engine_settings_reach_the_engine_command_and_the_colocated_engine():
    e = EngineConfig(max_context=256, prefix_cache=False, kv_cache_mb=32, max_running=8, dtype="bfloat16")
    argv = engine_command(e, model_dir="/m", port=1234, admin_token="tok", threads=2)
    assert argv[argv.index("--max-context") + 1] == "256" and "--no-prefix-cache" in argv
    assert argv[argv.index("--kv-cache-mb") + 1] == "32" and argv[argv.index("--dtype") + 1] == "bfloat16"
    default = engine_command(EngineConfig(), model_dir="/m", port=1, admin_token="t", threads=1)
    assert "--max-context" not in default and "--no-prefix-cache" not in default
    assert colocated_engine_kwargs(e) == dict(
        dtype="bfloat16",
        kv_cache_mb=32,
        max_running=8,
        max_context=256,
        prefix_cache=False,
        cuda_graphs=False,
        compile_decode=False,
    )
    assert colocated_engine_kwargs(EngineConfig(quantization="fp8"))["quantization"] == "fp8"
    with pytest.raises(ValueError, match="engine.backend=sglang cannot be colocated"):
        colocated_engine_kwargs(EngineConfig(backend="sglang"))


def test_engine_backend_picks_the_launcher(tiny_model_dir):
    builtin = engine_command(EngineConfig(), model_dir=str(tiny_model_dir), port=1, admin_token="t", threads=1)
    assert builtin[1:4] == ["-m", "furlong.cli", "serve"]
    sglang = engine_command(
        EngineConfig(backend="sglang"), model_dir=str(tiny_model_dir), port=1, admin_token="t", threads=1
    )
    assert "sglang.launch_server" in sglang and "furlong.cli" not in sglang


def test_router_command_names_every_engine_and_setting():
    argv = router_command(
        RouterConfig(policy="round_robin", max_retries=5), engine_urls=["http://a", "http://b"], port=9, admin_token="t"
    )
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--engine"] == ["http://a", "http://b"]
    assert argv[argv.index("--policy") + 1] == "round_robin" and argv[argv.index("--max-retries") + 1] == "5"


def test_weight_version_only_goes_forward_except_on_restore():
    v = WeightVersion()
    v.advance(0)
    v.advance(3)
    assert v.current == 3 and int(v) == 3
    with pytest.raises(ValueError, match="older"):
        v.advance(2)
    v.restore(1)
    assert v.current == 1
