"""E2B and Daytona sandbox providers, through their real SDKs, against local fakes of their services.

Both SDKs let their endpoints be set (E2B_API_URL / E2B_SANDBOX_URL, DAYTONA_API_URL),
so each test starts the fake in `tests/fakes/` as its own process on 127.0.0.1: it
implements the calls the SDK makes (create sandbox, run a command, upload a file,
delete) and really runs the commands, so the stdout, exit codes, timeouts and caps
checked here went through the SDK, the HTTP wire format and the in-sandbox runner.
`test_live_provider` runs against the real service only when its API key is set.
"""

from __future__ import annotations

import asyncio
import glob
import os
import sys
from pathlib import Path

import httpx
import pytest

from furlong.config.schema import EnvsConfig
from furlong.core.net import free_port
from furlong.core.processes import ManagedProcess
from furlong.core.sample import Sample
from furlong.envs.coding import CodingEnvironment, make_prompts
from furlong.envs.sandbox.base import SandboxLimits
from furlong.envs.sandbox.factory import build_sandbox

FAKES = Path(__file__).resolve().parents[1] / "fakes"
KEY = "fake-key-123"
PROVIDERS = ["e2b", "daytona"]


def provider_class(name: str):
    pytest.importorskip(name, reason=f"the {name} SDK is not installed (pip install 'furlong[envs]')")
    if name == "e2b":
        from furlong.envs.sandbox.e2b import E2BSandbox

        return E2BSandbox
    from furlong.envs.sandbox.daytona import DaytonaSandbox

    return DaytonaSandbox


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    """One fake server per provider, started on first use, stopped at the end of the module."""
    started: dict[str, ManagedProcess] = {}

    def get(name: str) -> str:
        if name not in started:
            provider_class(name)
            port = free_port()
            log = tmp_path_factory.mktemp(f"{name}-fake") / "fake.log"
            argv = [sys.executable, str(FAKES / f"{name}_fake.py"), "--port", str(port), "--api-key", KEY]
            started[name] = ManagedProcess(f"{name} fake", argv, f"http://127.0.0.1:{port}", log).start(60)
        return started[name].url

    yield get
    for proc in started.values():
        proc.stop()


@pytest.fixture(params=PROVIDERS)
def provider(request, fakes, monkeypatch):
    """(provider class, fake url) with the provider's environment pointing at the fake."""
    name = request.param
    cls = provider_class(name)
    url = fakes(name)
    if name == "e2b":
        for var in ("E2B_DOMAIN", "E2B_DEBUG"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("E2B_API_KEY", KEY)
        monkeypatch.setenv("E2B_API_URL", url)
        monkeypatch.setenv("E2B_SANDBOX_URL", url)
        monkeypatch.setenv("E2B_HTTP_VERSION", "1.1")  # uvicorn speaks HTTP/1.1
    else:
        monkeypatch.setenv("DAYTONA_API_KEY", KEY)
        monkeypatch.setenv("DAYTONA_API_URL", f"{url}/api")
    return cls, url


def live_sandboxes(url: str) -> int:
    return httpx.get(f"{url}/health").json()["sandboxes"]


def test_runner_caps_output_and_time_inside_the_sandbox():
    """The in-sandbox half alone: what crosses the network is already capped (no SDK needed)."""
    import base64
    import json
    import subprocess

    from furlong.envs.sandbox.remote import RUNNER_SOURCE, parse_result

    job = {
        "files": {"main.py": "import sys, time\nprint('o' * 10**6)\nsys.stdout.flush()\ntime.sleep(60)"},
        "stdin": "",
        "timeout_s": 1.0,
        "memory_mb": 512,
        "max_output_bytes": 500,
    }
    arg = base64.b64encode(json.dumps(job).encode()).decode()
    out = subprocess.run([sys.executable, "-I", "-c", RUNNER_SOURCE, arg], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and len(out.stdout) < 2000, out.stderr  # 1 MB printed, < 2 KB sent back
    r = parse_result("local", out.returncode, out.stdout, out.stderr, 500)
    assert r["stdout"] == "o" * 500 and r["truncated"] and r["timed_out"] and r["status"] == "timeout"


def test_ok_and_failing_programs(provider):
    cls, url = provider
    box = cls(SandboxLimits(timeout_s=10.0))
    before = live_sandboxes(url)

    async def go():
        try:
            ok = await box.run(
                "import helper, sys\nprint(helper.X * 6)\nprint(sys.stdin.read().upper())",
                files={"helper.py": "X = 7\n"},
                stdin="from stdin",
            )
            bad = await box.run("import sys\nprint('partial')\nraise SystemExit(3)")
            crash = await box.run("print('before')\n1 / 0")
            during = live_sandboxes(url)
        finally:
            await box.close()
        return ok, bad, crash, during

    ok, bad, crash, during = asyncio.run(go())
    assert ok["status"] == "ok" and ok["exit_code"] == 0, ok
    assert ok["stdout"] == "42\nFROM STDIN\n" and ok["stderr"] == "" and not ok["truncated"]
    assert ok["isolation"]["provider"] == cls.provider and ok["isolation"]["network"] == "blocked by provider"
    assert bad["status"] == "error" and bad["exit_code"] == 3 and bad["stdout"] == "partial\n", bad
    assert crash["status"] == "error" and crash["exit_code"] == 1 and crash["stdout"] == "before\n"
    assert crash["stderr"].rstrip().endswith("ZeroDivisionError: division by zero"), crash
    # one remote machine served all three runs, and close() deleted it
    assert ok["isolation"]["sandbox_id"] == bad["isolation"]["sandbox_id"] == crash["isolation"]["sandbox_id"]
    assert during == before + 1 and live_sandboxes(url) == before


def test_concurrent_runs_share_one_machine(provider):
    cls, url = provider
    box = cls(SandboxLimits(timeout_s=10.0))
    before = live_sandboxes(url)

    async def go():
        try:
            runs = await asyncio.gather(*(box.run(f"import os\nprint({i} * {i}, os.getcwd())") for i in range(6)))
            return runs, live_sandboxes(url)
        finally:
            await box.close()

    runs, during = asyncio.run(go())
    assert [r["stdout"].split()[0] for r in runs] == [str(i * i) for i in range(6)], runs
    assert len({r["stdout"].split()[1] for r in runs}) == 6  # each run had its own directory
    assert len({r["isolation"]["sandbox_id"] for r in runs}) == 1 and during == before + 1


def test_timeout_kills_the_program_and_the_sandbox_stays_usable(provider):
    cls, _ = provider
    box = cls(SandboxLimits(timeout_s=10.0))

    async def go():
        try:
            hang = await box.run(
                "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.01)", timeout_s=1.0
            )
            after = await box.run("print('next')")
        finally:
            await box.close()
        return hang, after

    hang, after = asyncio.run(go())
    assert hang["status"] == "timeout" and hang["timed_out"] and hang["exit_code"] < 0, hang
    assert hang["stdout"] == "started\n"  # what it printed before the deadline is kept
    assert after["status"] == "ok" and after["stdout"] == "next\n"


def test_output_is_capped_per_stream(provider):
    cls, _ = provider
    box = cls(SandboxLimits(timeout_s=10.0, max_output_bytes=1000))

    async def go():
        try:
            return await box.run("import sys\nprint('o' * 200_000)\nprint('e' * 200_000, file=sys.stderr)")
        finally:
            await box.close()

    r = asyncio.run(go())
    assert r["status"] == "ok" and r["truncated"], {k: v for k, v in r.items() if k not in ("stdout", "stderr")}
    assert r["stdout"] == "o" * 1000 and r["stderr"] == "e" * 1000


def test_large_job_goes_through_file_upload(provider):
    cls, _ = provider
    box = cls(SandboxLimits(timeout_s=10.0))
    data = "".join(f"{i}\n" for i in range(40_000))  # ~230 KB: too large for one command line
    leftovers = set(glob.glob("/tmp/furlong-job-*.json"))

    async def go():
        try:
            return await box.run("print(sum(int(x) for x in open('data.txt')))", files={"data.txt": data})
        finally:
            await box.close()

    r = asyncio.run(go())
    assert r["status"] == "ok" and r["stdout"] == f"{sum(range(40_000))}\n", r
    assert set(glob.glob("/tmp/furlong-job-*.json")) == leftovers  # the runner removed the uploaded job


def test_missing_and_wrong_api_key(provider, monkeypatch):
    cls, _ = provider
    var = f"{cls.provider.upper()}_API_KEY"
    monkeypatch.delenv(var)
    with pytest.raises(RuntimeError, match=var):
        cls()
    with pytest.raises(RuntimeError, match=var):
        build_sandbox(EnvsConfig(sandbox=cls.provider))
    monkeypatch.setenv(var, "not-the-key")

    async def go():
        box = cls(SandboxLimits(timeout_s=5.0))
        try:
            await box.run("print(1)")
        finally:
            await box.close()

    with pytest.raises(Exception, match="(?i)401|api key|unauthori"):
        asyncio.run(go())


def test_a_deleted_sandbox_is_replaced(provider):
    cls, url = provider
    box = cls(SandboxLimits(timeout_s=10.0))

    async def go():
        try:
            first = await box.run("print(1)")
            sid = first["isolation"]["sandbox_id"]
            path = f"/sandboxes/{sid}" if cls.provider == "e2b" else f"/api/sandbox/{sid}"
            headers = {"X-API-KEY": KEY} if cls.provider == "e2b" else {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient() as client:  # deleted behind the provider's back
                assert (await client.delete(url + path, headers=headers)).status_code < 300
            second = await box.run("print(2)")
        finally:
            await box.close()
        return first, second

    first, second = asyncio.run(go())
    assert second["status"] == "ok" and second["stdout"] == "2\n", second
    assert second["isolation"]["sandbox_id"] != first["isolation"]["sandbox_id"]


def test_coding_reward_runs_in_the_provider(provider):
    cls, url = provider
    env = CodingEnvironment(EnvsConfig(sandbox=cls.provider, timeout_s=3.0))
    assert isinstance(env.sandbox, cls)
    p = make_prompts(1, seed=5)[0]

    def sample(answer: str) -> Sample:
        return Sample(prompt=p.prompt, label=p.label, metadata={**p.metadata, "response_text": answer})

    async def go():
        try:
            good = sample(f"```python\n{p.metadata['solution']}```")
            wrong = sample(f"```python\ndef {p.metadata['entry_point']}(x):\n    return None\n```")
            hang = sample("```python\nwhile True:\n    pass\n```")
            return [(await env.reward(s), s.metadata["sandbox_status"]) for s in (good, wrong, hang)]
        finally:
            await env.sandbox.close()

    (good, good_status), (wrong, wrong_status), (hang, hang_status) = asyncio.run(go())
    assert good == {"score": 1.0, "timeout": 0.0} and good_status == "ok"
    assert wrong["score"] == 0.0 and wrong_status == "error"
    assert hang == {"score": 0.0, "timeout": 1.0} and hang_status == "timeout"


def test_missing_sdk_names_the_extra():
    """Without the SDK installed, building the sandbox says which extra to install (checked in a child
    process where importing the SDK fails)."""
    import subprocess

    code = (
        "import sys\nsys.modules['e2b'] = sys.modules['daytona'] = None\n"
        "from furlong.config.schema import EnvsConfig\nfrom furlong.envs.sandbox.factory import build_sandbox\n"
        "for name in ('e2b', 'daytona'):\n"
        "    try:\n        build_sandbox(EnvsConfig(sandbox=name))\n"
        "    except ImportError as e:\n        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "E2B_API_KEY": "k", "DAYTONA_API_KEY": "k"},
    )
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("pip install 'furlong[envs]'" in ln for ln in lines), out
    assert "'e2b'" in lines[0] and "'daytona'" in lines[1]
