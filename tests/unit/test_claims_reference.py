"""Generated reference pages are up to date, and the docs site builds strictly offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.claims.check import check_references
from tools.claims.reference import CLI_PAGE, CONFIG_PAGE, cli_page, collect_help, config_page

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """Every `furlong COMMAND --help` (one child process: it imports every sub-system)."""
    return collect_help()


def test_cli_reference_is_current(helps: dict[str, str]) -> None:
    assert "usage: furlong COMMAND" in helps[""]
    assert all(text.strip() for text in helps.values())
    committed = (ROOT / CLI_PAGE).read_text(encoding="utf-8")
    assert committed == cli_page(helps), f"{CLI_PAGE} is stale: run `python -m tools.claims --write-reference`"


def test_config_reference_is_current() -> None:
    committed = (ROOT / CONFIG_PAGE).read_text(encoding="utf-8")
    assert committed == config_page(), f"{CONFIG_PAGE} is stale: run `python -m tools.claims --write-reference`"


def test_stale_reference_page_is_reported_with_its_line(tmp_path: Path, monkeypatch, helps) -> None:
    monkeypatch.setattr("tools.claims.reference.collect_help", lambda: helps)
    page = tmp_path / CONFIG_PAGE
    page.parent.mkdir(parents=True)
    lines = config_page().splitlines()
    lines[2] = "# Config reference (edited by hand)"
    page.write_text("\n".join(lines))
    (tmp_path / CLI_PAGE).write_text(cli_page(helps))
    problems = check_references(tmp_path)
    assert [(p.path, p.line) for p in problems] == [(CONFIG_PAGE, 3)], problems
    assert "stale" in problems[0].message


def test_docs_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict` turns every warning (dead link or anchor, page not in nav) into a failure."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.fail("mkdocs is not installed: it is in the dev extra (`pip install -c constraints.txt -e '.[dev]'`)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    assert (tmp_path / "site" / "index.html").exists()
    shutil.rmtree(tmp_path / "site")
