"""`furlong train` as a user runs it: real driver subprocesses (Ray, trainer actor, engine, router).

One module-scoped sync run (recipes/debug.yaml, 3 steps, a checkpoint every step) is
the reference for everything here:

- end to end: exit 0, result, checkpoints, metrics, samples, event store, no orphans;
- equivalence: fully async with `max_staleness=0`, and the engine colocated in the
  trainer's process, give the same samples and the same final weights;
- resume: a driver SIGKILLed mid-run and continued with `--resume` ends with the
  uninterrupted run's weights, and the killed run leaves no process behind.

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
        assert any(token in cmd for _, cmd in self.seen.values()), "the engine/router processes were never seen"
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
                    if token in cmd or any(s in cmd for s in sessions):
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
    """SIGKILL the driver in step 2 (after checkpoint 1), `--resume`: the sync run's weights, bit for bit.

    The kill leaves nothing behind: Ray fate-shares its GCS, raylet and workers with the
    driver, engines and router die with their actor (PR_SET_PDEATHSIG), and the driver's
    reaper (`core/processes.py`) kills Ray's agents, which otherwise outlive it.
    """
    run_dir = sync_run.parent / "killed"
    ckpt = run_dir / "checkpoints" / "step_1" / "driver_state.json"
    driver = train(run_dir, env={HOLD_ENV: str(ckpt)})
    deadline = time.monotonic() + 180
    while not ckpt.exists():
        assert driver.proc.poll() is None, driver.tail()
        assert time.monotonic() < deadline, driver.tail()
        time.sleep(0.05)
    time.sleep(0.5)  # into step 2: its rollouts are waiting on their rewards
    assert not (run_dir / "result.json").exists()
    driver.proc.send_signal(signal.SIGKILL)
    assert driver.wait() == -signal.SIGKILL
    left = driver.leftovers(run_dir)
    assert not left, "processes left by the SIGKILLed driver:\n" + "\n".join(left)

    resumed = Driver(["--resume", str(run_dir)], run_dir.parent / "resumed.log")
    result = finish(resumed, run_dir)
    assert result["steps"] == STEPS
    assert "resumed from" in resumed.log.read_text() and "step_1" in resumed.log.read_text()
    assert_same_weights(weights(sync_run), weights(run_dir))
    assert_same_samples(samples(sync_run)[1:], samples(run_dir)[1:])
