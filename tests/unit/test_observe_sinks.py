"""Metric sinks: console, JSONL and TensorBoard get every step; W&B / MLflow are skipped when not installed."""

from __future__ import annotations

import importlib.util
import io
import json
import logging

import pytest

from furlong.config.schema import ObserveConfig
from furlong.observe.sinks import ConsoleSink, JsonlSink, TensorBoardSink, build_sinks
from furlong.observe.store import EventStore


def test_console_sink_prints_every_nth_step_with_key_metrics_first():
    out = io.StringIO()
    sink = ConsoleSink(every=2, stream=out, max_keys=2)
    sink.log(1, {"a": 1.0})
    sink.log(2, {"zz": 3.0, "loss/total": 0.12345, "b": 2.0})
    assert out.getvalue() == "step 2 | loss/total=0.1235 b=2 (+1)\n"


def test_jsonl_sink_appends_one_object_per_call(tmp_path):
    sink = JsonlSink(tmp_path / "m" / "metrics.jsonl")
    sink.log(1, {"a": 1.0})
    sink.log(2, {"a": 0.5, "b": 2.0})
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["a"]) for x in lines] == [(1, 1.0), (2, 0.5)] and lines[1]["b"] == 2.0


def test_tensorboard_sink_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    for step in range(3):
        sink.log(step, {"loss/total": 1.0 / (step + 1)})
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("loss/total")] == [(0, 1.0), (1, 0.5), (2, 0.3333)]


def test_build_sinks_follows_the_observe_config(tmp_path, caplog):
    sinks = build_sinks(ObserveConfig(), tmp_path)
    assert [type(s).__name__ for s in sinks] == ["ConsoleSink", "JsonlSink", "TensorBoardSink"]
    for s in sinks:
        s.close()
    assert build_sinks(ObserveConfig(jsonl=False, tensorboard=False), tmp_path, console=False) == []
    missing = [f for f in ("wandb", "mlflow") if importlib.util.find_spec(f) is None]
    if not missing:
        pytest.skip("wandb and mlflow are both installed here")
    cfg = ObserveConfig(log_every=1, jsonl=False, tensorboard=False, wandb=True, mlflow=True, project="p")
    with caplog.at_level(logging.WARNING, "furlong.observe"):
        sinks = build_sinks(cfg, tmp_path, console=False)
    assert all(type(s).__name__.lower()[:5] not in {m[:5] for m in missing} for s in sinks)
    assert all(f"observe.{m}=true but {m} is not installed" in caplog.text for m in missing)


def test_store_metrics_reach_the_sinks(tmp_path):
    with EventStore(tmp_path, sinks=[JsonlSink(tmp_path / "metrics.jsonl")]) as store:
        store.metrics(4, {"reward": 0.5})
        store.metric(5, "reward", 0.75)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["reward"]) for x in lines] == [(4, 0.5), (5, 0.75)]
