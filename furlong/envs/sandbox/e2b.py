"""E2B sandbox provider (`envs.sandbox: e2b`): model code runs in an E2B cloud micro-VM.

Why: a cloud VM per provider isolates better than a local process and moves the
CPU cost of rewards off the training machine. The run protocol (one machine reused
across runs, a fresh directory and the runner per run) is `remote.py`'s.

Configuration, from the environment (read by the `e2b` SDK itself):
- `E2B_API_KEY` (required);
- `E2B_DOMAIN`, or `E2B_API_URL` and `E2B_SANDBOX_URL` for a self-hosted or local
  endpoint; `E2B_HTTP_VERSION=1.1` where a proxy mishandles HTTP/2.
`template` picks the E2B template (default `base`, which has python3); `lifetime_s`
is how long E2B keeps the machine (a run after it ends creates a new one).
`envs.network: false` creates the machine with `allow_internet_access=False`.

Install: `pip install 'furlong[envs]'`.
"""

from __future__ import annotations

import os
from typing import Any

from furlong.envs.sandbox.base import SandboxLimits
from furlong.envs.sandbox.remote import RemoteSandbox, SandboxGone, missing_sdk


def _sdk() -> Any:
    try:
        import e2b
    except ImportError as e:
        raise missing_sdk("e2b", "e2b") from e
    return e2b


class E2BSandbox(RemoteSandbox):
    """Runs code in one E2B sandbox, created on first use and killed by `close()`."""

    provider = "e2b"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        api_key: str | None = None,
        api_url: str | None = None,
        template: str | None = None,
        lifetime_s: int = 3600,
        python: str = "python3",
        grace_s: float = 30.0,
    ):
        super().__init__(limits, python=python, grace_s=grace_s)
        self.e2b = _sdk()
        self.api_key = api_key or os.environ.get("E2B_API_KEY")
        if not self.api_key:
            raise RuntimeError("envs.sandbox=e2b: set the E2B_API_KEY environment variable (your E2B API key)")
        self.api_url, self.template, self.lifetime_s = api_url, template, lifetime_s

    async def _create(self) -> Any:
        opts = {"api_key": self.api_key, **({"api_url": self.api_url} if self.api_url else {})}
        return await self.e2b.AsyncSandbox.create(
            template=self.template,
            timeout=self.lifetime_s,
            allow_internet_access=self.limits.network,
            metadata={"created_by": "furlong"},
            **opts,
        )

    async def _exec(self, box: Any, command: str, timeout_s: float) -> tuple[int | None, str, str]:
        e2b = self.e2b
        try:
            r = await box.commands.run(command, timeout=timeout_s)
            return r.exit_code, r.stdout, r.stderr
        except e2b.CommandExitException as e:  # the runner itself failed (e.g. no python3 in the template)
            return e.exit_code, e.stdout, e.stderr
        except (e2b.SandboxNotRunningException, e2b.NotFoundException) as e:
            raise SandboxGone(str(e)) from e
        except e2b.TimeoutException as e:
            raise TimeoutError(str(e)) from e

    async def _upload(self, box: Any, path: str, data: bytes) -> None:
        try:
            await box.files.write(path, data, use_octet_stream=True)  # raw body (envd >= 0.5.7, else multipart)
        except (self.e2b.SandboxNotRunningException, self.e2b.NotFoundException) as e:
            raise SandboxGone(str(e)) from e

    async def _delete(self, box: Any) -> None:
        await box.kill()

    def _isolation(self, box: Any) -> dict[str, Any]:
        return {
            "provider": "e2b",
            "sandbox_id": box.sandbox_id,
            "vm": "e2b micro-VM",
            "network": "allowed" if self.limits.network else "blocked by provider",
            "memory": "rlimit",
        }
