"""Every dashboard view in headless chromium, checked against the data of the run it shows.

The run directory is written by the synthetic writer through the real EventStore API
(the calls `furlong train` makes), with the tiny model's real tokenizer. Screenshots go
to docs/img/dashboard-<view>.png.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest

from furlong.dashboard.server import serve_in_thread
from furlong.observe.synthetic import write_synthetic_run

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make setup installs it: scripts/install-chromium.sh)"),
]
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]
IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
STEPS, GROUPS, GROUP_SIZE, RANKS, ENGINES = 6, 3, 4, 2, 2


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("run")
    w = write_synthetic_run(d, steps=STEPS, groups=GROUPS, group_size=GROUP_SIZE, trainer_ranks=RANKS, engines=ENGINES, tokenizer=tokenizer)
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


def open_view(page, url: str, route: str) -> None:
    page.goto(f"{url}/#/{route}")
    settle(page)


def settle(page, contains: str = "") -> None:
    """Wait until the page has rendered the route in the address bar (and that route contains `contains`)."""
    page.wait_for_function(
        "c => document.body.dataset.route === location.hash && location.hash.includes(c)", arg=contains, timeout=20000
    )


def shot(page, view: str) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMG / f"dashboard-{view}.png"))


def test_overview_plots_every_step(page, run):
    run_dir, w, url = run
    open_view(page, url, "overview")
    for chart in ("Reward", "Accuracy", "Loss", "KL", "Entropy", "Throughput", "Staleness"):
        series = page.locator(f'svg[data-chart="{chart}"] g.series')
        assert series.count() >= 1, chart
        for i in range(series.count()):
            assert series.nth(i).get_attribute("data-points") == str(len(w["steps"])), chart
    steps = page.locator('svg[data-chart="Loss"] circle.pt').evaluate_all("els => els.map(e => Number(e.dataset.step))")
    assert steps == w["steps"]
    assert f"{STEPS} steps" in page.text_content("#status") and "offline" in page.text_content("#status")
    shot(page, "overview")


def test_timeline_has_one_lane_per_worker_and_zooms(page, run):
    run_dir, w, url = run
    open_view(page, url, "timeline")
    lanes = page.locator("#timeline g.lane")
    assert lanes.evaluate_all("els => els.map(e => e.dataset.worker)") == sorted(w["workers"])
    assert page.locator("#timeline rect.span").count() == w["spans"]
    assert page.locator("#timeline .step-label").count() == STEPS
    shot(page, "timeline")
    page.click("#tl-zoom-in")
    page.click("#tl-zoom-in")
    assert 0 < page.locator("#timeline rect.span").count() < w["spans"]  # spans outside the zoomed window are not drawn
    page.click("#tl-reset")
    assert page.locator("#timeline rect.span").count() == w["spans"]
    page.select_option("#tl-step", "3")
    settle(page, "#/timeline?step=3")
    assert set(page.locator("#timeline rect.span").evaluate_all("els => els.map(e => e.dataset.step)")) == {"3"}


def test_rollouts_table_sorts_filters_and_groups(page, run):
    run_dir, w, url = run
    total = sum(len(v) for v in w["samples"].values())
    open_view(page, url, "rollouts")
    assert page.locator("tr.sample-row").count() == total
    shot(page, "rollouts")
    page.click('th[data-sort="reward"]')
    settle(page, "sort=reward&order=asc")
    page.click('th[data-sort="reward"]')
    settle(page, "sort=reward&order=desc")
    rewards = page.locator("tr.sample-row").evaluate_all("els => els.map(e => Number(e.dataset.reward))")
    assert rewards == sorted(rewards, reverse=True) and len(rewards) == total
    page.select_option("#f-status", "truncated")
    settle(page, "status=truncated")
    api = httpx.get(url + "/api/samples", params={"status": "truncated"}).json()
    statuses = page.locator("tr.sample-row").evaluate_all("els => els.map(e => e.dataset.status)")
    assert statuses == ["truncated"] * api["total"] and api["total"] > 0

    open_view(page, url, "rollouts?mode=groups")
    rows = page.locator("tr.group-row")
    assert rows.count() == STEPS * GROUPS
    api_groups = httpx.get(url + "/api/groups").json()["groups"]
    assert rows.evaluate_all("els => els.map(e => e.dataset.zero === 'true')") == [g["zero_variance"] for g in api_groups]
    shot(page, "groups")
    page.click('tr.group-row[data-step="2"][data-group="1"]')
    settle(page, "group=1")
    assert page.locator("tr.sample-row").count() == GROUP_SIZE


def test_sample_token_view_shows_every_token_and_its_provenance(page, run):
    run_dir, w, url = run
    rows = httpx.get(url + "/api/samples", params={"step": 2, "limit": 100}).json()["rows"]
    tool = next(r for r in rows if r["trained_tokens"] < r["response_length"])  # has a tool segment
    mixed = next(r for r in rows if r["version_min"] != r["version_max"])  # partial rollout across a sync
    length = dict(w["samples"][2])[tool["idx"]]
    open_view(page, url, f"sample/{tool['id']}")
    toks = page.locator("#tokens .tok")
    assert toks.count() == length == tool["response_length"]
    assert page.locator("#tokens .tok.masked").count() == length - tool["trained_tokens"]
    assert set(toks.evaluate_all("els => els.map(e => e.dataset.source)")) == {"policy", "tool"}
    assert "What is" in page.text_content("#conversation")
    shot(page, "sample")

    def backgrounds():
        return toks.evaluate_all("els => els.map(e => e.style.background)")

    page.select_option("#colour-by", "loss_mask")
    assert len(set(backgrounds())) == 2
    for mode in ("diff", "advantage", "source", "logprob"):
        page.select_option("#colour-by", mode)
        assert page.get_attribute("#tokens", "data-mode") == mode
        assert all(b for b in backgrounds())
    toks.nth(0).hover()
    assert "logprob" in page.text_content("#tokinfo") and "v1" in page.text_content("#tokinfo")

    open_view(page, url, f"sample/{mixed['id']}")
    page.select_option("#colour-by", "version")
    versions = page.locator("#tokens .tok").evaluate_all("els => els.map(e => e.dataset.version)")
    assert set(versions) == {str(mixed["version_min"]), str(mixed["version_max"])}
    assert len(set(backgrounds())) >= 2
    page.click("#next-sample")
    settle(page, f"#/sample/{mixed['id'] + 1}")
    assert page.text_content("h2").startswith(f"Sample {mixed['id'] + 1}")


def test_engines_show_health_queue_and_throughput(page, run):
    run_dir, w, url = run
    open_view(page, url, "engines")
    rows = page.locator("tr.engine-row")
    assert rows.count() == ENGINES
    # The synthetic run marks the last engine unhealthy in the last step.
    assert rows.evaluate_all("els => els.map(e => e.dataset.healthy)") == ["true"] * (ENGINES - 1) + ["false"]
    assert page.locator('svg[data-chart="engine tokens_per_s"] g.series').count() == ENGINES
    shot(page, "engines")


def test_advisories_match_the_api(page, run):
    run_dir, w, url = run
    open_view(page, url, "advisories")
    api = httpx.get(url + "/api/advisories").json()["advisories"]
    kinds = page.locator(".advisory").evaluate_all("els => els.map(e => e.dataset.kind)")
    assert kinds == [a["kind"] for a in api] and "zero-variance" in kinds
    shot(page, "advisories")


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
        first = page.locator('svg[data-chart="Loss"] g.series').get_attribute("data-points") if page.locator('svg[data-chart="Loss"]').count() else "0"
        page.wait_for_function("""() => {
            const g = document.querySelector('svg[data-chart="Loss"] g.series');
            return g && g.dataset.points === '5';
        }""", timeout=30000)
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
