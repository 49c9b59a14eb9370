"""The reliability page's figures, from a recorded chaos run: `python -m tools.reliability --write`.

The chaos tests (`tests/chaos/`) record what each run survived under `.reports/chaos/*.json`
(the supervisor's fault log, the rollout accounting). `--write` keeps that record in
`docs/data/chaos-run.json`, with the machine it ran on, and renders the "Figures from the
chaos suite" section of `docs/reliability.md` from it. `--check` (a unit test runs it)
renders the committed record again and fails when the page says anything else: the figures
on the page are always those of a run that happened, never typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / ".reports" / "chaos"
RECORD = ROOT / "docs" / "data" / "chaos-run.json"
PAGE = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- chaos-figures -->", "<!-- /chaos-figures -->"
RUNS = {  # recorded run -> (test that produced it, what it did)
    "engines": ("tests/chaos/test_chaos_engines.py", "one async run on 2 engines, faults in sequence"),
    "sync": ("tests/chaos/test_chaos_sync.py", "one run on 2 engines, every sync verified by checksum"),
    "router": ("tests/chaos/test_chaos_router.py", "one run whose router is SIGKILLed after step 1"),
    "lost": ("tests/chaos/test_chaos_sync.py", "the only engine killed while its weights file is gone"),
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def collect(reports: Path = REPORTS) -> dict[str, Any]:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))}
    if not runs:
        raise SystemExit(f"no chaos figures under {reports}: run `pytest tests/chaos` first")
    return {
        "recorded": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{os.cpu_count()} vCPU {cpu_model()}",
        "load_1min": round(os.getloadavg()[0], 1),
        "runs": runs,
    }


def _seconds(faults: list[dict[str, Any]]) -> str:
    secs = sorted(f["seconds"] for f in faults if f.get("recovered") and "seconds" in f)
    return f"{secs[0]:.1f} to {secs[-1]:.1f} s" if secs else "n/a"


def _fault_run(name: str, run: dict[str, Any]) -> list[str]:
    test, what = RUNS.get(name, (f"tests/chaos ({name})", "a chaos run"))
    sup, roll = run.get("supervisor") or {}, run.get("rollout") or {}
    faults = sup.get("fault_log", [])
    kinds = ", ".join(f"{k} {sum(f['kind'] == k for f in faults)}" for k in sorted({f["kind"] for f in faults}))
    lines = [f"- **{name}** (`{test}`): {what}; {run.get('steps')} steps finished."]
    if run.get("injected"):
        lines.append(
            f"  Injected: {'; '.join(' '.join(map(str, i)) if isinstance(i, list) else i for i in run['injected'])}."
        )
    if faults:
        lines.append(
            f"  Faults seen: {len(faults)} ({kinds}); recovered: {sum(bool(f.get('recovered')) for f in faults)}; "
            f"engine replacements: {sup.get('replacements', 0)}; syncs done again: {sup.get('syncs_retried', 0)}; "
            f"recovery time {_seconds(faults)}."
        )
    if sup.get("router_fault_log"):
        rf = sup["router_fault_log"]
        lines.append(
            f"  Router faults: {len(rf)}; restarts: {sup.get('router_restarts', 0)}; recovery time {_seconds(rf)}."
        )
    if roll:
        filtered = roll.get("filtered") or {}
        lost = 0 if roll.get("balanced") else "NOT BALANCED"
        lines.append(
            f"  Accounting: {roll.get('prompts_taken')} prompts taken = {roll.get('groups_trained')} trained + "
            f"{sum(filtered.values())} filtered {dict(filtered)} + {roll.get('in_buffer')} in the buffer; "
            f"{roll.get('samples_trained')} samples trained; samples lost: {lost}; generate calls that waited "
            f"out an outage instead of failing: {roll.get('outage_retries', 0)}."
        )
    return lines


def render(record: dict[str, Any]) -> str:
    out = [
        f"Recorded {record['recorded']} on a {record['machine']} (1-minute load {record['load_1min']}) by",
        "`.venv/bin/python -m pytest tests/chaos -q` and `python -m tools.reliability --write`",
        "(`docs/data/chaos-run.json` holds the whole record):",
        "",
    ]
    runs = record["runs"]
    for name in [n for n in RUNS if n in runs] + sorted(set(runs) - set(RUNS)):
        if name == "lost":
            msg = re.sub(r"/\S*/lost\b", "RUN_DIR", str(runs[name].get("stopped", "")))
            test, what = RUNS[name]
            out.append(f"- **lost** (`{test}`): {what}; the run stopped after {runs[name].get('steps')} steps with:")
            out.append(f"  `{msg[:400]}`")
        else:
            out.extend(_fault_run(name, runs[name]))
    return "\n".join(out)


def splice(page: str, body: str) -> str:
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{PAGE}: markers {BEGIN} ... {END} not found")
    head, rest = page.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{body}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="record .reports/chaos and rewrite the page's section")
    ap.add_argument("--check", action="store_true", help="fail when the page differs from the committed record")
    args = ap.parse_args(argv)
    if args.write:
        record = collect()
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        PAGE.write_text(splice(PAGE.read_text(), render(record)))
        print(f"wrote {RECORD.relative_to(ROOT)} and the figures in {PAGE.relative_to(ROOT)}")
        return 0
    want = splice(PAGE.read_text(), render(json.loads(RECORD.read_text())))
    if want != PAGE.read_text():
        print(f"{PAGE.relative_to(ROOT)}: the chaos figures differ from {RECORD.relative_to(ROOT)}; run --write")
        return 1
    print("reliability figures match the recorded chaos run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
