"""The admin token stays off command lines, and standalone servers are never open without saying so.

Any local user reads every process's `/proc/<pid>/cmdline`, and the admin token lets its
holder replace the policy's weights. The engine and router processes here start through the
launcher code the driver uses (`cluster.launchers` commands on `core.processes.ManagedProcess`),
and every command line on the machine is scanned for the token while they serve; the token
must still have reached them (their environment) and be enforced by them.

Standalone `furlong serve` / `furlong router` without a token: on loopback they serve with a
warning that control endpoints are open; bound to 0.0.0.0 they generate a token, store it in a
0600 file, print where, and refuse control calls without it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from furlong.cluster.launchers import engine_command, router_command
from furlong.config.schema import EngineConfig, RouterConfig
from furlong.core.net import free_port
from furlong.core.processes import ADMIN_TOKEN_ENV, ManagedProcess, furlong_argv
from furlong.engine import admin_token
from furlong.models import create_model
from tests.helpers import cmdline, cmdlines_with, holds_token

TOKEN = f"secrets-test-{uuid.uuid4().hex}"  # unique: found on no command line unless this run put it there


NO_TOKEN = {ADMIN_TOKEN_ENV: ""}  # an empty variable is no token: the server starts without one whatever our env has


@pytest.fixture(scope="module")
def model_dir():
    return str(create_model("qwen3", "tiny"))


@pytest.fixture(scope="module")
def topology(model_dir, tmp_path_factory):
    """One engine and the router in front of it, started exactly as the driver's topology starts them."""
    logs = tmp_path_factory.mktemp("secrets_logs")
    eport, rport = free_port(), free_port()
    argv = engine_command(EngineConfig(kv_cache_mb=8), model_dir=model_dir, port=eport, admin_token=TOKEN, threads=1)
    engine = ManagedProcess("engine", argv, f"http://127.0.0.1:{eport}", logs / "engine.log", threads=1)
    engine.start(180)
    try:
        argv = router_command(RouterConfig(), engine_urls=[engine.url], port=rport, admin_token=TOKEN)
        router = ManagedProcess("router", argv, f"http://127.0.0.1:{rport}", logs / "router.log", threads=1)
        router.start(60)
        try:
            yield engine, router
        finally:
            router.stop()
    finally:
        engine.stop()


@pytest.mark.timeout(300)
def test_no_admin_token_on_any_command_line_while_engine_and_router_serve(topology):
    engine, router = topology
    assert cmdlines_with(TOKEN) == [], "the admin token is readable by every local user"
    for proc in (engine, router):
        assert b"furlong.cli" in cmdline(proc.pid)  # the scan read real command lines
        assert holds_token(proc.pid, TOKEN), f"{proc.name} was not handed the token"
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for url in (engine.url, router.url):  # and each enforces it: refused without, served with
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 401
        assert httpx.post(url + "/flush_cache", headers=bearer, timeout=30).status_code == 200
    assert cmdlines_with(TOKEN) == []


def _server(argv: list[str], url: str, log: Path, env: dict[str, str]) -> ManagedProcess:
    """A standalone server, with `env` added to its environment."""
    return ManagedProcess("server", argv, url, log, threads=1, env={**NO_TOKEN, **env}).start(180)


@pytest.mark.timeout(300)
def test_serve_on_loopback_without_a_token_warns_that_control_endpoints_are_open(model_dir, tmp_path):
    port = free_port()
    argv = furlong_argv("serve", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port), "--kv-cache-mb", "8")
    proc = _server(argv, f"http://127.0.0.1:{port}", tmp_path / "serve.log", {})
    try:
        assert "no admin token: the control endpoints" in proc.log_tail(50)
        assert httpx.post(proc.url + "/flush_cache", timeout=30).status_code == 200  # the warning is true
    finally:
        proc.stop()


@pytest.mark.timeout(300)
def test_serve_off_loopback_without_a_token_generates_one_in_a_private_file(model_dir, tmp_path):
    port = free_port()
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    argv = furlong_argv("serve", "--model", model_dir, "--host", "0.0.0.0", "--port", str(port), "--kv-cache-mb", "8")
    proc = _server(argv, f"http://127.0.0.1:{port}", tmp_path / "serve.log", env)
    try:
        path = tmp_path / "cache" / "furlong" / "tokens" / f"serve-{port}.token"
        assert f"stored it in {path} (mode 0600)" in proc.log_tail(50)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        assert len(token) == 64
        assert httpx.post(proc.url + "/flush_cache", timeout=30).status_code == 401
        bearer = {"Authorization": f"Bearer {token}"}
        assert httpx.post(proc.url + "/flush_cache", headers=bearer, timeout=30).status_code == 200
        assert cmdlines_with(token) == []
    finally:
        proc.stop()


@pytest.mark.timeout(300)
def test_router_on_loopback_without_a_token_warns(topology, tmp_path):
    engine, _ = topology
    port = free_port()
    argv = furlong_argv("router", "--engine", engine.url, "--host", "127.0.0.1", "--port", str(port))
    proc = _server(argv, f"http://127.0.0.1:{port}", tmp_path / "router.log", {})
    try:
        assert "no admin token: the control endpoints" in proc.log_tail(50)
        assert httpx.post(proc.url + "/remove_engine", json={"url": "http://127.0.0.1:9"}).status_code == 404  # open
    finally:
        proc.stop()


@pytest.mark.timeout(300)
def test_router_off_loopback_without_a_token_generates_one(topology, tmp_path):
    engine, _ = topology
    port = free_port()
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    argv = furlong_argv("router", "--engine", engine.url, "--host", "0.0.0.0", "--port", str(port))
    proc = _server(argv, f"http://127.0.0.1:{port}", tmp_path / "router.log", env)
    try:
        path = tmp_path / "cache" / "furlong" / "tokens" / f"router-{port}.token"
        assert f"stored it in {path} (mode 0600)" in proc.log_tail(50)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        body = {"url": "http://127.0.0.1:9"}
        assert httpx.post(proc.url + "/add_engine", json=body).status_code == 401
        headers = {"Authorization": f"Bearer {token}"}
        assert httpx.post(proc.url + "/remove_engine", json=body, headers=headers).status_code == 404  # let in
    finally:
        proc.stop()


@pytest.mark.timeout(60)
def test_token_file_flag_and_environment_in_that_order(tmp_path, monkeypatch, caplog):
    file = admin_token.write_private(tmp_path / "t", "from-file\n")
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-env")
    assert admin_token.resolve("furlong serve", "0.0.0.0", 1, "from-flag", str(file)) == "from-file"
    assert admin_token.resolve("furlong serve", "0.0.0.0", 1, "from-flag", None) == "from-flag"
    assert "--admin-token puts the token on the command line" in caplog.text
    assert admin_token.resolve("furlong serve", "0.0.0.0", 1, None, None) == "from-env"
    with pytest.raises(ValueError, match="^admin_token_file: .* is empty"):
        admin_token.resolve("furlong serve", "127.0.0.1", 1, None, str(admin_token.write_private(tmp_path / "e", "")))
    assert [admin_token.is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.0.0.1")] == [
        True,
        True,
        True,
        False,
        False,
    ]


@pytest.mark.timeout(120)
def test_a_bad_token_file_stops_the_cli_naming_the_file(tmp_path):
    missing = tmp_path / "missing"
    for prog in ("router", "serve"):
        extra = ["--model", str(tmp_path)] if prog == "serve" else []
        r = subprocess.run(
            [sys.executable, "-m", "furlong.cli", prog, *extra, "--admin-token-file", str(missing)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **NO_TOKEN},
        )
        assert r.returncode == 2 and f"admin_token_file: cannot read {missing}" in r.stderr, r.stderr
