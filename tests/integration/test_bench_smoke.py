"""The RL benchmarks run end to end at their smallest (`--smoke`: tiny model, 2x2 samples, a timed step or two).

No timing is asserted: these prove the scripts work, so a recorded figure can be reproduced.
The window arithmetic they rely on is checked exactly on made-up step logs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
FLOAT = r"(\d+(?:\.\d+)?)"


def run_script(name: str, args: tuple[str, ...] = ("--smoke",), timeout: float = 240) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run(
        [sys.executable, str(BENCH / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, f"{name} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout.strip().splitlines()


def test_steady_state_window_starts_after_warmup() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from rl_bench import steady_state
    finally:
        sys.path.remove(str(BENCH))
    rows = [
        {
            "step": i + 1,
            "time": t + lag,  # written late, in the background: the window must not depend on it
            "time/started_unix": t - 4.0,
            "time/step_s": 4.0,
            "rollout/samples": 64.0,
            "time/rollout_wait_s": 1.0,
            "time/train_s": 2.0,
            "weight_sync/seconds": 0.5,
            "rollout/response_len_mean": 64.0,
        }
        for i, (t, lag) in enumerate([(100.0, 0.0), (110.0, 3.0), (114.0, 0.5), (118.0, 0.0)])
    ]
    r = steady_state(rows, warmup=2)  # steps 3 and 4 are timed: 128 samples from t=110 to t=118
    assert r["samples_per_s"] == 128 / 8 and r["step_s"] == 4.0 and r["other_s"] == 0.5
    with pytest.raises(ValueError, match="at least 3 logged steps"):
        steady_state(rows[:2], warmup=2)


def test_median_rounds_runs_every_mode_once_a_round_and_reports_each_median() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from rl_bench import median_rounds
    finally:
        sys.path.remove(str(BENCH))
    order: list[str] = []
    speeds = {"sync": iter([3.0, 1.0, 2.0]), "async": iter([5.0, 6.0, 4.0])}

    def run(name: str) -> dict[str, float]:
        order.append(name)
        return {"samples_per_s": next(speeds[name]), "run": len(order)}

    told: list[str] = []
    res = median_rounds({n: (lambda n=n: run(n)) for n in speeds}, 3, lambda n, r: told.append(n))
    assert order == told == ["sync", "async"] * 3  # in rounds, not all runs of one mode first
    assert res["sync"]["samples_per_s"] == 2.0 and res["sync"]["run"] == 5  # the median run's own figures
    assert res["async"]["all_samples_per_s"] == [4.0, 5.0, 6.0] and res["async"]["run"] == 2
    assert res["async"]["round_samples_per_s"] == [5.0, 6.0, 4.0]  # in round order, for per-round ratios


def test_trainer_step_against_another_setting() -> None:
    """`--against`: both configurations time every budget, and the ratio of their step times is printed."""
    tiny = ("--size", "tiny", "--samples", "8", "--new-tokens", "8", "--steps", "1", "--budgets", "64,128")
    lines = run_script("trainer_step.py", (*tiny, "--against", "onednn_linear=false", "--runs", "2"))
    assert any("against: {'onednn_linear': False}" in line for line in lines), lines
    for budget in (64, 128):
        for config in ("this", "against"):
            assert any(re.match(rf"\s+{budget} {config}\s+{FLOAT}\s+\d+\s+{FLOAT}\s+\d+%$", x) for x in lines), lines
        rounds = rf"\s+{budget} against / this: {FLOAT}x the step time \(rounds {FLOAT} {FLOAT}\)$"
        assert any(re.match(rounds, line) for line in lines), lines
    m = re.fullmatch(rf"RATIO trainer_of_roofline={FLOAT} speedup_vs_against={FLOAT}", lines[-1])
    assert m and float(m.group(2)) > 0, lines[-1]


@pytest.mark.slow
def test_async_speedup_smoke() -> None:
    lines = run_script("async_speedup.py")
    assert re.fullmatch(rf"SPEEDUP overlap_vs_sync={FLOAT} async_vs_sync={FLOAT}", lines[-1]), lines[-1]
    for mode in ("sync", "overlap", "async"):
        assert any(re.match(rf"{mode}\s+{FLOAT}\s+{FLOAT}\s+{FLOAT}x$", line) for line in lines), (mode, lines)
    # each mode's engine and trainer compute, read from its timeline: both did work in the window, and the one
    # engine's seconds split into steps with a prefill and decode-only steps
    computing = (
        rf"computing: engines\s+{FLOAT} s \(steps with a prefill {FLOAT}, decode-only {FLOAT}\), trainer\s+{FLOAT}"
    )
    busy = [re.search(computing, line) for line in lines]
    busy = [[float(x) for x in m.group(1, 2, 3, 4)] for m in busy if m]
    assert len(busy) == 3 and all(e > 0 and t > 0 for e, _, _, t in busy), lines
    assert all(abs(p + d - e) <= 0.02 for e, p, d, _ in busy), busy
    assert any(re.match(rf"time-shared ceiling: .* = {FLOAT}x", line) for line in lines), lines


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="TRL is in the `bench` extra: pip install -e '.[bench]'"
)
def test_vs_trl_smoke() -> None:
    lines = run_script("vs_trl.py")
    m = re.fullmatch(rf"RATIO furlong_sync_vs_trl={FLOAT} furlong_async_vs_trl={FLOAT}", lines[-1])
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, lines[-1]
    for name in ("TRL GRPOTrainer", "TRL GRPOTrainer CB", "furlong sync", "furlong async"):  # both TRL paths ran
        assert any(re.match(rf"{name}\s+{FLOAT}\s.*x$", line) for line in lines), (name, lines)
    # The async target counts wasted work too: each furlong mode's line says how many stale groups it regenerated.
    for name in ("furlong sync", "furlong async"):
        assert any(re.match(rf"\s+{name}\s+step .*; stale groups regenerated \d+$", line) for line in lines), (
            name,
            lines,
        )


@pytest.mark.timeout(300)
def test_http_overhead_smoke() -> None:
    """Both uvicorn stacks serve the engine and the router; CPU per request is measured for each."""
    # 200 requests: CPU time is read in 10 ms ticks, and ~0.5 ms a request must come to a few ticks
    lines = run_script("http_overhead.py", ("--requests", "200", "--runs", "1"))
    for stack in ("pure (h11 + asyncio)", "c (httptools + uvloop)"):
        row = [re.match(rf"{re.escape(stack)}\s+{FLOAT}\s+{FLOAT}$", x) for x in lines]
        assert any(m and float(m.group(1)) > 0 and float(m.group(2)) > 0 for m in row), (stack, lines)
    assert re.fullmatch(rf"RATIO engine_cpu_pure_vs_c={FLOAT} router_cpu_pure_vs_c={FLOAT}", lines[-1]), lines[-1]


@pytest.mark.timeout(300)
def test_agent_turns_smoke() -> None:
    """Both configurations run the agent work; only the rows one takes mixed steps over the rows (the script
    refuses to print a ratio otherwise), and each reports engine seconds in both kinds of step."""
    lines = run_script(
        "agent_turns.py", ("--size", "tiny", "--runs", "1", "--batches", "1", "--episodes", "8", "--turns", "3")
    )
    for mode in ("eager", "rows"):
        row = [re.match(rf"{mode}\s+{FLOAT}\s+{FLOAT}\s+{FLOAT}$", x) for x in lines]
        assert any(m and all(float(m.group(i)) > 0 for i in (1, 2, 3)) for m in row), (mode, lines)
    assert re.fullmatch(rf"RATIO rows_vs_eager_wall={FLOAT} rows_vs_eager_prefill_steps={FLOAT}", lines[-1]), lines[-1]


@pytest.mark.timeout(300)
def test_engine_throughput_smoke() -> None:
    """HF and every engine row run; the ceiling line times the engine's projections alone, for the decode step
    and over the prompts, and turns them into a tok/s bound set against the roofline and HF."""
    lines = run_script("engine_throughput.py", ("--size", "tiny", "--prompts", "4", "--new-tokens", "8", "--skip-http"))
    for name in ("HF generate", "furlong engine, in-process", "furlong engine, mixed lengths"):
        row = [re.match(rf"{re.escape(name)}.*\s([\d,]+)\s+(\d+)%\s+{FLOAT}x$", x) for x in lines]
        assert any(m for m in row), (name, lines)
    ceiling = next((x for x in lines if x.startswith("ceiling:")), None)
    m = ceiling and re.search(
        rf"take {FLOAT} ms a decode step of 4 rows and {FLOAT} ms over the prompts: at most ([\d,]+) tok/s, "
        rf"(\d+)% of the roofline, {FLOAT}x HF$",
        ceiling,
    )
    assert m and float(m.group(1)) > 0 and int(m.group(3).replace(",", "")) > 0, ceiling
    assert re.fullmatch(rf"RATIO engine_vs_hf={FLOAT} engine_of_roofline={FLOAT}", lines[-1]), lines[-1]
