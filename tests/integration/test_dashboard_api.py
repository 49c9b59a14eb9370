"""Every dashboard endpoint, over real HTTP, on a finished, an empty, a corrupt and a still-being-written run.

The rule checked everywhere: never a 5xx — a clear 4xx with a `detail`, or an empty payload with a `message`.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from furlong.dashboard.server import serve_in_thread
from furlong.observe.store import DB_NAME
from tests.fixtures.synthetic_run import write_synthetic_run

ENDPOINTS = ["api/summary", "api/metrics", "api/timeline", "api/samples", "api/groups", "api/engines", "api/advisories"]


@pytest.fixture
def serve():
    handles = []

    def start(run_dir, **kw):
        h = serve_in_thread(run_dir, **kw)
        handles.append(h)
        return httpx.Client(base_url=h.url, timeout=30)

    yield start
    for h in handles:
        h.stop()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    return d, write_synthetic_run(d, steps=5, groups=3, group_size=4, trainer_ranks=2, engines=2)


def get(client, path, **params):
    r = client.get(path, params=params)
    assert r.status_code < 500, f"{path}: {r.status_code} {r.text}"
    return r


def test_finished_run_every_endpoint(serve, run):
    run_dir, w = run
    c = serve(run_dir, follow=False)
    s = get(c, "api/summary").json()
    assert s["steps"] == w["steps"] and s["workers"] == sorted(w["workers"]) and not s["follow"]
    assert s["counts"]["samples"] == sum(map(len, w["samples"].values())) and s["counts"]["spans"] == w["spans"]

    m = get(c, "api/metrics").json()
    assert [p[0] for p in m["series"]["loss/total"]] == w["steps"]
    assert [p[0] for p in m["series"]["samples/reward_mean"]] == w["steps"]
    assert get(c, "api/metrics", names="loss/total,nope").json()["names"] == ["loss/total"]

    tl = get(c, "api/timeline").json()
    assert [lane["worker"] for lane in tl["lanes"]] == ["driver", "engine/0", "engine/1", "trainer/0", "trainer/1"]
    assert (
        sum(len(lane["spans"]) for lane in tl["lanes"]) == w["spans"] and [x["step"] for x in tl["steps"]] == w["steps"]
    )
    one = get(c, "api/timeline", step_from=2, step_to=2).json()
    assert {sp["step"] for lane in one["lanes"] for sp in lane["spans"]} == {2}
    cut = get(c, "api/timeline", limit=5).json()
    assert cut["truncated"] and sum(len(lane["spans"]) for lane in cut["lanes"]) == 5 and "newest 5" in cut["message"]

    rows = get(c, "api/samples", limit=1000).json()
    assert rows["total"] == len(rows["rows"]) == 60 and "truncated" in rows["statuses"]
    by_reward = get(c, "api/samples", sort="reward", order="desc", limit=1000).json()["rows"]
    assert [r["reward"] for r in by_reward] == sorted((r["reward"] for r in rows["rows"]), reverse=True)
    trunc = get(c, "api/samples", status="truncated").json()
    assert trunc["total"] == sum(r["status"] == "truncated" for r in rows["rows"]) > 0
    page = get(c, "api/samples", step=2, group=1, limit=2, offset=2).json()
    assert page["total"] == 4 and [r["idx"] for r in page["rows"]] == [6, 7]
    assert get(c, "api/samples", q="think").json()["total"] == sum("think" in r["response"] for r in rows["rows"]) > 0

    first = rows["rows"][0]
    sample = get(c, f"api/samples/{first['id']}").json()
    assert len(sample["tokens"]["ids"]) == sample["response_length"] == w["samples"][1][0][1]
    assert sample["prev_id"] is None and sample["next_id"] == first["id"] + 1

    groups = get(c, "api/groups", step=2).json()["groups"]
    assert [g["group"] for g in groups] == [0, 1, 2] and all(g["n"] == 4 for g in groups)
    assert next(g for g in groups if g["group"] == 1)["zero_variance"]  # the synthetic run's even steps

    eng = get(c, "api/engines").json()["engines"]
    assert [e["id"] for e in eng] == ["0", "1"] and [e["healthy"] for e in eng] == [True, False]
    assert [p[0] for p in eng[0]["series"]["queue"]] == w["steps"]

    adv = get(c, "api/advisories").json()["advisories"]
    assert "zero-variance" in {a["kind"] for a in adv}

    assert "furlong" in get(c, "").text and get(c, "static/app.js").status_code == 200


def test_bad_parameters_are_4xx_with_a_reason(serve, run):
    c = serve(run[0])
    r = get(c, "api/samples", sort="prompt_text; DROP TABLE samples")
    assert r.status_code == 400 and "is not one of" in r.json()["detail"]
    assert get(c, "api/samples", order="sideways").status_code == 400
    assert get(c, "api/samples", limit=0).status_code == 422
    assert get(c, "api/samples/999999").status_code == 404
    assert get(c, "api/samples/abc").status_code == 422
    assert get(c, "api/timeline", step_from="x").status_code == 422
    assert get(c, "static/nope.js").status_code == 404


def test_empty_run_directory(serve, tmp_path):
    c = serve(tmp_path)
    for path in ENDPOINTS:
        r = get(c, path)
        assert r.status_code == 200, path
    assert "no events.sqlite" in get(c, "api/summary").json()["message"]
    assert get(c, "api/samples").json() == {
        "total": 0,
        "rows": [],
        "statuses": [],
        "message": get(c, "api/samples").json()["message"],
    }
    assert get(c, "api/timeline").json()["lanes"] == []
    assert get(c, "api/samples/1").status_code == 404
    (tmp_path / DB_NAME).touch()  # created by a writer that has not made its tables yet
    for path in ENDPOINTS:
        assert get(c, path).status_code == 200, path
    assert "no spans table yet" in get(c, "api/summary").json()["message"]


def test_corrupt_store(serve, tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"this is not a database\n" * 200)
    c = serve(tmp_path)
    for path in [*ENDPOINTS, "api/samples/1"]:
        r = get(c, path)
        assert r.status_code == 422, path
        assert "not a readable SQLite event store" in r.json()["detail"]


def test_corrupt_token_blob_names_the_sample(serve, run, tmp_path):
    import sqlite3

    shutil.copy(run[0] / DB_NAME, tmp_path / DB_NAME)
    with sqlite3.connect(tmp_path / DB_NAME) as conn:
        conn.execute("UPDATE samples SET tokens = '{broken' WHERE id = 2")
    c = serve(tmp_path)
    r = get(c, "api/samples/2")
    assert r.status_code == 422 and "sample 2" in r.json()["detail"]
    assert get(c, "api/samples/3").status_code == 200


def test_deleted_run_directory(serve, tmp_path):
    run_dir = tmp_path / "gone"
    run_dir.mkdir()
    c = serve(run_dir)
    run_dir.rmdir()
    for path in ENDPOINTS:
        r = get(c, path)
        assert r.status_code == 404 and "does not exist" in r.json()["detail"]


def _live_writer(run_dir: str) -> None:
    write_synthetic_run(run_dir, steps=12, step_pause_s=0.15)


def test_run_being_written(serve, tmp_path):
    """A writer process adds steps while every endpoint is polled: answers stay 200 and only grow."""
    c = serve(tmp_path, follow=True)
    proc = mp.get_context("spawn").Process(target=_live_writer, args=(str(tmp_path),))
    proc.start()
    seen_steps, samples = [], []
    try:
        while True:
            alive = proc.is_alive()  # one more round after the writer exits: the final state
            for path in ENDPOINTS:
                assert get(c, path).status_code == 200, path
            s = get(c, "api/summary").json()
            assert s["follow"]
            seen_steps.append(len(s["steps"]))
            samples.append(get(c, "api/samples", limit=5000).json()["total"])
            if not alive:
                break
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert seen_steps == sorted(seen_steps) and samples == sorted(samples)
    assert seen_steps[-1] == 12 and len(set(seen_steps)) > 2  # watched it grow, not only the end


def test_cli_serves_and_rejects_a_missing_directory(tmp_path, run):
    bad = subprocess.run(
        [sys.executable, "-m", "furlong.cli", "dashboard", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "furlong.cli", "dashboard", str(run[0]), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "furlong dashboard:" in line and "http://127.0.0.1:" in line, line + proc.stderr.read()
        url = line.split(" at ")[1].split()[0]
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(url + "api/summary", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.status_code == 200 and r.json()["steps"] == run[1]["steps"]
    finally:
        proc.terminate()
        proc.wait(30)
