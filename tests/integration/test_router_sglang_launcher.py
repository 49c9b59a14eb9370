"""The SGLang launcher end to end on CPU, with a stand-in ``sglang`` package.

A real SGLang needs a GPU (see the module docstring of ``furlong.engine.sglang``). Here a
fake ``sglang.launch_server`` on PYTHONPATH records the argv it was given and answers
``/health``, which checks everything the launcher itself does: the process it starts,
the health wait, the error it reports when the server dies, registration with the router.
"""

from __future__ import annotations

import json
import stat
import textwrap
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from furlong.core.net import free_port
from furlong.engine.sglang import SGLangConfig, launch
from furlong.router import serve_in_thread
from tests.helpers import cmdlines_with

FAKE_LAUNCH_SERVER = textwrap.dedent("""
    import argparse, json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    p = argparse.ArgumentParser()
    p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
    args, _ = p.parse_known_args()
    if args.model_path == "/missing":
        print("FileNotFoundError: /missing has no config.json", flush=True)
        sys.exit(1)
    with open(args.model_path + "/argv.json", "w") as f:
        json.dump(sys.argv[1:], f)

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()
        def log_message(self, *a):
            pass

    HTTPServer((args.host, args.port), H).serve_forever()
""")


@pytest.fixture
def fake_sglang(tmp_path):
    pkg = tmp_path / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    return {"PYTHONPATH": str(tmp_path / "site")}


@pytest.mark.timeout(120)
def test_launch_waits_for_health_and_registers_with_the_router(tmp_path, fake_sglang):
    token = f"sglang-key-{uuid.uuid4().hex}"
    cfg = SGLangConfig(model_path=str(tmp_path), port=free_port(), tp_size=2, return_routed_experts=True)
    with serve_in_thread([], admin_token=token, health_interval=0.2) as router:
        server = launch(
            cfg, router_url=router.url, admin_token=token, env=fake_sglang, timeout=60, log_path=tmp_path / "sglang.log"
        )
        try:
            engines = httpx.get(router.url + "/engines").json()["engines"]
            assert [(e["url"], e["state"]) for e in engines] == [(cfg.url, "healthy")]
            argv = json.loads((tmp_path / "argv.json").read_text())
            assert argv[argv.index("--tp-size") + 1] == "2"
            assert "--enable-return-routed-experts" in argv and "--enable-metrics" in argv
            # the key reaches SGLang in a 0600 config file, never on a command line
            assert "--admin-api-key" not in argv and token not in argv
            key_file = Path(argv[argv.index("--config") + 1])
            assert yaml.safe_load(key_file.read_text()) == {"admin-api-key": token}
            assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
            assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
            assert cmdlines_with(token) == []
        finally:
            server.stop()
        assert server.process.returncode is not None
        assert not key_file.exists()  # removed once SGLang is gone


def test_launch_reports_why_the_server_died(tmp_path, fake_sglang):
    cfg = SGLangConfig(model_path="/missing", port=free_port())
    with pytest.raises(RuntimeError, match="(?s)exited with 1.*no config.json"):
        launch(cfg, env=fake_sglang, timeout=60, log_path=tmp_path / "sglang.log")


def test_registration_refused_without_the_admin_token(tmp_path, fake_sglang):
    cfg = SGLangConfig(model_path=str(tmp_path), port=free_port())
    with serve_in_thread([], admin_token="tok") as router:
        with pytest.raises(RuntimeError, match="refused.*401"):
            launch(cfg, router_url=router.url, env=fake_sglang, timeout=60)
        assert httpx.get(router.url + "/engines").json()["engines"] == []
