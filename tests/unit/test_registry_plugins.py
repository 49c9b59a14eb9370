"""The plug-point registry: loading `package.module:function`, signature checks, defaults, generated docs."""

from __future__ import annotations

import asyncio
import textwrap
import uuid
from pathlib import Path

import pytest

from furlong.config import registry
from furlong.config.cli import plugins_main
from furlong.config.registry import PLUG_POINTS, PluginError, load_all, load_plugin
from furlong.config.schema import Config, ConfigError, check_plugin_path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "plug-points.md"

PLUGINS = """
NOT_CALLABLE = 3

async def reward(sample):
    return 1.0

def sync_reward(sample):
    return 0.5

async def reward_needs_extra(sample, extra):
    return 1.0

async def reward_no_args():
    return 1.0

def sync_generate(ctx, sample, sampling_params):
    return sample

async def generate(c, s, params, *, seed=None):
    return s

def reducer(values, mask, *, constant=None, total_tokens=None, total_samples=None):
    return values

def reducer_kwargs(values, mask, **kw):
    return values

def reducer_no_keywords(values, mask):
    return values

async def async_loss(algo, logprobs, old_logprobs, advantages, mask):
    return logprobs

def source_seed(seed=0, n=3):
    return ("seed", seed, n)

def source_config(config):
    return ("config", config.seed)

def source_plain():
    return "plain"

class Buffer:
    def __init__(self, capacity, *, config=None):
        self.capacity, self.config = capacity, config

async def evaluate(ctx, prompts, *, step):
    return {"step": step, "n": len(prompts)}

class Tools:
    @staticmethod
    async def run(name, arguments):
        return name
"""


@pytest.fixture
def mod(tmp_path, monkeypatch):
    """A fresh, uniquely named module of plug-point candidates on sys.path."""
    name = f"plugmod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGINS))
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / f"{name}_dep.py").write_text("import surely_not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def fails(key: str, path: str) -> PluginError:
    with pytest.raises(PluginError) as info:
        load_plugin(key, path)
    e = info.value
    assert key in str(e) and path in str(e), str(e)  # every error names the key and the path
    assert (e.key, e.path) == (key, path)
    return e


def test_good_plugins_load(mod):
    assert asyncio.run(load_plugin("rollout.reward_fn", f"{mod}:reward")(None)) == 1.0
    assert load_plugin("rollout.reward_fn", f"{mod}:sync_reward")(None) == 0.5  # `either`: sync is fine
    assert load_plugin("rollout.generate_fn", f"{mod}:generate").__name__ == "generate"  # names are free
    assert load_plugin("train.reducer_fn", f"{mod}:reducer").__name__ == "reducer"
    assert load_plugin("train.reducer_fn", f"{mod}:reducer_kwargs").__name__ == "reducer_kwargs"
    assert asyncio.run(load_plugin("envs.tool_fn", f"{mod}:Tools.run")("calc", {})) == "calc"
    assert load_plugin("reward", f"{mod}:reward").__name__ == "reward"  # by plug-point name too


def test_wrong_module(mod):
    e = fails("rollout.reward_fn", "no_such_pkg_xyz.rewards:score")
    assert "module 'no_such_pkg_xyz.rewards' not found" in e.reason
    e = fails("rollout.reward_fn", f"{mod}_dep:score")
    assert "no module named 'surely_not_installed_pkg'" in e.reason
    e = fails("rollout.reward_fn", f"{mod}_broken:score")
    assert "RuntimeError: boom at import" in e.reason
    e = fails("rollout.reward_fn", f"{mod}.reward")
    assert "expected 'package.module:function'" in e.reason


def test_missing_attribute_suggests_a_name(mod):
    e = fails("rollout.reward_fn", f"{mod}:rewrd")
    assert "has no attribute 'rewrd'" in e.reason and "did you mean 'reward'?" in e.reason
    e = fails("envs.tool_fn", f"{mod}:Tools.walk")
    assert "has no attribute 'walk'" in e.reason


def test_not_callable(mod):
    e = fails("rollout.reward_fn", f"{mod}:NOT_CALLABLE")
    assert "int object is not callable" in e.reason


@pytest.mark.parametrize(
    "key, attr, reason",
    [
        ("rollout.reward_fn", "reward_needs_extra", "requires parameter 'extra', which furlong never passes"),
        ("rollout.reward_fn", "reward_no_args", "takes 0 positional parameter(s) (none) but furlong passes 1 (sample)"),
        ("rollout.generate_fn", "sync_generate", "must be a coroutine function (async def)"),
        ("train.loss_fn", "async_loss", "must be a plain function, not async"),
        ("train.reducer_fn", "reducer_no_keywords", "does not accept the keyword argument 'constant'"),
        ("rollout.generate_fn", "reward", "takes 1 positional parameter(s) (sample) but furlong passes 3"),
    ],
)
def test_bad_signature_names_key_path_and_reason(mod, key, attr, reason):
    e = fails(key, f"{mod}:{attr}")
    assert reason in e.reason, e.reason
    assert "expected: " in str(e) and registry.get(key).signature() in str(e)


def test_offered_context_reaches_only_functions_that_declare_it(mod):
    cfg = Config()
    assert load_plugin("rollout.data_source", f"{mod}:source_seed")(config=cfg, seed=7) == ("seed", 7, 3)
    assert load_plugin("rollout.data_source", f"{mod}:source_config")(config=cfg, seed=7) == ("config", 0)
    assert load_plugin("rollout.data_source", f"{mod}:source_plain")(config=cfg, seed=7) == "plain"
    buf = load_plugin("rollout.buffer", f"{mod}:Buffer")(4, config=cfg)
    assert (buf.capacity, buf.config) == (4, cfg)


def test_load_all_collects_every_bad_plug_point(mod):
    cfg = Config.from_dict(
        {
            "rollout": {"reward_fn": f"{mod}:reward", "generate_fn": f"{mod}:sync_generate"},
            "train": {"loss_fn": f"{mod}:nope"},
            "observe": {"sinks": [f"{mod}:source_plain", "missing_mod_q:sink"]},
        }
    )
    with pytest.raises(ConfigError) as info:
        load_all(cfg)
    msg = str(info.value)
    assert f"rollout.generate_fn='{mod}:sync_generate'" in msg
    assert f"train.loss_fn='{mod}:nope'" in msg
    assert "observe.sinks[1]='missing_mod_q:sink'" in msg
    assert len(info.value.problems) == 3
    ok = load_all(
        Config.from_dict({"rollout": {"reward_fn": f"{mod}:reward"}, "observe": {"sinks": [f"{mod}:source_plain"]}})
    )
    assert ok["rollout.reward_fn"].__name__ == "reward" and len(ok["observe.sinks"]) == 1
    assert ok["rollout.generate_fn"].__name__ == "generate"  # unset: the default
    assert ok["rollout.agent_fn"] is None  # unset and no default
    assert set(ok) == {p.key for p in PLUG_POINTS}
    assert registry.resolve(Config(), "reward").__name__ == "task_reward"


def test_every_default_loads_and_fits_its_signature():
    """Catches drift: a default function whose signature changed no longer matches the registry."""
    for point in PLUG_POINTS:
        if point.default is not None:
            assert callable(load_plugin(point.key)), point.key
    with pytest.raises(PluginError, match="no default"):
        load_plugin("rollout.agent_fn")


def _plugin_fields(model, prefix=""):
    out = set()
    for name, info in model.model_fields.items():
        sub = (
            info.annotation if isinstance(info.annotation, type) and hasattr(info.annotation, "model_fields") else None
        )
        if sub is not None:
            out |= _plugin_fields(sub, f"{prefix}{name}.")
        elif any(getattr(m, "func", None) is check_plugin_path for m in info.metadata) or (
            "check_plugin_path" in repr(info.annotation)
        ):
            out.add(prefix + name)
    return out


def test_registry_and_schema_agree():
    keys = [p.key for p in PLUG_POINTS]
    assert len(keys) == len(set(keys)) and len({p.name for p in PLUG_POINTS}) == len(keys)
    assert set(keys) == _plugin_fields(Config)
    required = {
        "rollout",
        "generate",
        "agent",
        "reward",
        "group_reward",
        "reward_post_process",
        "dynamic_filter",
        "sample_filter",
        "data_source",
        "buffer",
        "loss",
        "correction",
        "reducer",
        "advantage",
        "convert",
        "tool",
        "environment",
        "sandbox",
        "eval",
        "logging_sink",
        "before_train_step",
        "after_save",
    }
    assert required <= {p.name for p in PLUG_POINTS}


def test_docs_page_is_current():
    expected = registry.markdown()
    assert f"<!-- count:plug_points -->{len(PLUG_POINTS)}<!-- /count --> plug points" in expected
    current = DOCS.read_text() if DOCS.exists() else ""
    assert current == expected, (
        "docs/plug-points.md is stale; regenerate it with: furlong plugins --markdown > docs/plug-points.md"
    )


def test_plugins_command(capsys):
    assert plugins_main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{len(PLUG_POINTS)} plug points")
    for p in PLUG_POINTS:
        assert p.key in out and p.signature() in out
    assert plugins_main(["--markdown"]) == 0
    assert capsys.readouterr().out == registry.markdown()


def test_offered_context_keeps_async_functions_async(mod):
    import inspect

    fn = load_plugin("rollout.eval_fn", f"{mod}:evaluate")
    assert inspect.iscoroutinefunction(fn)
    out = asyncio.run(
        fn(None, [1, 2], n_samples=1, sampling_params={}, reward_fn=None, generate_fn=None, seed=0, step=3)
    )
    assert out == {"step": 3, "n": 2}


def test_builtin_buffer_has_every_method_of_the_buffer_protocol():
    from furlong.rollout.buffer import GroupBuffer

    methods = [n for n, m in vars(registry.Buffer).items() if callable(m) and (not n.startswith("_") or n == "__len__")]
    assert methods and all(callable(getattr(GroupBuffer, n, None)) for n in methods), methods
