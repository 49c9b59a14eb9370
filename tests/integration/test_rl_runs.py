"""`furlong train` as a user runs it: real driver subprocesses (Ray, trainer actor, engine, router).

One module-scoped sync run (recipes/debug.yaml, 3 steps, a checkpoint every step) is
the reference for everything here:

- end to end: exit 0, result, checkpoints, metrics, samples, event store, no orphans;
- equivalence: fully async with `max_staleness=0`, and the engine colocated in the
  trainer's process, give the same samples and the same final weights;
- resume: a driver SIGKILLed mid-run, its newest checkpoint damaged, and continued with
  `--resume` falls back to the checkpoint before, ends with the uninterrupted run's
  weights and records (metrics.jsonl, event store) row for row, and the killed run
  leaves no process behind.

The debug recipe's arithmetic task gives a random tiny model reward 0 everywhere, so
GRPO advantages would be 0 and the weights would never move (every "equal weights"
check would hold trivially). The runs therefore use `parity_reward` (below): a
reward that depends on the sampled tokens, so advantages, gradients and final
weights depend on exactly which tokens were generated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import holds_token

pytestmark = pytest.mark.slow  # each test runs `furlong train` (Ray, trainer, engine, router) once or twice

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS = 3
HOLD_ENV = "FURLONG_TEST_HOLD_AFTER"  # a file path: once it exists, the reward waits (the run is then "mid-step")
BASE = [
    "observe.tensorboard=false",
    f"train.total_steps={STEPS}",
    "train.checkpoint_every=1",
    "rollout.reward_fn=test_rl_runs:parity_reward",
]


async def parity_reward(sample: Any) -> float:
    """1 if the last token id is odd: varies within a group, and is fixed by the tokens alone."""
    hold = os.environ.get(HOLD_ENV)
    if hold and os.path.exists(hold):
        import asyncio

        await asyncio.sleep(3600)  # the test SIGKILLs the driver while it waits here
    return float(sample.tokens[-1] % 2)


# ---------------------------------------------------------------- processes
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _token_of(pid: int) -> str | None:
    """The admin token process `pid` was started with (`FURLONG_ADMIN_TOKEN` in its environment), if any."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    found = [e.split(b"=", 1)[1].decode() for e in entries if e.startswith(b"FURLONG_ADMIN_TOKEN=")]
    return found[0] if found else None


class Driver:
    """`furlong train ...` in a subprocess; a thread records every descendant it ever had.

    Ray's head (gcs, raylet, agents), its workers (the trainer and process actors) and
    the engine and router processes are all descendants of the driver while they run,
    so the record is what must be gone after the driver is.
    """

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "furlong.cli", "train", *args],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.seen: dict[int, tuple[str | None, str]] = {}  # pid -> (start time, command line)
        self.tokens: dict[int, str | None] = {}  # pid -> the admin token in its environment (engines, router)
        self._watch = threading.Thread(target=self._record, daemon=True)
        self._watch.start()

    def _record(self) -> None:
        while True:
            done = self.proc.poll() is not None
            kids, todo = _children(), [self.proc.pid]
            while todo:
                for c in kids.get(todo.pop(), []):
                    cmd = _cmdline(c)  # re-read: a child seen between fork and exec still shows its parent's
                    if c not in self.seen or cmd:
                        self.seen[c] = (_start_time(c), cmd or self.seen.get(c, (None, ""))[1])
                    if self.tokens.get(c) is None:  # re-read too: before exec, a child has its parent's environment
                        self.tokens[c] = _token_of(c)
                    todo.append(c)
            if done:
                return
            time.sleep(0.2)

    def wait(self, timeout: float = 240) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"furlong train did not finish in {timeout}s:\n{self.tail()}") from None
        self._watch.join()
        return rc

    def holders(self, token: str) -> list[int]:
        """The descendants that were handed `token` (in their environment): the engines and the router."""
        return [pid for pid, t in self.tokens.items() if t == token]

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def leftovers(self, run_dir: Path, grace_s: float = 15.0) -> list[str]:
        """Processes of this run still alive after `grace_s`: descendants, or any holding its token or Ray session."""
        token = (run_dir / "admin_token").read_text().strip()
        sessions = {
            part.split("=", 1)[1]
            for _, cmd in self.seen.values()
            for part in cmd.split()
            if part.startswith("--session-name=")
        }
        assert self.holders(token), "the engine/router processes were never seen"
        assert not [c for _, c in self.seen.values() if token in c], "the admin token was on a command line"
        assert sessions, "no Ray head process was seen under the driver"
        deadline = time.monotonic() + grace_s
        while True:
            alive = [
                f"{pid}: {cmd[:160]}"
                for pid, (start, cmd) in self.seen.items()
                if start is not None and _start_time(pid) == start
            ]
            for d in os.listdir("/proc"):
                if d.isdigit() and int(d) not in self.seen:
                    cmd = _cmdline(int(d))
                    if holds_token(d, token) or any(s in cmd for s in sessions):
                        alive.append(f"{d}: {cmd[:160]}")
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)


def train(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> Driver:
    return Driver(
        ["recipes/debug.yaml", *BASE, f"run_dir={run_dir}", *overrides], run_dir.parent / f"{run_dir.name}.log", env
    )


def finish(driver: Driver, run_dir: Path) -> dict[str, Any]:
    rc = driver.wait()
    assert rc == 0, driver.tail()
    assert not driver.leftovers(run_dir), driver.leftovers(run_dir, grace_s=0)
    return json.loads((run_dir / "result.json").read_text())


# ---------------------------------------------------------------- what runs leave
def samples(run_dir: Path) -> list[list[Any]]:
    from furlong.core.sample import Sample

    return [
        [
            Sample.from_json(line).validate()
            for line in (run_dir / "samples" / f"step_{i}.jsonl").read_text().splitlines()
        ]
        for i in range(STEPS)
    ]


def weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The trained policy of `checkpoints/step_<step>/`, through `furlong export` (what a user ships)."""
    from safetensors.torch import load_file

    from furlong.train.export import export

    out = export(run_dir / "checkpoints" / f"step_{step}", run_dir.parent / f"{run_dir.name}_hf_{step}")
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_samples(want: list[list[Any]], got: list[list[Any]]) -> None:
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert [s.tokens for s in a] == [s.tokens for s in b], f"step {step}: tokens differ"
        assert [s.reward for s in a] == [s.reward for s in b], f"step {step}: rewards differ"
        assert [s.token_versions for s in a] == [s.token_versions for s in b], f"step {step}: token versions differ"
        for sa, sb in zip(a, b):
            diff = (torch.tensor(sa.rollout_logprobs) - torch.tensor(sb.rollout_logprobs)).abs().max().item()
            assert diff <= 1e-5, f"step {step} sample {sa.index}: rollout log-probs differ by {diff}"


def assert_same_weights(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Bit for bit: the trainer recomputes every log-prob it trains on, so equal samples give equal weights."""
    assert want.keys() == got.keys() and want
    different = {k: (want[k] - got[k]).abs().max().item() for k in want if not torch.equal(want[k], got[k])}
    assert not different, f"final weights differ (max |diff| per tensor): {different}"


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> Path:
    """The reference: `furlong train recipes/debug.yaml` in sync mode, verified weight syncs."""
    run_dir = tmp_path_factory.mktemp("rl") / "sync"
    driver = train(run_dir, "weights.verify=true")
    rc = driver.wait()
    run_dir.joinpath("rc").write_text(str(rc))
    run_dir.joinpath("leftovers").write_text("\n".join(driver.leftovers(run_dir)) if rc == 0 else "")
    assert rc == 0, driver.tail()
    return run_dir


# ---------------------------------------------------------------- tests
def test_train_runs_end_to_end_and_leaves_no_process(sync_run):
    leftovers = sync_run.joinpath("leftovers").read_text()
    assert not leftovers, f"processes left after a successful run:\n{leftovers}"
    result = json.loads((sync_run / "result.json").read_text())
    assert result["steps"] == STEPS and result["rollout_stats"]["balanced"]
    assert (sync_run / "checkpoints" / f"step_{STEPS}" / "driver_state.json").exists()
    assert json.loads((sync_run / "checkpoints" / f"step_{STEPS}" / "driver_state.json").read_text())["step"] == STEPS
    lines = [json.loads(x) for x in (sync_run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert all("rollout/reward_mean" in m for m in lines)
    assert all(m["weight_sync/verified"] == 1 for m in lines), "weights.verify=true did not verify every sync"
    # One trainer rank over shm: the engines read the trainer's resident parameters in place (weights/resident.py)
    assert all(0 < m["weight_sync/zero_copy_bytes"] == m["weight_sync/bytes"] for m in lines), lines[-1]
    batches = samples(sync_run)
    assert [len(b) for b in batches] == [4] * STEPS
    assert {s.reward for b in batches for s in b} == {0.0, 1.0}, "parity_reward should vary (else weights cannot move)"
    assert (sync_run / "events.sqlite").exists()
    moved = weights(sync_run, STEPS)
    start = weights(sync_run, 1)
    assert any(not torch.equal(moved[k], start[k]) for k in moved), "training did not change the weights"


def test_async_with_staleness_0_and_colocated_engine_equal_sync(sync_run):
    """Fully async with `max_staleness=0` and a colocated engine reproduce sync.

    Compared per step: sample tokens, rewards and per-token weight versions exactly;
    rollout log-probs within 1e-5; final weights (step 3 checkpoint, exported) bit for bit.
    Why this holds: every sample's seed derives from what it is (prompt, place in the
    stream, sample index, tokens so far), the engine draws each request from its own
    generator, and async with bound 0 regenerates every group that a token of an older
    version touched, so the trainer sees the same batches in the same order.
    Why log-probs get a tolerance: the engine batches requests differently in each run
    (async keeps more requests in flight; the colocated engine runs with the trainer
    process's threads), and fp32 matmuls over different batch shapes round differently
    in the last bits (measured: up to 5e-7). Tokens are still equal because each
    request's draw depends on its own noise, and only a near-tie could flip one. The
    weights are still equal because the trainer recomputes the log-probs it trains on
    (no off-policy correction here reads the rollout ones).
    """
    root = sync_run.parent
    want_samples, want_weights = samples(sync_run), weights(sync_run)
    # Both at once: start-up is mostly waiting on imports and processes, and neither run's
    # samples may depend on timing anyway.
    drivers = {
        name: train(root / name, *overrides)
        for name, overrides in {
            "async": ["rollout.mode=async", "rollout.max_staleness=0"],
            "colocated": ["cluster.colocate=true"],
        }.items()
    }
    for name, driver in drivers.items():
        result = finish(driver, root / name)
        assert result["steps"] == STEPS, name
        if name == "async":  # its producer ran ahead, so the bound had groups to regenerate
            assert result["rollout_stats"]["regenerated"].get("stale", 0) > 0, result["rollout_stats"]
        assert_same_samples(want_samples, samples(root / name))
        assert_same_weights(want_weights, weights(root / name))


def test_sigkilled_driver_resumes_to_the_uninterrupted_weights(sync_run):
    """SIGKILL the driver in step 3 (after checkpoint 2), damage checkpoint 2, `--resume`: it falls
    back to checkpoint 1 with a warning and ends with the sync run's weights, bit for bit, and
    with its records: `metrics.jsonl` and the event store's metrics and samples, row for row
    (steps 1 and 2 were recorded before the kill; step 2 again after the resume).

    The kill leaves nothing behind: Ray fate-shares its GCS, raylet and workers with the
    driver, engines and router die with their actor (PR_SET_PDEATHSIG), and the driver's
    reaper (`core/processes.py`) kills Ray's agents, which otherwise outlive it.
    """
    run_dir = sync_run.parent / "killed"
    ckpt = run_dir / "checkpoints" / "step_2" / "driver_state.json"
    driver = train(run_dir, env={HOLD_ENV: str(ckpt)})
    deadline = time.monotonic() + 180
    while not ckpt.exists():
        assert driver.proc.poll() is None, driver.tail()
        assert time.monotonic() < deadline, driver.tail()
        time.sleep(0.05)
    time.sleep(0.5)  # into step 3: its rollouts are waiting on their rewards
    assert not (run_dir / "result.json").exists()
    driver.proc.send_signal(signal.SIGKILL)
    assert driver.wait() == -signal.SIGKILL
    left = driver.leftovers(run_dir)
    assert not left, "processes left by the SIGKILLed driver:\n" + "\n".join(left)
    # Recorded before checkpoint 2 was marked complete: nothing of a finished step is lost to the kill.
    assert [m["step"] for m in jsonl_rows(run_dir)] == [1, 2]
    assert store_rows(run_dir, "SELECT DISTINCT step FROM samples ORDER BY step") == [(1,), (2,)]
    (shard,) = (run_dir / "checkpoints" / "step_2" / "dcp").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # damaged: the resume must fall back to checkpoint 1

    resumed = Driver(["--resume", str(run_dir)], run_dir.parent / "resumed.log")
    result = finish(resumed, run_dir)
    assert result["steps"] == STEPS
    log = resumed.log.read_text()
    assert "resumed from" in log and "step_1" in log
    assert "warning: checkpoint" in log and "step_2 failed to load" in log and "trying the one before it" in log
    assert_same_weights(weights(sync_run), weights(run_dir))
    assert_same_samples(samples(sync_run)[1:], samples(run_dir)[1:])
    assert_same_records(sync_run, run_dir)


# ---------------------------------------------------------------- records, row for row
VOLATILE = ("time", "time/", "perf/", "weight_sync/", "engine/", "rollout_stats/", "cpu/", "gpu/")  # clocks, counters
# Rollout-vs-trainer log-prob gaps (~1e-8): rollout log-probs may differ in the last bits (see assert_same_samples).
ROUNDING = "mismatch/"
SAMPLE_COLUMNS = (
    "step, idx, grp, reward, reward_detail, status, status_reason, staleness, prompt_length, response_length,"
    " trained_tokens, version_min, version_max, prompt_text, response_text"
)


def jsonl_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def store_rows(run_dir: Path, sql: str) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(run_dir / "events.sqlite") as c:
        return c.execute(sql).fetchall()


def assert_same_records(want_dir: Path, got_dir: Path) -> None:
    """metrics.jsonl and the event store's metrics and samples of two runs, row for row (clocks aside)."""
    from furlong.observe.store import unpack

    def steady(row: dict[str, Any], rounding: bool = False) -> dict[str, Any]:
        return {k: v for k, v in row.items() if not k.startswith(VOLATILE) and k.startswith(ROUNDING) == rounding}

    def same(want: dict[str, Any], got: dict[str, Any]) -> bool:
        return steady(got) == pytest.approx(steady(want), rel=1e-6, nan_ok=True) and steady(got, True) == pytest.approx(
            steady(want, True), abs=1e-5, nan_ok=True
        )

    want, got = jsonl_rows(want_dir), jsonl_rows(got_dir)
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        assert same(a, b), f"metrics.jsonl step {a['step']} differs:\n{a}\n{b}"
        assert any(k.startswith("train/") for k in steady(a)) and "rollout/reward_mean" in steady(a)
    metric_sql = "SELECT step, name, value FROM metrics ORDER BY step, name"
    want_m = [r for r in store_rows(want_dir, metric_sql) if not r[1].startswith(VOLATILE)]
    got_m = [r for r in store_rows(got_dir, metric_sql) if not r[1].startswith(VOLATILE)]
    assert [r[:2] for r in got_m] == [r[:2] for r in want_m], "event-store metric rows differ (or repeat)"
    assert same({f"{k}@{s}": v for s, k, v in want_m}, {f"{k}@{s}": v for s, k, v in got_m})
    sample_sql = f"SELECT {SAMPLE_COLUMNS}, tokens FROM samples ORDER BY step, idx"
    want_s, got_s = store_rows(want_dir, sample_sql), store_rows(got_dir, sample_sql)
    assert len(got_s) == len(want_s) == 4 * STEPS, "event-store sample rows missing or repeated"
    for a, b in zip(want_s, got_s):
        assert b[:-1] == a[:-1], f"event-store sample row differs: {a[:3]}"
        ta, tb = json.loads(a[-1]), json.loads(b[-1])
        assert unpack(tb["ids"], "i") == unpack(ta["ids"], "i") and tb["source"] == ta["source"]
