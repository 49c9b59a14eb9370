"""docs/reliability.md's chaos figures are those of the recorded run (docs/data/chaos-run.json), never typed by hand."""

from __future__ import annotations

import json

import pytest

from tools import reliability


def test_the_page_shows_the_recorded_chaos_run():
    assert reliability.main([]) == 0


def test_a_figure_edited_on_the_page_fails_the_check():
    record = json.loads(reliability.RECORD.read_text())
    page = reliability.PAGE.read_text()
    body = reliability.render(record)
    assert "samples lost: 0" in body  # the engine runs lost nothing, by the rollout manager's accounting
    assert reliability.splice(page, body) == page
    tampered = json.loads(json.dumps(record))
    tampered["runs"]["engines"]["supervisor"]["replacements"] += 1
    assert reliability.splice(page, reliability.render(tampered)) != page


def test_recorded_runs_each_name_their_test_and_a_missing_marker_is_an_error():
    record = json.loads(reliability.RECORD.read_text())
    assert set(record["runs"]) <= set(reliability.RUNS)
    with pytest.raises(SystemExit, match="markers"):
        reliability.splice("no markers here", "x")
