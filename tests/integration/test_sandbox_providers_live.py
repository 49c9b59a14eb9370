"""E2B and Daytona against the real services: runs only where the API key is set.

Kept apart from test_sandbox_providers.py (the SDKs against local fakes, which always runs)
so that the feature manifest cites only tests that run on every machine; here a missing key
is a skip with the reason, not a failure.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from test_sandbox_providers import PROVIDERS, provider_class

from furlong.envs.sandbox.base import SandboxLimits


@pytest.mark.parametrize("name", PROVIDERS)
def test_live_provider(name):
    var = f"{name.upper()}_API_KEY"
    if not os.environ.get(var):
        pytest.skip(f"{var} is not set: the live {name} check needs a {name} account (the fakes cover the rest)")
    box = provider_class(name)(SandboxLimits(timeout_s=20.0, max_output_bytes=100))

    async def go():
        try:
            return await box.run("print(6 * 7)"), await box.run("print('x' * 1000)\nraise SystemExit(2)")
        finally:
            await box.close()

    ok, bad = asyncio.run(go())
    assert ok["status"] == "ok" and ok["stdout"] == "42\n", ok
    assert bad["exit_code"] == 2 and bad["truncated"] and bad["stdout"] == "x" * 100
