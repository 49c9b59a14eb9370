"""Micro-batch layout and planning: padded blocks reproduce unpacked (and packed-row) forwards, budgets hold."""

from __future__ import annotations

import pytest
import torch

from furlong.core.sample import Sample, SampleError
from furlong.train.batch import TrainBatch, micro_batches, pack, partition


def _sample(i: int, prompt: list[int], resp: list[int], mask: list[int] | None = None) -> Sample:
    s = Sample(index=i, group_index=0, tokens=list(prompt), reward=1.0)
    s.append(resp, logprobs=[-1.0] * len(resp))
    if mask is not None:
        s.loss_mask = mask
    return s


def _packed_row_logprobs(model, samples: list[Sample]) -> list[torch.Tensor]:
    """The earlier layout, for reference: one row, restarting position ids (a block-diagonal mask)."""
    ids = [t for s in samples for t in s.tokens]
    pos = [p for s in samples for p in range(len(s.tokens))]
    logits = model(torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False).logits[0]
    logp = torch.log_softmax(logits, -1)
    out, offset = [], 0
    for s in samples:
        want = logp[offset + s.prompt_length - 1 : offset + len(s.tokens) - 1]
        out.append(want.gather(-1, torch.tensor(s.response_tokens)[:, None]).squeeze(-1))
        offset += len(s.tokens)
    return out


def test_pack_matches_separate_and_packed_forwards() -> None:
    """The padded block (no attention mask) gives each sample's unpadded log-probs, and the packed row's."""
    from transformers import AutoModelForCausalLM

    from furlong.models import create_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(create_model("qwen3", "tiny"))
    samples = [_sample(0, [5, 6, 7], [8, 9]), _sample(1, [3], [4, 5, 6, 7]), _sample(2, [9, 9], [1])]
    p = pack(samples)
    assert p.input_ids.shape == (3, 5) and p.shape == (3, 4) and p.keep == 5  # sample 1 predicts from position 0
    assert p.input_ids[2].tolist() == [9, 9, 1, 0, 0]  # right-padded
    assert p.flat_index.tolist() == [2, 3, 5, 6, 7, 8, 11]  # into the flattened [B*L] block
    logits = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, logits_to_keep=p.keep).logits
    lp = p.scatter(torch.log_softmax(p.kept(logits), -1).gather(-1, p.targets[:, None]).squeeze(-1))
    for i, (s, packed) in enumerate(zip(samples, _packed_row_logprobs(model, samples))):
        alone = torch.log_softmax(model(torch.tensor([s.tokens])).logits[0], -1)
        want = alone[s.prompt_length - 1 : -1].gather(-1, torch.tensor(s.response_tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(lp[i, : s.response_length], want, atol=1e-5, rtol=0)
        torch.testing.assert_close(lp[i, : s.response_length], packed, atol=1e-5, rtol=0)
        assert (lp[i, s.response_length :] == 0).all()


def test_batch_pads_and_selects() -> None:
    b = TrainBatch.from_samples([_sample(0, [1, 2], [3, 4, 5], [1, 0, 1]), _sample(1, [1], [2])])
    assert b.mask.tolist() == [[1, 0, 1], [1, 0, 0]]
    sub = b.select([1])
    assert sub.mask.shape == (1, 1) and sub.samples[0].index == 1 and sub.rewards.tolist() == [1.0]


def test_batch_rejects_empty_prompt_and_mixed_teacher() -> None:
    with pytest.raises(SampleError, match="empty prompt"):
        TrainBatch.from_samples([_sample(3, [], [1, 2])])
    a, b = _sample(0, [1], [2]), _sample(1, [1], [2])
    a.teacher_logprobs = [-0.5]
    with pytest.raises(SampleError, match="teacher_logprobs"):
        TrainBatch.from_samples([a, b])


def test_micro_batches_respect_padded_budget_and_cover_everything() -> None:
    lengths = [7, 3, 9, 2, 5, 5, 8, 1]
    for budget in (9, 12, 20, 100):
        mbs = micro_batches(lengths, budget)
        assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
        assert all(len(mb) * max(lengths[i] for i in mb) <= budget for mb in mbs)  # rows x longest
    assert micro_batches(lengths, 100) == [list(range(8))]
    assert micro_batches(lengths, 20) == [[2, 6], [0, 4], [1, 3, 5, 7]]  # longest first: 9+8 | 7+5 | 5+3+2+1
    assert micro_batches([50, 2], 10) == [[0], [1]]  # an over-long sample gets its own micro-batch
    # `count`: the costliest micro-batch is halved until there are enough, then empty (dummy) ones are added
    assert micro_batches(lengths, 100, count=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert micro_batches([4, 4], 100, count=3) == [[0], [1], []]
    assert partition([4, 4, 4], 2) == [[0, 2], [1]]
