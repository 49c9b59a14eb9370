"""weights.transport=cuda_ipc, the parts that run without a GPU: bucket layout, handle checks, refusals.

Opening a handle needs two CUDA processes (`tests/gpu/test_gpu_paths.py`); here the same
`pack`/`unpack` run on CPU tensors, malformed handles are refused field by field before any
CUDA call, and an engine without CUDA answers a cuda_ipc update with a 400 naming why.
"""

from __future__ import annotations

import base64

import pytest
import torch

from furlong.cluster import nodes
from furlong.config import checks
from furlong.config.schema import Config, ConfigError, WeightsConfig
from furlong.core.client import EngineControl, EngineError
from furlong.weights import cuda_ipc
from furlong.weights.factory import make_sender

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen")


def handle(**over):
    h = dict(
        device=0,
        tensor_offset=0,
        storage="TypedStorage",
        handle=base64.b64encode(b"h" * 64).decode(),
        size_bytes=1024,
        offset_bytes=0,
        ref_counter_handle=base64.b64encode(b"r").decode(),
        ref_counter_offset=0,
        event_handle=None,
        event_sync_required=False,
        numel=1024,
    )
    h.update(over)
    return h


def test_pack_then_unpack_gives_back_every_tensor_bit_exact():
    group = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),
        ("empty", torch.zeros(0, 4)),
        ("c", torch.arange(10, dtype=torch.int64)),
    ]
    flat, specs = cuda_ipc.pack(group, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and all(s["offset"] % cuda_ipc.ALIGN == 0 for s in specs)
    got = cuda_ipc.unpack(flat, specs)
    for name, t in group:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize(
    "change, field",
    [
        ({"nbytes": 999}, "do not fit"),
        ({"offset": 2}, "not aligned"),
        ({"dtype": "float99"}, "dtype"),
        ({"offset": 10**9}, "do not fit"),
    ],
)
def test_unpack_refuses_a_spec_that_does_not_fit(change, field):
    flat, specs = cuda_ipc.pack([("w", torch.randn(4))], torch.device("cpu"))
    with pytest.raises(ValueError, match=field):
        cuda_ipc.unpack(flat, [{**specs[0], **change}])


@pytest.mark.parametrize(
    "change, field",
    [
        ({"numel": -1}, "numel"),
        ({"device": "0"}, "device"),
        ({"handle": "not base64!"}, "handle"),
        ({"storage": "os.system"}, "storage"),
    ],
)
def test_a_malformed_handle_is_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=f"cuda_ipc.{field}"):
        cuda_ipc.parse_handle(handle(**change))
    assert cuda_ipc.parse_handle(handle())["handle"] == b"h" * 64


@no_cuda
@pytest.mark.timeout(120)
def test_without_cuda_the_sender_and_the_config_refuse_and_the_engine_answers_400(tiny_model_dir, monkeypatch):
    with pytest.raises(ValueError, match="weights.transport=cuda_ipc needs CUDA"):
        make_sender("cuda_ipc")
    monkeypatch.setattr(checks, "cuda_available", lambda: False)
    with pytest.raises(ConfigError, match="weights.transport=cuda_ipc needs a CUDA GPU"):
        Config.from_dict({"weights": {"transport": "cuda_ipc"}})
    with pytest.raises(ValueError, match="weights.transport=cuda_ipc moves weights within one host"):
        nodes.weight_transport(WeightsConfig(transport="cuda_ipc"), multi=True, n_nodes=2)

    from furlong.engine.engine import Engine
    from furlong.engine.server import ServerThread

    eng = Engine(tiny_model_dir, kv_cache_mb=1, max_running=2, device="cpu").start()
    try:
        with ServerThread(eng, admin_token="t") as srv, EngineControl(srv.url, admin_token="t") as ctl:
            specs = [{"name": "lm_head.weight", "dtype": "float32", "shape": [1], "offset": 0, "nbytes": 4}]
            with pytest.raises(EngineError, match="sees no CUDA device") as e:
                ctl.update_weights_from_tensor({"cuda_ipc": handle(), "tensors": specs}, weight_version=1)
            assert e.value.status == 400 and ctl.weight_version() == 0
    finally:
        eng.stop()
