"""The floor plan of DESIGN §4 holds: no import loops between folders, leaves that stay leaves, floors
imported only downwards, small modules and functions, no string RPCs.

The checks read the source with `ast` (`tools/layout.py`; `python -m tools.layout` prints every
violation at once). The last tests run the same checks on a small fake package, so each rule is
shown to fail when broken.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tools import layout

IMPORTS = layout.all_imports()


def _show(title: str, found: list) -> str:
    return f"{title} ({len(found)}):\n" + "\n".join(f"  {x}" for x in found)


def test_no_import_cycles_between_folders():
    found = [" | ".join(map(str, cycle)) for cycle in layout.cycles(IMPORTS)]
    assert not found, _show("folders that import each other (run-time imports)", found)


def test_core_and_config_import_no_other_folder():
    found = layout.leaf_violations(IMPORTS)
    assert not found, _show("core imports only core; config imports only config and core", found)


def test_folders_import_only_lower_floors():
    found = layout.floor_violations(IMPORTS)
    assert not found, _show(f"imports against the floor order {' < '.join(layout.FLOORS)} < top-level modules", found)


def test_modules_and_functions_are_small():
    found = layout.size_violations()
    assert not found, _show("too long", found)


def test_no_string_rpcs():
    found = layout.banned_text()
    assert not found, _show(f"{layout.BANNED_TEXT!r} in furlong/ (use the typed TrainerGroup)", found)


# ---------------------------------------------------------------- each rule fails when broken
def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "furlong"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return pkg


def test_the_checks_catch_each_kind_of_violation(tmp_path):
    long_body = "".join(f"    x{i} = {i}\n" for i in range(layout.MAX_FUNCTION_LINES))
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "from furlong.rollout import sample  # core reaches up\n",
            "config/schema.py": "from furlong.data import tasks\n",
            "data/tasks.py": "",
            "rollout/__init__.py": "",
            "rollout/manager.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from furlong.driver import run  # type-only: not a cycle, still against the floors\n"
                "def late():\n"
                "    from ..envs import agent  # relative, inside a function: still an import\n"
                "    return agent\n"
            ),
            "envs/agent.py": "import furlong.rollout.manager\n",
            "driver/run.py": 'from furlong import cli\nTOP = None\nTOP.acall("train_rollout")\n',
            "cli.py": "def main():\n" + long_body,
            "mystery/thing.py": "from furlong.core import x\n",
        },
    )
    imps = layout.all_imports(pkg)
    assert [sorted({i.source for i in c}) for c in layout.cycles(imps)] == [["envs", "rollout"]]
    assert {(i.source, i.target) for i in layout.leaf_violations(imps)} == {("core", "rollout"), ("config", "data")}
    floors = layout.floor_violations(imps, pkg)
    for expected in (
        "rollout -> envs",
        "rollout -> driver",
        "driver -> cli",
        "core -> rollout",
        "folder 'mystery' has no floor",
    ):
        assert any(expected in line for line in floors), (expected, floors)
    assert not any("envs -> rollout" in line for line in floors)  # downwards is fine
    assert [line.split(":")[0] for line in layout.size_violations(pkg)] == ["furlong/cli.py"]
    assert layout.banned_text(pkg) == ['furlong/driver/run.py:3: TOP.acall("train_rollout")']


def test_a_module_over_the_line_limit_is_reported(tmp_path):
    pkg = _package(tmp_path, {"core/big.py": "x = 1\n" * (layout.MAX_MODULE_LINES + 1), "core/ok.py": "x = 1\n"})
    assert layout.size_violations(pkg) == [
        f"furlong/core/big.py: module has {layout.MAX_MODULE_LINES + 1} lines (max {layout.MAX_MODULE_LINES})"
    ]
