"""The per-test timeout audit (`python -m tools.timeouts`): it finds what it should, and the suite passes it."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tools.timeouts import ROOT, audit, audit_file


def _write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "test_planted.py"
    p.write_text(textwrap.dedent(body))
    return p


def test_the_suite_gives_every_test_a_timeout_that_covers_its_waits():
    findings = audit([ROOT / "tests"])
    assert not findings, "\n".join(map(str, findings))


def test_a_subprocess_wait_longer_than_the_global_limit_is_found(tmp_path):
    p = _write(
        tmp_path,
        """
        import subprocess
        def test_long_run():
            subprocess.run(["furlong", "train"], timeout=900)
        """,
    )
    (f,) = audit_file(p, default=300)
    assert (f.test, f.waits, f.limit) == ("test_long_run", 900, 300)
    assert "raise @pytest.mark.timeout" in str(f)


def test_helpers_fixtures_and_constants_count_and_a_marker_fixes_it(tmp_path):
    p = _write(
        tmp_path,
        """
        import pytest, subprocess
        RUN_S = 200
        def _run(args):
            return subprocess.run(args, timeout=RUN_S)
        @pytest.fixture(scope="module")
        def served():
            subprocess.run(["furlong", "serve"], timeout=120)
        def test_first(served):
            _run(["a"])
        def test_second(served):
            _run(["b"])
        @pytest.mark.timeout(400)
        def test_marked(served):
            _run(["c"])
        """,
    )
    found = {f.test: f.waits for f in audit_file(p, default=300)}
    # the module fixture's setup counts in its first test only; the marker covers the third
    assert found == {"test_first": 320}


def test_playwright_milliseconds_and_short_request_timeouts_are_not_seconds(tmp_path):
    p = _write(
        tmp_path,
        """
        from playwright.sync_api import sync_playwright
        import httpx
        def test_page(page):
            page.wait_for_selector("#x", timeout=60000)
            httpx.get("http://127.0.0.1:1", timeout=10)
        """,
    )
    assert audit_file(p, default=300) == []
