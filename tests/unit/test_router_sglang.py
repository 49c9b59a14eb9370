"""The SGLang launcher's command line (no sglang, no GPU needed)."""

from __future__ import annotations

import pytest

from furlong.engine.sglang import SGLangConfig, build_command


def test_default_command_has_the_flags_furlong_relies_on():
    cmd = build_command(SGLangConfig(model_path="/m"), python="py")
    assert cmd == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--dtype",
        "auto",
        "--tp-size",
        "1",
        "--weight-version",
        "0",
        "--enable-metrics",
        "--skip-server-warmup",
    ]


def test_every_option_maps_to_its_sglang_flag():
    cfg = SGLangConfig(
        model_path="/ckpt",
        host="0.0.0.0",
        port=31000,
        dtype="bfloat16",
        tp_size=4,
        mem_fraction_static=0.7,
        base_gpu_id=4,
        context_length=8192,
        max_running_requests=128,
        random_seed=1,
        weight_version="12",
        enable_metrics=False,
        skip_warmup=False,
        return_routed_experts=True,
        enable_memory_saver=True,
        deterministic=True,
        load_format="dummy",
        extra_args=["--enable-lora", "--max-lora-rank", "16"],
    )
    cmd = build_command(cfg, python="py")
    assert cmd == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt",
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
        "--dtype",
        "bfloat16",
        "--tp-size",
        "4",
        "--weight-version",
        "12",
        "--mem-fraction-static",
        "0.7",
        "--base-gpu-id",
        "4",
        "--context-length",
        "8192",
        "--max-running-requests",
        "128",
        "--random-seed",
        "1",
        "--load-format",
        "dummy",
        "--enable-return-routed-experts",
        "--enable-memory-saver",
        "--enable-deterministic-inference",
        "--enable-lora",
        "--max-lora-rank",
        "16",
    ]
    assert cfg.url == "http://0.0.0.0:31000"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"dtype": "fp7"}, "dtype"),
        ({"tp_size": 0}, "tp_size"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
        ({"port": 70000}, "port"),
        ({"model_path": ""}, "model_path"),
        ({"context_length": 0}, "context_length"),
    ],
)
def test_bad_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        build_command(SGLangConfig(**{"model_path": "/m", **change}))


def test_importing_the_launcher_does_not_import_sglang():
    import sys

    assert "sglang" not in sys.modules
