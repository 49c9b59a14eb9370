"""Daytona sandbox provider (`envs.sandbox: daytona`): model code runs in a Daytona cloud sandbox.

Why: a cloud sandbox isolates better than a local process and moves the CPU cost
of rewards off the training machine. The run protocol (one sandbox reused across
runs, a fresh directory and the runner per run) is `remote.py`'s.

Configuration, from the environment:
- `DAYTONA_API_KEY` (required);
- `DAYTONA_API_URL` (default `https://app.daytona.io/api`; a self-hosted or local
  endpoint), `DAYTONA_TARGET` (region).
`snapshot` picks the Daytona snapshot (default: Daytona's Python snapshot). The
sandbox is ephemeral: Daytona deletes it `auto_stop_minutes` after its last
activity even if `close()` is never reached. `envs.network: false` creates it with
`network_block_all`.

Install: `pip install 'furlong[envs]'`.
"""

from __future__ import annotations

import math
import os
from typing import Any

from furlong.envs.sandbox.base import SandboxLimits
from furlong.envs.sandbox.remote import RemoteSandbox, SandboxGone, missing_sdk


def _sdk() -> Any:
    try:
        import daytona
    except ImportError as e:
        raise missing_sdk("daytona", "daytona") from e
    return daytona


class DaytonaSandbox(RemoteSandbox):
    """Runs code in one Daytona sandbox, created on first use and deleted by `close()`."""

    provider = "daytona"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        api_key: str | None = None,
        api_url: str | None = None,
        target: str | None = None,
        snapshot: str | None = None,
        auto_stop_minutes: int = 15,
        create_timeout_s: float = 120.0,
        python: str = "python3",
        grace_s: float = 30.0,
    ):
        super().__init__(limits, python=python, grace_s=grace_s)
        self.daytona = _sdk()
        self.api_key = api_key or os.environ.get("DAYTONA_API_KEY")
        if not self.api_key:
            raise RuntimeError(
                "envs.sandbox=daytona: set the DAYTONA_API_KEY environment variable (your Daytona API key)"
            )
        self.api_url = api_url or os.environ.get("DAYTONA_API_URL")
        self.target = target or os.environ.get("DAYTONA_TARGET")
        self.snapshot, self.auto_stop_minutes, self.create_timeout_s = snapshot, auto_stop_minutes, create_timeout_s

    async def _create(self) -> Any:
        d = self.daytona
        client = d.AsyncDaytona(d.DaytonaConfig(api_key=self.api_key, api_url=self.api_url, target=self.target))
        try:
            params = d.CreateSandboxFromSnapshotParams(
                language="python",
                snapshot=self.snapshot,
                network_block_all=not self.limits.network,
                ephemeral=True,
                auto_stop_interval=self.auto_stop_minutes,
                labels={"created-by": "furlong"},
            )
            box = await client.create(params, timeout=self.create_timeout_s)
        except BaseException:
            await client.close()
            raise
        return client, box

    async def _exec(self, box: Any, command: str, timeout_s: float) -> tuple[int | None, str, str]:
        d = self.daytona
        try:
            r = await box[1].process.exec(command, timeout=math.ceil(timeout_s))
        except (d.DaytonaNotFoundError, d.DaytonaGoneError) as e:
            raise SandboxGone(str(e)) from e
        except d.DaytonaTimeoutError as e:
            raise TimeoutError(str(e)) from e
        return r.exit_code, r.result, ""  # exec merges the streams; the runner's JSON line keeps them apart

    async def _upload(self, box: Any, path: str, data: bytes) -> None:
        d = self.daytona
        try:
            await box[1].fs.upload_file(data, path)
        except (d.DaytonaNotFoundError, d.DaytonaGoneError) as e:
            raise SandboxGone(str(e)) from e

    async def _delete(self, box: Any) -> None:
        client, sandbox = box
        try:
            await sandbox.delete()
        finally:
            await client.close()

    def _isolation(self, box: Any) -> dict[str, Any]:
        return {
            "provider": "daytona",
            "sandbox_id": box[1].id,
            "vm": "daytona sandbox",
            "network": "allowed" if self.limits.network else "blocked by provider",
            "memory": "rlimit",
        }
