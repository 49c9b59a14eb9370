"""Every dashboard view in headless chromium, checked against the data of a real run.

The run (`tests/fixtures/real_run.py`, shared) is `recipes/debug.yaml` with 2 engines and 2 trainer ranks for a few steps in fully async mode (so some samples
are a version stale), with an eval every step and two optimiser steps per rollout (so
the trainer computes log-probs of the whole batch before updating, which the store
keeps per token; with one step it computes them only inside the loss), and a reward
that varies within a group (`dashboard_plugins.py`), so advantages are not all 0: the real driver, trainer, engine and
router, recording into `events.sqlite` as `furlong train` does. Each view is compared
with what the store holds, read here with plain SQL (not through the dashboard's own
reader): lanes = the workers recorded, tokens shown = the sample's length, steps
plotted = steps run. `make screenshots` saves screenshots of that run to docs/img/dashboard-<view>.png.

What a short real run cannot produce cheaply — tool tokens with loss mask 0, a partial
rollout spanning a weight sync, an engine going unhealthy, a run written while the page
follows it — is checked on a synthetic run written through the same EventStore API
(`tests/fixtures/synthetic_run.py`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sqlite3
import threading
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest

from furlong.dashboard.server import serve_in_thread
from furlong.observe.store import unpack
from tests.fixtures.real_run import ENGINES, RANKS, STEPS
from tests.fixtures.synthetic_run import write_synthetic_run

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None, reason="chromium is not installed (make setup installs it: scripts/install-chromium.sh)"
    ),
]
ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"


def REAL_RUN(test):  # noqa: N802 - used as a mark
    """Slow: the shared real run (2 engines, 2 ranks) takes 50-150 s on a loaded machine, once for all its tests."""
    return pytest.mark.timeout(600)(pytest.mark.slow(test))


OVERVIEW_CHARTS = ("Reward", "Accuracy", "Loss", "KL", "Entropy", "Throughput", "Staleness")


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def real_run(real_run_dir):
    """The shared real run (`tests/fixtures/real_run.py`: 2 engines, 2 trainer ranks), served by a dashboard."""
    h = serve_in_thread(real_run_dir, follow=False)
    yield real_run_dir, h.url
    h.stop()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, tiny_model_dir):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("synthetic")
    w = write_synthetic_run(
        d, steps=2, groups=2, group_size=4, engines=2, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir)
    )
    h = serve_in_thread(d, follow=False)
    yield d, w, h.url
    h.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1280, "height": 760})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    yield page
    page.close()
    assert errors == []


# ---------------------------------------------------------------- helpers
def sql(run_dir: Path, query: str, *args: Any) -> list[tuple]:
    """What the run recorded, read straight from its events.sqlite."""
    with closing(sqlite3.connect(f"file:{run_dir / 'events.sqlite'}?mode=ro", uri=True)) as db:
        return db.execute(query, args).fetchall()


def open_view(page, url: str, route: str) -> None:
    page.goto(f"{url}/#/{route}")
    settle(page)


def settle(page, contains: str = "") -> None:
    """Wait until the page has rendered the route in the address bar (and that route contains `contains`)."""
    page.wait_for_function(
        "c => document.body.dataset.route === location.hash && location.hash.includes(c)", arg=contains, timeout=20000
    )


def shot(page, view: str) -> None:
    """Screenshots for the docs, only from `make screenshots` (FURLONG_SCREENSHOTS=1): a test run writes no tracked file."""
    if os.environ.get("FURLONG_SCREENSHOTS") != "1":
        return
    IMG.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMG / f"dashboard-{view}.png"))


def natural(s: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


# ---------------------------------------------------------------- the real run
@REAL_RUN
def test_overview_plots_every_step_run(page, real_run):
    run_dir, url = real_run
    steps = [r[0] for r in sql(run_dir, "SELECT DISTINCT step FROM metrics ORDER BY step")]
    assert steps == list(range(1, STEPS + 1))  # one metrics row per step run, numbered as metrics.jsonl
    finite = {
        name: n for name, n in sql(run_dir, "SELECT name, COUNT(*) FROM metrics WHERE value IS NOT NULL GROUP BY name")
    }
    open_view(page, url, "overview")
    for chart in OVERVIEW_CHARTS:
        series = page.locator(f'svg[data-chart="{chart}"] g.series')
        assert series.count() >= 1, chart
        for name, points in series.evaluate_all("els => els.map(e => [e.dataset.metric, Number(e.dataset.points)])"):
            assert points == finite.get(name, STEPS) == STEPS, (
                chart,
                name,
            )  # samples/* aggregates are not metrics rows
    plotted = (
        page.locator('svg[data-chart="Loss"] g.series')
        .first.locator("circle.pt")
        .evaluate_all("els => els.map(e => Number(e.dataset.step))")
    )
    assert plotted == steps
    assert f"{STEPS} steps" in page.text_content("#status") and "offline" in page.text_content("#status")
    shot(page, "overview")


@REAL_RUN
def test_timeline_has_one_lane_per_recorded_worker(page, real_run):
    run_dir, url = real_run
    workers = sorted((r[0] for r in sql(run_dir, "SELECT DISTINCT worker FROM spans")), key=natural)
    phases = {r[0] for r in sql(run_dir, "SELECT DISTINCT phase FROM spans")}
    n_spans = sql(run_dir, "SELECT COUNT(*) FROM spans")[0][0]
    assert {"driver", "trainer/0"} <= set(workers) and {"generate", "forward-backward", "weight-sync", "eval"} <= phases
    open_view(page, url, "timeline")
    assert page.locator("#timeline g.lane").evaluate_all("els => els.map(e => e.dataset.worker)") == workers
    rects = page.locator("#timeline rect.span")
    assert rects.count() == n_spans
    assert set(rects.evaluate_all("els => els.map(e => e.dataset.phase)")) == phases
    assert page.locator("#timeline .step-label").evaluate_all("els => els.map(e => Number(e.dataset.step))") == list(
        range(1, STEPS + 1)
    )
    shot(page, "timeline")
    page.click("#tl-zoom-in")
    page.click("#tl-zoom-in")
    page.click("#tl-zoom-in")
    assert rects.count() < n_spans  # spans outside the zoomed window are not drawn
    page.click("#tl-reset")
    assert rects.count() == n_spans
    page.select_option("#tl-step", "2")
    settle(page, "#/timeline?step=2")
    assert (
        rects.evaluate_all("els => els.map(e => e.dataset.step)")
        == ["2"] * sql(run_dir, "SELECT COUNT(*) FROM spans WHERE step = 2")[0][0]
    )


@REAL_RUN
def test_timeline_shows_both_engines_and_both_ranks_at_work(page, real_run):
    """Lanes for every engine, every trainer rank, the router and the driver, each with its spans drawn."""
    run_dir, url = real_run
    want = {f"engine/{i}": {"decode", "prefill"} for i in range(ENGINES)}
    want |= {f"trainer/{r}": {"forward-backward", "optimiser", "weight-push"} for r in range(RANKS)}
    want |= {"router": {"route"}, "driver": {"generate", "reward", "weight-sync"}}
    open_view(page, url, "timeline")
    for lane, phases in want.items():
        g = page.locator(f'#timeline g.lane[data-worker="{lane}"]')
        assert g.count() == 1, lane
        n = sql(run_dir, "SELECT COUNT(*) FROM spans WHERE worker = ?", lane)[0][0]
        rects = g.locator("rect.span")
        assert n > 0 and rects.count() == n, lane
        assert phases <= set(rects.evaluate_all("els => els.map(e => e.dataset.phase)")), lane
        assert all(w >= 1 for w in rects.evaluate_all("els => els.map(e => Number(e.getAttribute('width')))"))
    step_span = page.locator('#timeline g.lane[data-worker="driver"] rect.span[data-phase="generate"]').first
    step = step_span.get_attribute("data-step")
    step_span.dispatch_event("click")  # a span links to the samples of its step (spans may overlap in a lane)
    settle(page, f"step={step}")
    assert (
        page.locator("tr.sample-row").evaluate_all("els => els.map(e => e.dataset.step)")
        == [step] * sql(run_dir, "SELECT COUNT(*) FROM samples WHERE step = ?", int(step))[0][0]
    )


@REAL_RUN
def test_rollouts_table_and_groups_match_the_samples(page, real_run):
    run_dir, url = real_run
    rows = sql(run_dir, "SELECT id, step, grp, reward, status, staleness FROM samples ORDER BY id")
    assert {r[1] for r in rows} == set(range(1, STEPS + 1))
    assert any(r[5] for r in rows)  # fully async: some samples were generated by an older policy
    open_view(page, url, "rollouts")
    shown = page.locator("tr.sample-row")
    assert shown.evaluate_all("els => els.map(e => Number(e.dataset.id))") == [r[0] for r in rows]
    shot(page, "rollouts")
    page.click('th[data-sort="staleness"]')
    settle(page, "sort=staleness&order=asc")
    page.click('th[data-sort="staleness"]')
    settle(page, "sort=staleness&order=desc")
    assert shown.evaluate_all("els => els.map(e => Number(e.dataset.staleness))") == sorted(
        (r[5] for r in rows), reverse=True
    )
    status = rows[-1][4]
    page.select_option("#f-status", status)
    settle(page, f"status={status}")
    assert shown.evaluate_all("els => els.map(e => e.dataset.status)") == [status] * sum(r[4] == status for r in rows)

    groups: dict[tuple[int, int], list[float]] = {}
    for _, step, grp, reward, *_ in rows:
        groups.setdefault((step, grp), []).append(reward)
    open_view(page, url, "rollouts?mode=groups")
    g_rows = page.locator("tr.group-row")
    assert g_rows.evaluate_all(
        "els => els.map(e => [Number(e.dataset.step), Number(e.dataset.group), e.dataset.zero === 'true'])"
    ) == [[step, grp, len(r) > 1 and max(r) == min(r)] for (step, grp), r in sorted(groups.items())]
    shot(page, "groups")
    (step, grp), members = sorted(groups.items())[-1]
    page.click(f'tr.group-row[data-step="{step}"][data-group="{grp}"]')
    settle(page, f"group={grp}")
    assert shown.count() == len(members)


@REAL_RUN
def test_sample_view_shows_every_token_of_the_sample(page, real_run):
    run_dir, url = real_run
    sid, length, trained, prompt, version, blob = sql(
        run_dir,
        "SELECT id, response_length, trained_tokens, prompt_text, version_min, tokens FROM samples"
        " WHERE staleness > 0 ORDER BY id LIMIT 1",
    )[0]
    tokens = json.loads(blob)
    ids, train_lp = unpack(tokens["ids"], "i"), unpack(tokens["train_logprob"], "f")
    assert (
        len(ids) == length and train_lp is not None and len(train_lp) == length
    )  # the trainer's log-probs reached the store
    open_view(page, url, f"sample/{sid}")
    toks = page.locator("#tokens .tok")
    assert toks.count() == length
    assert toks.evaluate_all("els => els.map(e => e.textContent)") == [
        t.replace("\n", "↵\n") or "∅" for t in tokens["text"]
    ]
    assert toks.evaluate_all("els => els.map(e => e.dataset.version)") == [str(version)] * length
    assert page.locator("#tokens .tok.masked").count() == length - trained
    assert json.loads(prompt)[-1]["content"] in page.text_content("#conversation")
    toks.nth(0).hover()
    info = page.text_content("#tokinfo")
    assert f"id {ids[0]}" in info and "train –" not in info and f"v{version}" in info
    page.select_option("#colour-by", "diff")  # a stale sample: what the policy update changed
    shot(page, "sample")
    for mode in ("diff", "advantage", "loss_mask", "version", "source", "logprob"):
        page.select_option("#colour-by", mode)
        assert page.get_attribute("#tokens", "data-mode") == mode
        assert all(toks.evaluate_all("els => els.map(e => e.style.background)")), mode
    nxt = sql(run_dir, "SELECT MIN(id) FROM samples WHERE id > ?", sid)[0][0]
    page.click("#next-sample")
    settle(page, f"#/sample/{nxt}")
    assert page.text_content("h2").startswith(f"Sample {nxt}")


@REAL_RUN
def test_engines_show_what_the_driver_polled(page, real_run):
    run_dir, url = real_run
    latest = {
        name: value
        for name, value in sql(
            run_dir,
            "SELECT name, value FROM metrics WHERE name LIKE 'engine/%' AND id IN (SELECT MAX(id) FROM metrics GROUP BY name)",
        )
    }
    engines = sorted({n.split("/")[1] for n in latest}, key=natural)
    assert engines and all(latest[f"engine/{e}/healthy"] == 1.0 for e in engines)
    open_view(page, url, "engines")
    rows = page.locator("tr.engine-row")
    assert rows.evaluate_all("els => els.map(e => [e.dataset.engine, e.dataset.healthy])") == [
        [e, "true"] for e in engines
    ]
    for i, e in enumerate(engines):
        queue_cell = rows.nth(i).locator("td").nth(2).text_content()
        assert float(queue_cell) == latest[f"engine/{e}/queue"]
    for field in ("queue", "tokens_per_s", "healthy"):
        points = page.locator(f'svg[data-chart="engine {field}"] g.series').evaluate_all(
            "els => els.map(e => Number(e.dataset.points))"
        )
        counts = sql(
            run_dir, "SELECT COUNT(*) FROM metrics WHERE name LIKE ? GROUP BY name ORDER BY name", f"engine/%/{field}"
        )
        assert points == [c[0] for c in counts], field
    shot(page, "engines")


@REAL_RUN
def test_advisories_follow_from_the_samples(page, real_run):
    run_dir, url = real_run
    expected = set()
    for _step, frac in sql(run_dir, "SELECT step, AVG(status = 'truncated') FROM samples GROUP BY step"):
        if frac > 0.2:
            expected.add("truncation")
    for _, lo, hi, n in sql(run_dir, "SELECT step, MIN(reward), MAX(reward), COUNT(*) FROM samples GROUP BY step, grp"):
        if n > 1 and math.isclose(lo, hi):
            expected.add("zero-variance")
    assert expected  # the debug recipe's tiny random model is truncated at 8 tokens and never right
    open_view(page, url, "advisories")
    kinds = page.locator(".advisory").evaluate_all("els => els.map(e => e.dataset.kind)")
    assert kinds == [a["kind"] for a in httpx.get(url + "/api/advisories").json()["advisories"]]
    timing = {"stall", "engine-idle", "trainer-idle", "straggler"}  # from wall-clock spans: a loaded machine varies
    assert expected <= set(kinds) <= expected | timing | {"length-drift", "reward-drift"}
    shot(page, "advisories")


# ---------------------------------------------------------------- what the real run does not make
def test_tool_tokens_partial_rollouts_and_an_unhealthy_engine(page, synthetic):
    run_dir, w, url = synthetic
    rows = httpx.get(url + "/api/samples", params={"step": 2, "limit": 100}).json()["rows"]
    tool = next(r for r in rows if r["trained_tokens"] < r["response_length"])  # has a tool segment
    mixed = next(r for r in rows if r["version_min"] != r["version_max"])  # partial rollout across a sync
    open_view(page, url, f"sample/{tool['id']}")
    toks = page.locator("#tokens .tok")
    assert toks.count() == dict(w["samples"][2])[tool["idx"]] == tool["response_length"]
    assert page.locator("#tokens .tok.masked").count() == tool["response_length"] - tool["trained_tokens"]
    assert set(toks.evaluate_all("els => els.map(e => e.dataset.source)")) == {"policy", "tool"}
    page.select_option("#colour-by", "loss_mask")
    assert len(set(toks.evaluate_all("els => els.map(e => e.style.background)"))) == 2

    open_view(page, url, f"sample/{mixed['id']}")
    page.select_option("#colour-by", "version")
    toks = page.locator("#tokens .tok")
    assert set(toks.evaluate_all("els => els.map(e => e.dataset.version)")) == {
        str(mixed["version_min"]),
        str(mixed["version_max"]),
    }
    assert len(set(toks.evaluate_all("els => els.map(e => e.style.background)"))) == 2

    open_view(page, url, "engines")
    # The synthetic run marks the last engine unhealthy in its last step.
    assert page.locator("tr.engine-row").evaluate_all("els => els.map(e => e.dataset.healthy)") == ["true", "false"]


def test_follow_mode_shows_new_steps_live(browser, tmp_path):
    done = threading.Event()

    def write():
        write_synthetic_run(tmp_path, steps=5, step_pause_s=0.6)
        done.set()

    h = serve_in_thread(tmp_path, follow=True, poll_s=0.3)
    page = browser.new_page()
    try:
        t = threading.Thread(target=write)
        t.start()
        open_view(page, h.url, "overview")
        first = (
            page.locator('svg[data-chart="Loss"] g.series').get_attribute("data-points")
            if page.locator('svg[data-chart="Loss"]').count()
            else "0"
        )
        page.wait_for_function(
            """() => {
            const g = document.querySelector('svg[data-chart="Loss"] g.series');
            return g && g.dataset.points === '5';
        }""",
            timeout=30000,
        )
        t.join(30)
        assert done.is_set() and int(first) < 5 and "following" in page.text_content("#status")
    finally:
        page.close()
        h.stop()


def test_empty_and_corrupt_runs_say_why(browser, tmp_path):
    page = browser.new_page()  # the 422s are expected here, so console errors are not checked
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "events.sqlite").write_bytes(b"garbage" * 100)
    for d, text in ((empty, "no events.sqlite"), (corrupt, "not a readable SQLite event store")):
        h = serve_in_thread(d, follow=False)
        try:
            for view in ("overview", "timeline", "rollouts", "sample", "engines", "advisories"):
                open_view(page, h.url, view)
                assert page.locator(".message").count() >= 1, (d.name, view)
            assert text in page.text_content("main")
        finally:
            h.stop()
    page.close()
    assert errors == []
