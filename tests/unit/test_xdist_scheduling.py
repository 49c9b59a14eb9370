"""The suite's `--dist loadfile` scheduler (tests/xdist_scheduling.py): a crashed worker fails its test, not the run.

A real pytest-xdist run in a subprocess over a planted suite: one test ends its worker process (as
pytest-timeout's thread method does to a test past its limit) after that worker has finished other files.
With xdist 3.8's own loadfile scheduler this layout can hang forever; with ours the run ends, the crashed
test is reported failed once, and every other test — the one after it in the same file included — runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_a_crashed_worker_fails_its_test_and_the_run_finishes(tmp_path):
    files = {
        "test_a.py": "def test_a1(): pass\ndef test_a2(): pass\n",
        "test_b.py": "def test_b1(): pass\n",
        "test_c.py": "import os\ndef test_crash(): os._exit(1)\ndef test_after_crash(): pass\n",
        "test_d.py": "def test_d1(): pass\n",
        "test_e.py": "def test_e1(): pass\ndef test_e2(): pass\n",
    }
    for name, body in files.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.xdist_scheduling", "-q"]
    out = subprocess.run(
        [*cmd, "-n", "2", "--dist", "loadfile", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    tail = out.stdout[-2000:] + out.stderr[-2000:]
    assert out.returncode == 1, tail
    assert "1 failed, 7 passed" in out.stdout, tail
    assert "test_c.py::test_crash" in out.stdout, tail
