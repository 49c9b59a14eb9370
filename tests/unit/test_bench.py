"""`furlong bench`: benchmarks are run by name from the repository's benchmarks/ folder."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from furlong import bench, cli

ROOT = Path(__file__).resolve().parents[2]


def test_list_names_the_repository_benchmarks(capsys):
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines()[1:]]
    assert "vs_trl" in names and "weight_sync" in names
    assert "rl_bench" not in names  # a helper the RL benchmarks share, not a benchmark
    assert set(names) == set(bench.available(ROOT / "benchmarks"))


def test_unknown_name_fails_naming_the_known_ones(capsys):
    assert cli.main(["bench", "vs_tlr"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'vs_tlr'" in err and "did you mean 'vs_trl'?" in err
    assert "known: " in err and "weight_sync" in err


def test_runs_the_script_with_its_arguments_from_the_repository_root(tmp_path, capfd):
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "echo.py").write_text(
        textwrap.dedent('''
        """Prints what it was given."""
        import os, sys
        if __name__ == "__main__":
            print("argv", sys.argv[1:], "cwd", os.getcwd(), "python", sys.executable)
            sys.exit(3)
    ''')
    )
    assert bench.main(["echo", "--model", "m25"], places=[folder]) == 3  # the benchmark's own exit status
    out = capfd.readouterr().out
    assert "argv ['--model', 'm25']" in out
    assert f"cwd {tmp_path}" in out and f"python {sys.executable}" in out


def test_without_a_benchmarks_folder_the_error_says_so(tmp_path, capsys):
    assert bench.main(["vs_trl"], places=[tmp_path / "benchmarks"]) == 2
    err = capsys.readouterr().err
    assert "no benchmarks/ folder" in err and str(tmp_path / "benchmarks") in err and "clone" in err
