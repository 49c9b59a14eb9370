"""`engine.max_context`, `engine.prefix_cache` and `engine.backend` reach the engine: argv, pool, window."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from furlong.engine.engine import context_window
from furlong.engine.kv_cache import BlockPool
from furlong.engine.launch import engine_argv, require_backend
from furlong.engine.sglang import SGLangConfig, build_command, launch

SETTINGS = {
    "host": "127.0.0.1",
    "port": 31000,
    "dtype": "bfloat16",
    "kv_cache_mb": 64,
    "max_running": 32,
    "max_context": None,
    "prefix_cache": True,
    "threads": 2,
    "admin_token": "tok",
}
# 2 layers x 1 KV head x 32 dims x (K and V) x 2 bytes (bfloat16) = 256 bytes a token
TINY = {
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "hidden_size": 64,
    "max_position_embeddings": 2048,
}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


def test_builtin_argv_is_furlong_serve_with_every_setting(model_dir):
    argv = engine_argv("builtin", model_dir=model_dir, **SETTINGS)
    assert argv == [
        sys.executable,
        "-m",
        "furlong.cli",
        "serve",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--dtype",
        "bfloat16",
        "--kv-cache-mb",
        "64",
        "--max-running",
        "32",
        "--threads",
        "2",
    ]
    assert argv.env == {"FURLONG_ADMIN_TOKEN": "tok"}  # the token goes by environment: a command line is public
    argv = engine_argv("builtin", model_dir=model_dir, **{**SETTINGS, "max_context": 512, "prefix_cache": False})
    assert argv[-3:] == ["--max-context", "512", "--no-prefix-cache"]


def test_builtin_argv_parses_back_into_the_serve_settings(model_dir):
    from furlong.engine.cli import parser

    argv = engine_argv(
        "builtin",
        model_dir=model_dir,
        **{**SETTINGS, "max_context": 512, "prefix_cache": False, "admin_token": "-starts-with-a-dash"},
    )
    args = parser().parse_args(argv[4:])
    assert (args.max_context, args.prefix_cache, args.admin_token) == (512, False, None)
    assert argv.env == {"FURLONG_ADMIN_TOKEN": "-starts-with-a-dash"}  # any token, verbatim, off the command line
    assert parser().parse_args(["--model", model_dir]).prefix_cache is True


def test_sglang_argv_maps_every_setting_to_its_flag(model_dir):
    argv = engine_argv("sglang", model_dir=model_dir, **{**SETTINGS, "max_context": 1024, "prefix_cache": False})
    assert argv[:6] == [sys.executable, "-m", "furlong.engine.sglang_exec", "--", sys.executable, "-m"]
    assert argv[6] == "sglang.launch_server"  # run by the wrapper that hands SGLang its admin key in a 0600 file

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (flag("--model-path"), flag("--host"), flag("--port"), flag("--dtype")) == (
        model_dir,
        "127.0.0.1",
        "31000",
        "bfloat16",
    )
    assert flag("--context-length") == "1024" and "--disable-radix-cache" in argv
    assert flag("--max-running-requests") == "32"
    assert flag("--max-total-tokens") == str(64 * 2**20 // 256)  # the KV budget in the model's tokens
    assert "--admin-api-key" not in argv and "tok" not in argv and argv.env == {"FURLONG_ADMIN_TOKEN": "tok"}
    assert "--enable-metrics" in argv and "--threads" not in argv  # threads go through the environment
    default = engine_argv("sglang", model_dir=model_dir, **SETTINGS)
    assert "--context-length" not in default and "--disable-radix-cache" not in default


def test_sglang_token_starting_with_a_dash_still_parses(tmp_path):
    import os
    import stat

    import yaml

    from furlong.engine.sglang_exec import key_config

    path = key_config("-abc", tmp_path)  # what SGLang reads with --config: its admin key, quoted as YAML needs
    assert yaml.safe_load(path.read_text()) == {"admin-api-key": "-abc"}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "-abc" not in build_command(SGLangConfig(model_path="/m"), python="py")


def test_unknown_backend_and_unknown_model_name_the_setting(tmp_path, model_dir):
    with pytest.raises(ValueError, match="^engine.backend: unknown backend 'vllm'"):
        engine_argv("vllm", model_dir=model_dir, **SETTINGS)
    with pytest.raises(ValueError, match="^model_dir: cannot read"):
        engine_argv("sglang", model_dir=str(tmp_path / "missing"), **SETTINGS)
    with pytest.raises(ValueError, match=r"^engine.max_context .*4096 exceeds the model's 2048"):
        engine_argv("sglang", model_dir=model_dir, **{**SETTINGS, "max_context": 4096})


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_sglang_without_the_package_is_a_clear_error(tmp_path, model_dir):
    require_backend("builtin")
    with pytest.raises(ValueError, match="^engine.backend=sglang: the sglang package is not installed"):
        require_backend("sglang")
    # launched anyway (e.g. from another interpreter's argv): the process manager's error says the same
    with pytest.raises(
        RuntimeError, match="(?s)^engine.backend=sglang: the sglang package is not installed.*No module named 'sglang'"
    ):
        launch(SGLangConfig(model_path=model_dir, port=1), timeout=60, log_path=tmp_path / "sglang.log")


def test_context_window_defaults_to_the_model_and_refuses_more():
    assert context_window(2048, None) == 2048
    assert context_window(2048, 100) == 100
    with pytest.raises(ValueError, match=r"^engine.max_context \(--max-context\): 4096 exceeds the model's 2048"):
        context_window(2048, 4096)
    with pytest.raises(ValueError, match="^engine.max_context"):
        context_window(2048, 0)


def test_pool_without_prefix_cache_never_reuses_a_prefix():
    for prefix_cache, reused in [(True, 2), (False, 0)]:
        pool = BlockPool(num_blocks=4, block_size=2, prefix_cache=prefix_cache)
        toks = [1, 2, 3, 4, 5]
        blocks = [pool.alloc() for _ in range(3)]
        pool.register(blocks, [], toks, n_cached=5)
        pool.release(blocks)
        got = pool.match(toks).blocks
        assert len(got) == reused and pool.hit_tokens == 2 * reused
        assert len(pool.evictable) == (2 - reused if prefix_cache else 0)  # nothing lingers when off
