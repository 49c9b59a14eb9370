"""The sandbox an `envs` config asks for: the one module that knows every provider.

`envs.sandbox_factory` (a plug point) wins; else `envs.sandbox` names a built-in
provider. The cloud providers are imported only when named: their SDKs are an
optional extra (`furlong[envs]`), and a missing one is reported by the provider.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from furlong.config.registry import load_plugin
from furlong.envs.sandbox.base import Sandbox

if TYPE_CHECKING:
    from furlong.config.schema import EnvsConfig


def build_sandbox(envs: EnvsConfig) -> Sandbox:
    """The sandbox an `envs` config asks for: `sandbox_factory` if set, else the named provider."""
    if envs.sandbox_factory:
        return load_plugin("envs.sandbox_factory", envs.sandbox_factory)(config=envs)
    if envs.sandbox == "e2b":
        from furlong.envs.sandbox.e2b import E2BSandbox

        return E2BSandbox.from_config(envs)
    if envs.sandbox == "daytona":
        from furlong.envs.sandbox.daytona import DaytonaSandbox

        return DaytonaSandbox.from_config(envs)
    if envs.sandbox != "local":
        raise ValueError(f"envs.sandbox={envs.sandbox!r}: expected local, e2b or daytona")
    from furlong.envs.sandbox.local import LocalSandbox

    return LocalSandbox.from_config(envs)
