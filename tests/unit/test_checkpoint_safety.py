"""Checkpoints unpickle nothing: plain-data rank files, allowlisted DCP metadata, fsync before the marker.

A checkpoint is a directory a user may have been handed; each test plants a pickle
that would run code (it would create a marker file) and checks that loading refuses
it with an error naming the file, and that the code never ran.
"""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn

from furlong.train import checkpoint
from furlong.train.checkpoint import UnsafeCheckpoint


class Payload:
    """Unpickling this runs `open(path, "w")`: what a hostile checkpoint would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def parts() -> checkpoint.Stateful:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {"policy": (model, optim)}


def save(path, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    return checkpoint.save(path, parts(), {"step": 3}, {"step": 3}, str(model_dir))


def test_rng_state_is_plain_data_and_round_trips_bit_for_bit(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # a cached Gaussian in numpy's state too
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    want = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    checkpoint.set_rng_state(checkpoint.load_plain(tmp_path / "rng.pt"))
    got = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert want[:2] == got[:2] and torch.equal(want[2], got[2])


def test_save_load_round_trip_through_the_safe_loaders(tmp_path):
    path = save(tmp_path / "step_3", tmp_path)
    fresh = parts()
    fresh["policy"][0].weight.data.zero_()
    extra = checkpoint.load(path, fresh)
    assert extra["step"] == 3
    assert torch.equal(fresh["policy"][0].weight, parts()["policy"][0].weight)


def test_a_rank_file_holding_objects_is_refused_naming_it_and_runs_nothing(tmp_path):
    path = save(tmp_path / "step_3", tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"step": 3, "rng": Payload(marker)}, path / "rank_0.pt")
    with pytest.raises(UnsafeCheckpoint, match=f"{path / 'rank_0.pt'}: refusing to load"):
        checkpoint.load(path, parts())
    assert not marker.exists()


def test_dcp_metadata_naming_anything_but_dcp_classes_is_refused_and_runs_nothing(tmp_path):
    path = save(tmp_path / "step_3", tmp_path)
    marker = tmp_path / "pwned"
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata: refusing to load: it names (io|builtins)\.open"):
        checkpoint.load(path, parts())
    assert not marker.exists()


def test_export_refuses_a_hostile_checkpoint_with_a_clear_error(tmp_path, capsys):
    from furlong.models import create_model
    from furlong.train import export

    model_dir = create_model("qwen3", "tiny")
    path = tmp_path / "run" / "checkpoints" / "step_1"
    checkpoint.save(path, parts(), {"step": 1}, {"step": 1, "dtype": "float32", "lora": None}, str(model_dir))
    marker = tmp_path / "pwned"
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    assert export.main([str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "furlong export:" in err and str(path / "dcp" / ".metadata") in err and "refusing to load" in err
    assert not marker.exists()


def test_every_file_and_directory_is_fsynced_before_the_marker(tmp_path, monkeypatch):
    synced: list[tuple[str, bool]] = []  # (path, meta.json there yet)
    real = os.fsync
    path = tmp_path / "step_3"

    def record(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), (path / checkpoint.META).exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    save(path, tmp_path)
    before = {p for p, marked in synced if not marked}
    files = {str(p) for p in path.rglob("*") if p.name != checkpoint.META}
    assert files <= before, f"not fsynced before meta.json: {sorted(files - before)}"
    assert str(path) in {p for p, marked in synced if marked}  # the directory again, with the marker's entry
