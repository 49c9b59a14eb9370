import math

import pytest

from furlong.core.sample import Sample, SampleError, Source, Status


def make() -> Sample:
    s = Sample(index=3, group_index=1, prompt="2+2=", tokens=[5, 6, 7])
    s.append([8, 9], logprobs=[-0.5, -1.0], version=2)
    s.append([10], source=Source.TOOL)
    s.append([11], logprobs=[-0.1], version=3)
    return s


def test_append_keeps_per_token_fields_aligned():
    s = make().validate()
    assert s.prompt_length == 3 and s.response_length == 4
    assert s.response_tokens == [8, 9, 10, 11]
    assert s.loss_mask == [1, 1, 0, 1]
    assert s.token_sources == ["policy", "policy", "tool", "policy"]
    assert s.token_versions == [2, 2, -1, 3]
    assert s.oldest_version() == 2  # tool tokens do not count for staleness


def test_json_round_trip_is_exact():
    s = make()
    s.reward = {"score": 1.0, "format": 0.5}
    s.status = Status.COMPLETED
    s.teacher_logprobs = [-1.0, -2.0, 0.0, -0.25]
    back = Sample.from_json(s.to_json())
    assert back == s and back.status is Status.COMPLETED
    assert back.scalar_reward == 1.0


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda s: s.loss_mask.pop(), "loss_mask"),
        (lambda s: s.rollout_logprobs.append(-1.0), "rollout_logprobs"),
        (lambda s: s.token_versions.pop(), "token_versions"),
        (lambda s: s.token_sources.__setitem__(0, "robot"), "token_sources"),
        (lambda s: setattr(s, "response_length", 99), "response_length"),
        (lambda s: s.rollout_logprobs.__setitem__(0, math.nan), "rollout_logprobs"),
        (lambda s: s.rollout_logprobs.__setitem__(0, 0.7), "rollout_logprobs"),
        (lambda s: setattr(s, "teacher_logprobs", [-1.0]), "teacher_logprobs"),
        (lambda s: s.loss_mask.__setitem__(0, 2), "loss_mask"),
    ],
)
def test_validate_names_the_broken_field(mutate, field):
    s = make()
    mutate(s)
    with pytest.raises(SampleError, match=field):
        s.validate()


def test_unknown_field_and_missing_reward_are_reported():
    with pytest.raises(SampleError, match="bogus"):
        Sample.from_dict({"index": 0, "bogus": 1})
    with pytest.raises(SampleError, match="reward is not set"):
        _ = make().scalar_reward
    s = make()
    s.reward = {"format": 1.0}
    with pytest.raises(SampleError, match="score"):
        _ = s.scalar_reward
