"""Config resolution and cross-field checks: presets, the batch invariant, contradictions."""

from __future__ import annotations

import pytest

from furlong.config import checks
from furlong.config.schema import Config, ConfigError


def problems(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data)
    return info.value


def test_empty_config_is_valid_on_cpu():
    cfg = Config()
    assert cfg.run_dir == "runs/run"
    assert cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt == (
        cfg.train.global_batch_size * cfg.train.num_steps_per_rollout
    )
    assert cfg.train.backend == "auto" and cfg.engine.backend == "builtin"
    assert Config.from_dict({"name": "exp1"}).run_dir == "runs/exp1"
    assert Config.from_dict({"name": "exp1", "run_dir": "/tmp/x"}).run_dir == "/tmp/x"


@pytest.mark.parametrize(
    "given, field, expected",
    [
        (
            {"rollout": {"rollout_batch_size": 8, "n_samples_per_prompt": 4}, "train": {"num_steps_per_rollout": 2}},
            ("train", "global_batch_size"),
            16,
        ),
        (
            {"rollout": {"rollout_batch_size": 8, "n_samples_per_prompt": 4}, "train": {"global_batch_size": 8}},
            ("train", "num_steps_per_rollout"),
            4,
        ),
        (
            {"rollout": {"n_samples_per_prompt": 4}, "train": {"global_batch_size": 8, "num_steps_per_rollout": 3}},
            ("rollout", "rollout_batch_size"),
            6,
        ),
        (
            {"rollout": {"rollout_batch_size": 3}, "train": {"global_batch_size": 6, "num_steps_per_rollout": 4}},
            ("rollout", "n_samples_per_prompt"),
            8,
        ),
        # fewer than three given: the others keep their defaults and global_batch_size is derived
        ({"rollout": {"n_samples_per_prompt": 8}}, ("train", "global_batch_size"), 4 * 8),
    ],
)
def test_invariant_derives_the_missing_field(given, field, expected):
    cfg = Config.from_dict(given)
    assert getattr(getattr(cfg, field[0]), field[1]) == expected
    r, t = cfg.rollout, cfg.train
    assert r.rollout_batch_size * r.n_samples_per_prompt == t.global_batch_size * t.num_steps_per_rollout


def test_invariant_all_four_inconsistent_names_all_four_with_values():
    e = problems(
        {
            "rollout": {"rollout_batch_size": 8, "n_samples_per_prompt": 4},
            "train": {"global_batch_size": 16, "num_steps_per_rollout": 3},
        }
    )
    assert len(e.problems) == 1
    msg = str(e)
    for text in (
        "rollout.rollout_batch_size=8",
        "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=16",
        "train.num_steps_per_rollout=3",
        "32",
        "48",
    ):
        assert text in msg
    assert set(e.fields) == {
        "rollout.rollout_batch_size",
        "rollout.n_samples_per_prompt",
        "train.global_batch_size",
        "train.num_steps_per_rollout",
    }


def test_invariant_non_integer_derivation_is_an_error():
    e = problems({"rollout": {"rollout_batch_size": 3, "n_samples_per_prompt": 3}, "train": {"global_batch_size": 2}})
    assert "cannot derive train.num_steps_per_rollout" in str(e) and "4.5" in str(e)


def test_presets_fill_only_unset_fields():
    dapo = Config.from_dict({"algo": {"name": "dapo"}})
    assert (dapo.algo.clip_eps_high, dapo.algo.loss_reducer, dapo.rollout.dynamic_filter) == (0.28, "token_mean", True)
    mine = Config.from_dict({"algo": {"name": "dapo", "clip_eps_high": 0.3}, "rollout": {"dynamic_filter": False}})
    assert (mine.algo.clip_eps_high, mine.rollout.dynamic_filter, mine.algo.loss_reducer) == (0.3, False, "token_mean")
    dr = Config.from_dict({"algo": {"name": "dr_grpo"}, "rollout": {"max_new_tokens": 48}})
    assert (dr.algo.advantage, dr.algo.norm_adv_by_std, dr.algo.loss_reducer, dr.algo.reducer_constant) == (
        "dr_grpo",
        False,
        "constant",
        48.0,
    )
    assert Config.from_dict({"algo": {"name": "gspo"}}).algo.ratio_type == "sequence"
    assert Config.from_dict({"algo": {"name": "ppo"}}).algo.advantage == "gae"
    assert Config.from_dict({"algo": {"name": "rloo"}}).algo.advantage == "rloo"
    assert Config.from_dict({"algo": {"name": "sft"}}).algo.advantage == "none"


def test_staleness_follows_mode_unless_set():
    assert Config.from_dict({"rollout": {"mode": "async"}}).rollout.max_staleness == 1
    assert Config.from_dict({"rollout": {"mode": "async", "max_staleness": 0}}).rollout.max_staleness == 0
    assert Config.from_dict({"rollout": {"mode": "sync"}}).rollout.max_staleness == 0


@pytest.mark.parametrize(
    "data, fields",
    [
        ({"rollout": {"partial_rollout": True, "mode": "sync"}}, {"rollout.partial_rollout", "rollout.mode"}),
        ({"rollout": {"max_staleness": 2, "mode": "sync"}}, {"rollout.max_staleness", "rollout.mode"}),
        ({"rollout": {"max_staleness": 0, "mode": "overlap"}}, {"rollout.max_staleness", "rollout.mode"}),
        ({"algo": {"name": "ppo", "advantage": "grpo"}}, {"algo.name", "algo.advantage"}),
        ({"algo": {"name": "grpo", "advantage": "gae"}}, {"algo.name", "algo.advantage"}),
        ({"algo": {"name": "gspo", "ratio_type": "token"}}, {"algo.name", "algo.ratio_type"}),
        ({"algo": {"name": "dr_grpo", "norm_adv_by_std": True}}, {"algo.norm_adv_by_std", "algo.advantage"}),
        ({"algo": {"reducer_constant": 32}}, {"algo.reducer_constant", "algo.loss_reducer"}),
        ({"algo": {"name": "distill"}}, {"algo.teacher_path"}),
        (
            {"train": {"lora": {"enabled": True}}, "weights": {"transport": "p2p"}},
            {"train.lora.enabled", "weights.transport"},
        ),
        ({"rollout": {"n_samples_per_prompt": 1}}, {"rollout.n_samples_per_prompt", "algo.advantage"}),
        (
            {"rollout": {"dynamic_filter": True, "n_samples_per_prompt": 1}},
            {"rollout.n_samples_per_prompt", "rollout.dynamic_filter"},
        ),
        ({"rollout": {"routing_replay": True}}, {"rollout.routing_replay", "model.arch"}),
        ({"rollout": {"max_turns": 3}}, {"rollout.max_turns"}),
        (
            {"cluster": {"lend_idle_cores": True, "share_cores": True}},
            {"cluster.lend_idle_cores", "cluster.share_cores"},
        ),
        ({"observe": {"dashboard": True, "event_store": False}}, {"observe.dashboard", "observe.event_store"}),
        ({"train": {"warmup_steps": 50, "total_steps": 10}}, {"train.warmup_steps", "train.total_steps"}),
        ({"data": {"task": None}}, {"data.path", "data.task"}),
        ({"data": {"task": None}, "rollout": {"eval_every": 5}}, {"rollout.eval_every"}),
        ({"envs": {"name": "calculator", "environment": "pkg.mod:make"}}, {"envs.name", "envs.environment"}),
        ({"model": {"path": "/nonexistent/model"}}, {"model.path"}),
        ({"data": {"path": "/nonexistent/train.jsonl"}}, {"data.path"}),
        (
            {"algo": {"correction": "tis", "correction_low": 3.0, "correction_high": 2.0}},
            {"algo.correction_low", "algo.correction_high"},
        ),
    ],
)
def test_incompatible_combinations_name_their_fields(data, fields):
    e = problems(data)
    assert fields <= set(e.fields), str(e)
    for f in fields:
        assert f in str(e)


def test_gpu_only_settings_need_cuda(monkeypatch):
    monkeypatch.setattr(checks, "cuda_available", lambda: False)
    e = problems({"train": {"backend": "nccl"}, "weights": {"transport": "broadcast"}})
    assert {"train.backend", "weights.transport"} <= set(e.fields) and "CUDA" in str(e)
    e = problems({"engine": {"backend": "sglang"}})
    assert "engine.backend" in e.fields and "CUDA" in str(e)
    monkeypatch.setattr(checks, "cuda_available", lambda: True)
    assert Config.from_dict({"train": {"backend": "nccl"}}).train.backend == "nccl"


def test_all_problems_are_collected_into_one_error():
    e = problems(
        {
            "rollout": {"partial_rollout": True, "max_staleness": 1},
            "algo": {"name": "ppo", "advantage": "rloo"},
            "observe": {"dashboard": True, "event_store": False},
        }
    )
    assert len(e.problems) >= 4
    assert str(e).count("\n  - ") == len(e.problems)


def test_field_type_errors_name_dotted_fields():
    e = problems({"rollout": {"temperature": "hot", "mode": "asyncc"}, "train": {"lora": {"r": 0}}})
    assert {"rollout.temperature", "rollout.mode", "train.lora.r"} <= set(e.fields)
    assert "'asyncc'" in str(e) and "'hot'" in str(e)


def test_plugin_paths_are_checked_for_syntax():
    e = problems({"rollout": {"reward_fn": "my.rewards.exact"}})
    assert "rollout.reward_fn" in e.fields and "did you mean 'my.rewards:exact'" in str(e)
    cfg = Config.from_dict({"rollout": {"reward_fn": "my.rewards:exact"}, "observe": {"sinks": ["a.b:C"]}})
    assert cfg.rollout.reward_fn == "my.rewards:exact"


def test_data_path_replaces_the_default_task(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text('{"prompt": "1+1=", "label": 2}\n')
    cfg = Config.from_dict({"data": {"path": str(f)}})
    assert cfg.data.task is None and cfg.data.eval_task is None
    assert Config.from_dict({"data": {"task": "reverse"}}).data.eval_task == "reverse"


def test_from_dict_rejects_unknown_keys_with_did_you_mean():
    e = problems({"rollout": {"temprature": 0.7}, "train": {"lora": {"rank": 4}}, "sampling": {}})
    msg = str(e)
    assert "rollout.temprature: unknown key; did you mean rollout.temperature?" in msg
    assert "train.lora.rank: unknown key; known keys here: enabled, r, alpha" in msg
    assert "sampling: unknown key" in msg
