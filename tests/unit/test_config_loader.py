"""Recipes, overrides, unknown keys with "did you mean", the saved config, and `furlong config show`."""

from __future__ import annotations

from pathlib import Path

import pytest

from furlong.config import load_config
from furlong.config.cli import main as config_main
from furlong.config.schema import Config, ConfigError

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
REQUIRED = {"grpo_arithmetic", "sft_arithmetic", "debug", "ppo_arithmetic", "dapo_arithmetic"}


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


def error_of(recipe, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, list(overrides))
    return info.value


def test_required_recipes_exist():
    assert REQUIRED <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_loads_and_validates(recipe, tmp_path):
    cfg = load_config(recipe)
    assert cfg.name == recipe.stem
    r, t = cfg.rollout, cfg.train
    assert r.rollout_batch_size * r.n_samples_per_prompt == t.global_batch_size * t.num_steps_per_rollout
    saved = cfg.save(tmp_path / "config.yaml")
    assert load_config(saved) == cfg


def test_recipe_specifics():
    grpo = load_config(ROOT / "recipes" / "grpo_arithmetic.yaml")
    assert (grpo.model.arch, grpo.model.size, grpo.data.task, grpo.rollout.mode) == (
        "qwen3",
        "small",
        "arithmetic",
        "async",
    )
    debug = load_config(ROOT / "recipes" / "debug.yaml")
    assert (debug.model.size, debug.train.total_steps) == ("tiny", 2)
    assert load_config(ROOT / "recipes" / "ppo_arithmetic.yaml").algo.advantage == "gae"
    assert load_config(ROOT / "recipes" / "dapo_arithmetic.yaml").rollout.dynamic_filter is True
    assert load_config(ROOT / "recipes" / "sft_arithmetic.yaml").algo.name == "sft"


def test_overrides_are_typed_as_yaml():
    cfg = load_config(
        None,
        [
            "rollout.n_samples_per_prompt=8",
            "rollout.partial_rollout=true",
            "rollout.mode=async",
            'rollout.stop=["</s>", "\\n\\n"]',
            "data.n_train=null",
            "train.lr=3e-4",
            "train.betas=[0.9, 0.95]",
            "envs.connector.url=http://127.0.0.1:9000",
            "envs.connector.retries=3",
            "name=exp",
        ],
    )
    assert cfg.rollout.n_samples_per_prompt == 8 and cfg.rollout.partial_rollout is True
    assert cfg.rollout.stop == ["</s>", "\n\n"]
    assert cfg.data.n_train is None
    assert cfg.train.lr == 3e-4 and cfg.train.betas == (0.9, 0.95)
    assert cfg.envs.connector == {"url": "http://127.0.0.1:9000", "retries": 3}
    assert cfg.train.global_batch_size == 4 * 8  # derived from the overridden group size
    assert cfg.run_dir == "runs/exp"


def test_overrides_win_over_the_recipe(tmp_path):
    recipe = write(tmp_path, "rollout:\n  n_samples_per_prompt: 2\n  rollout_batch_size: 2\n")
    cfg = load_config(recipe, ["rollout.n_samples_per_prompt=6"])
    assert (cfg.rollout.n_samples_per_prompt, cfg.train.global_batch_size) == (6, 12)
    assert cfg.name == "recipe"


def test_unknown_key_in_yaml_has_did_you_mean_and_line(tmp_path):
    recipe = write(tmp_path, "rollout:\n  mode: sync\n  n_sample_per_prompt: 8\ntrian:\n  lr: 1.0e-3\n")
    e = error_of(recipe)
    msg = str(e)
    assert "rollout.n_sample_per_prompt: unknown key; did you mean rollout.n_samples_per_prompt?" in msg
    assert f"{recipe}:3" in msg
    assert "trian: unknown key; did you mean train?" in msg and f"{recipe}:4" in msg


def test_unknown_key_in_a_different_section_points_to_it():
    e = error_of(None, ["rollout.lr=1e-3"])
    assert "did you mean train.lr?" in str(e)


def test_unknown_override_path_and_missing_equals_are_named():
    e = error_of(None, ["rollout.n_sample_per_prompt=8", "algo.kl_coef", "model.path.x=1"])
    msg = str(e)
    assert "rollout.n_sample_per_prompt: unknown key; did you mean rollout.n_samples_per_prompt?" in msg
    assert "[override 'rollout.n_sample_per_prompt=8']" in msg
    assert "override 'algo.kl_coef': expected key=value" in msg
    assert "model.path is a value, not a section" in msg
    assert len(e.problems) == 3


def test_errors_name_their_origin(tmp_path):
    recipe = write(tmp_path, "rollout:\n  partial_rollout: true\n")
    e = error_of(recipe, ["rollout.mode=sync", "train.lr=fast"])
    msg = str(e)
    assert "train.lr" in msg and "'fast'" in msg and "[override 'train.lr=fast']" in msg
    e = error_of(recipe, ["rollout.mode=sync"])
    assert f"{recipe}:2" in str(e) and "override 'rollout.mode=sync'" in str(e)


def test_bad_yaml_and_duplicate_keys_name_the_line(tmp_path):
    e = error_of(write(tmp_path, "rollout:\n  mode: [sync\n"))
    assert "not valid YAML" in str(e) and "recipe.yaml:" in str(e)
    e = error_of(write(tmp_path, "train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n"))
    assert "train.lr: duplicate key" in str(e) and "recipe.yaml:2" in str(e) and "recipe.yaml:3" in str(e)
    e = error_of(tmp_path / "missing.yaml")
    assert "does not exist" in str(e)
    e = error_of(write(tmp_path, "- a\n- b\n"))
    assert "must be a mapping" in str(e)


def test_saved_config_reloads_equal(tmp_path):
    cfg = load_config(
        None,
        [
            "algo.name=dapo",
            "rollout.mode=async",
            f"run_dir={tmp_path / 'run'}",
            "rollout.n_samples_per_prompt=6",
            "train.num_steps_per_rollout=3",
        ],
    )
    path = cfg.save()
    assert path == tmp_path / "run" / "config.yaml"
    again = load_config(path)
    assert again == cfg and again.to_yaml() == cfg.to_yaml()
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_config_show_prints_resolved_yaml(capsys):
    assert config_main(["show", str(ROOT / "recipes" / "debug.yaml"), "rollout.n_samples_per_prompt=4"]) == 0
    out = capsys.readouterr().out
    assert "n_samples_per_prompt: 4" in out and "global_batch_size: 8" in out


def test_config_show_bad_config_exits_2_without_traceback(capsys, tmp_path):
    recipe = write(
        tmp_path,
        "rollout:\n  rollout_batch_size: 8\n  n_samples_per_prompt: 4\n"
        "train:\n  global_batch_size: 16\n  num_steps_per_rollout: 3\n",
    )
    assert config_main(["show", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "rollout.rollout_batch_size=8" in err and "train.num_steps_per_rollout=3" in err
    assert "Traceback" not in err


def test_config_show_checks_plug_points_on_request(capsys):
    assert config_main(["show", "-", "rollout.reward_fn=no_such_mod_abc:score", "--plugins"]) == 2
    err = capsys.readouterr().err
    assert "rollout.reward_fn='no_such_mod_abc:score'" in err and "not found" in err
