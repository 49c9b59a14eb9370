"""DataSource: seeded epochs, batches across epoch ends, push-back, and checkpoint round trips."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from furlong.data import TASKS, DataSource, Prompt, PromptSource


def prompts(n: int) -> list[Prompt]:
    return [Prompt(i, f"p{i}", i) for i in range(n)]


def indices(batch: list[Prompt]) -> list[int]:
    return [p.index for p in batch]


def test_each_epoch_visits_every_prompt_once_in_a_seeded_order():
    src = DataSource(prompts(10), seed=1)
    e0, e1 = indices(src.next_batch(10)), indices(src.next_batch(10))
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0 != e1 and e0 != list(range(10))  # reshuffled each epoch
    assert src.epoch == 2 and src.position == 0 and src.consumed == 20
    again = DataSource(prompts(10), seed=1)
    assert indices(again.next_batch(20)) == e0 + e1
    assert indices(DataSource(prompts(10), seed=2).next_batch(10)) != e0
    assert indices(DataSource(prompts(10), shuffle=False).next_batch(12)) == list(range(10)) + [0, 1]


def test_batches_cross_epoch_boundaries_without_changing_the_stream():
    whole = indices(DataSource(prompts(7), seed=5).next_batch(30))
    src = DataSource(prompts(7), seed=5)
    pieces = []
    for n in (3, 5, 1, 0, 7, 14):
        pieces += indices(src.next_batch(n))
    assert pieces == whole
    assert Counter(whole[:28]) == Counter({i: 4 for i in range(7)})


def test_num_epochs_ends_the_stream():
    src = DataSource(prompts(4), seed=0, num_epochs=2)
    assert len(src.next_batch(6)) == 6 and not src.exhausted
    assert len(src.next_batch(6)) == 2 and src.exhausted
    assert src.next_batch(3) == []
    src.push_back([Prompt(1, "p1", 1)])
    assert not src.exhausted and indices(src.next_batch(3)) == [1]


def test_push_back_comes_out_first_in_order():
    reference = DataSource(prompts(10), seed=3)
    expected = indices(reference.next_batch(10))
    src = DataSource(prompts(10), seed=3)
    batch = src.next_batch(4)
    src.push_back([batch[2], batch[0]])
    assert indices(src.next_batch(3)) == [batch[2].index, batch[0].index, expected[4]]
    assert indices(src.next_batch(5)) == expected[5:10]
    assert src.returned == 2 and src.consumed == 12


def test_push_back_refuses_foreign_prompts():
    src = DataSource(prompts(3))
    with pytest.raises(ValueError, match="index 3 did not come from this source"):
        src.push_back([Prompt(3, "p3")])
    with pytest.raises(ValueError, match="index 1 did not come from this source"):
        src.push_back([Prompt(1, "something else")])


def test_state_round_trip_through_json_matches_uninterrupted():
    ds = TASKS["sort"].make("train", 13, seed=0)
    uninterrupted = DataSource(ds, seed=9)
    first = uninterrupted.next_batch(17)
    uninterrupted.push_back(first[-3:])
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    assert state["epoch"] == 1 and state["position"] == 4 and state["pending"] == indices(first[-3:])
    assert state["consumed"] == 17 and state["returned"] == 3

    resumed = DataSource(ds, seed=9)
    resumed.load_state_dict(state)
    assert resumed.next_batch(40) == uninterrupted.next_batch(40)
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_load_refuses_a_state_from_another_source():
    state = DataSource(prompts(5), seed=1).state_dict()
    with pytest.raises(ValueError, match="state has seed=1, this source has 2"):
        DataSource(prompts(5), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="state has dataset_size=5, this source has 6"):
        DataSource(prompts(6), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="state has shuffle=True, this source has False"):
        DataSource(prompts(5), seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="pending index 9 out of range"):
        DataSource(prompts(5), seed=1).load_state_dict(dict(state, pending=[9]))


def test_construction_errors_and_protocol():
    with pytest.raises(ValueError, match="empty"):
        DataSource([])
    with pytest.raises(ValueError, match="position 1 has index 5"):
        DataSource([Prompt(0, "a"), Prompt(5, "b")])
    with pytest.raises(ValueError, match="num_epochs"):
        DataSource(prompts(2), num_epochs=0)
    assert isinstance(DataSource(prompts(2)), PromptSource)
