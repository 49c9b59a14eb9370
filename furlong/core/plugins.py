"""The one plug-point loader: `package.module:function` strings to objects, with errors that name the key.

Every extension hook in furlong is a dotted path in the config. The registry
(`furlong.config.registry`) checks what a loaded object must look like; this module
only imports it, so every reader of a path (the registry, the environments, the
rewards) fails the same way: naming the config key, the path and what is missing.
"""

from __future__ import annotations

import difflib
import importlib
import re
from typing import Any

# `package.module:attr` or `package.module:Class.attr`
PLUGIN_PATH_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class PluginError(Exception):
    """A plug-point path that cannot be used; names the config key, the path and the reason."""

    def __init__(self, key: str, path: str, reason: str, expected: str = ""):
        self.key, self.path, self.reason = key, path, reason
        super().__init__(f"{key}={path!r}: {reason}" + (f"\n    expected: {expected}" if expected else ""))


def import_path(path: str, key: str = "plug point") -> Any:
    """The object `package.module:attr[.attr]` names; a PluginError names `key`, the path and what is missing."""
    if not PLUGIN_PATH_RE.match(path):
        raise PluginError(key, path, "expected 'package.module:function'")
    module_name, attr_path = path.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if missing == module_name or module_name.startswith(missing + "."):  # the path itself is wrong
            why = f"module {module_name!r} not found" + (f" (no package {missing!r})" if missing != module_name else "")
        else:  # the module exists but imports something that does not
            why = f"importing module {module_name!r} failed: no module named {missing!r}"
        raise PluginError(key, path, why) from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise PluginError(key, path, f"importing module {module_name!r} raised {type(e).__name__}: {e}") from None
    where = module_name
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = difflib.get_close_matches(attr, names, n=1)
            raise PluginError(
                key, path, f"{where!r} has no attribute {attr!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
            )
        obj = getattr(obj, attr)
        where = f"{where}:{attr}" if ":" not in where else f"{where}.{attr}"
    return obj
