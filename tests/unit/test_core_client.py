"""`core.client.EngineControl`: the blocking control client every weight sender, checksum and schema call uses."""

from __future__ import annotations

import json

import httpx
import pytest

from furlong.core.api import CONTROL_PATHS, MODEL_INFO, PAUSE, UPDATE_FROM_TENSOR, WEIGHT_CHECKSUMS
from furlong.core.client import EngineControl, EngineError


def scripted(replies: dict[str, httpx.Response], seen: list[httpx.Request]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return replies.get(request.url.path, httpx.Response(404, json={"detail": "Not Found"}))

    return httpx.MockTransport(handle)


def test_token_goes_only_to_control_paths_and_unset_fields_stay_unsent():
    seen: list[httpx.Request] = []
    replies = {
        MODEL_INFO: httpx.Response(200, json={"model_path": "m"}),
        UPDATE_FROM_TENSOR: httpx.Response(200, json={"success": True, "weight_version": 4}),
    }
    with EngineControl("http://e/", admin_token="T", transport=scripted(replies, seen)) as engine:
        assert engine.url == "http://e" and engine.model_info() == {"model_path": "m"}
        assert engine.update_weights_from_tensor({"shm_name": "x"}, weight_version=4)["weight_version"] == 4
    info, update = seen
    assert MODEL_INFO not in CONTROL_PATHS and "authorization" not in info.headers
    assert update.headers["authorization"] == "Bearer T"
    assert json.loads(update.content) == {"shm": {"shm_name": "x"}, "weight_version": 4}  # flush_cache: engine default


def test_errors_name_method_url_path_status_and_the_engines_reason():
    seen: list[httpx.Request] = []
    replies = {
        PAUSE: httpx.Response(401, json={"error": {"message": "missing or wrong admin token"}}),
        UPDATE_FROM_TENSOR: httpx.Response(200, json={"success": False, "message": "tensor 'x': unknown"}),
    }
    engine = EngineControl("http://e", transport=scripted(replies, seen))
    with pytest.raises(EngineError, match=r"^POST http://e/pause_generation: HTTP 401: missing or wrong admin token$"):
        engine.pause("retract")
    with pytest.raises(EngineError, match=r"^POST http://e/update_weights_from_tensor: tensor 'x': unknown$"):
        engine.update_weights_from_tensor({})
    with pytest.raises(EngineError) as missing:
        engine.weights_checksum()
    assert missing.value.status == 404 and WEIGHT_CHECKSUMS in str(missing.value)
    with pytest.raises(ValueError, match="unknown pause mode 'nap'"):
        engine.pause("nap")
    assert len(seen) == 3  # a bad mode never reaches the engine


def test_unreachable_engine_is_an_engine_error_without_status():
    engine = EngineControl("http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(EngineError, match=r"GET http://127\.0\.0\.1:9/health: ConnectError") as err:
        engine.health()
    assert err.value.status is None
