"""`furlong profile RECIPE [key=value ...] [--steps N]`: a few steps under `torch.profiler`, one trace.

Runs `furlong train` for `--steps` RL steps (default 2) with `FURLONG_PROFILE_DIR` set to
`RUN_DIR/profile/`, so the driver, every engine process and every trainer rank profile themselves
(`furlong.core.profiling`); then merges their Chrome traces and the run's timeline spans (one track
per worker, from `events.sqlite`) into `RUN_DIR/profile/trace.json`, next to the dashboard's data.
Open it in https://ui.perfetto.dev or chrome://tracing. Profiling slows every process down: the
trace shows where time goes, not how fast a normal run is.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

from furlong.core import profiling

TRACE = "trace.json"


def merge(folder: Path, db: Path | None = None) -> Path:
    """Every `<name>-<pid>.json` in `folder` plus the spans of `db`, on one clock, as `folder/trace.json`."""
    parts = []
    for path in sorted(folder.glob("*-*.json")):
        try:
            parts.append((path, json.loads(path.read_text())))
        except ValueError:
            continue  # a process killed while writing: the others still make a trace
    bases = [int(p.get("baseTimeNanoseconds", 0)) for _, p in parts]
    base = min([b for b in bases if b] or [0])
    events: list[dict[str, Any]] = []
    for (path, part), b in zip(parts, bases):
        shift = (b - base) / 1000 if b else 0.0
        name = path.stem.rsplit("-", 1)[0]
        for ev in part.get("traceEvents", []):
            if shift and "ts" in ev:
                ev = {**ev, "ts": float(ev["ts"]) + shift}
            events.append(ev)
        if part.get("traceEvents"):
            pid = part["traceEvents"][0].get("pid", name)
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{name} (torch)"}})
    if db is not None and db.exists():
        events += _span_events(db, base / 1000)
    out = folder / TRACE
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out


def _span_events(db: Path, base_us: float) -> list[dict[str, Any]]:
    """The timeline's spans as complete events, one track per worker (pid "furlong spans")."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT worker, phase, step, start, end FROM spans ORDER BY start").fetchall()
    tids = {w: i for i, w in enumerate(sorted({r[0] for r in rows}))}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": "furlong spans", "tid": t, "args": {"name": w}}
        for w, t in tids.items()
    ]
    for worker, phase, step, start, end in rows:
        ts = start * 1e6 - base_us
        events.append(
            {
                "ph": "X",
                "name": phase,
                "cat": "furlong",
                "pid": "furlong spans",
                "tid": tids[worker],
                "ts": ts,
                "dur": (end - start) * 1e6,
                "args": {"step": step},
            }
        )
    return events


def main(argv: list[str]) -> int:
    from furlong.config import ConfigError, load_config

    p = argparse.ArgumentParser(prog="furlong profile", description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. engine.num_engines=2")
    p.add_argument("--steps", type=int, default=2, help="RL steps to profile (default 2)")
    args = p.parse_args(argv)
    overrides = [*args.overrides, f"train.total_steps={args.steps}"]
    try:
        cfg = load_config(args.recipe, overrides)
    except ConfigError as e:
        print(f"furlong profile: {e}", file=sys.stderr)
        return 2
    folder = Path(cfg.run_dir) / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    os.environ[profiling.PROFILE_ENV] = str(folder)  # before Ray starts: every process inherits it
    from furlong.driver.cli import main as train

    profiling.start("driver")
    try:
        rc = train([args.recipe, *overrides])
    finally:
        profiling.stop()
        os.environ.pop(profiling.PROFILE_ENV, None)
    trace = merge(folder, Path(cfg.run_dir) / "events.sqlite")
    files = sorted(f.name for f in folder.glob("*-*.json"))
    print(f"furlong profile: {trace} ({len(files)} process traces: {', '.join(files)})", file=sys.stderr)
    return rc
