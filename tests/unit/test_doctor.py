import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "furlong.cli", "doctor", *args], capture_output=True, text=True)


def test_doctor_passes_here_and_reports_each_check(tmp_path):
    r = run("--run-dir", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("torch", "transformers", "threads", "gpu", "run dir"):
        assert any(line.split()[1:2] == name.split()[:1] for line in r.stdout.splitlines()), name
    assert "0 failed" in r.stdout


def test_doctor_fails_on_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = run("--run-dir", str(blocker / "runs"))
    assert r.returncode == 1
    assert "FAIL run dir" in r.stdout and "1 failed (run dir)" in r.stdout


def test_unknown_command_suggests_the_closest():
    r = subprocess.run([sys.executable, "-m", "furlong.cli", "doctr"], capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean 'doctor'" in r.stderr
