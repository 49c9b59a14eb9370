"""SFT NLL against torch cross-entropy; distillation shaping and reverse-KL gradient by hand."""

import pytest
import torch
import torch.nn.functional as F

from furlong.train.losses import sft_loss
from furlong.train.losses.distill import distill_advantages, reverse_kl_loss


def test_sft_token_mean_equals_cross_entropy_with_ignore_index():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 1]], dtype=torch.float64)
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    loss, m = sft_loss(logprobs, mask)
    ce = F.cross_entropy(logits.reshape(-1, 11), targets.masked_fill(mask == 0, -100).reshape(-1), ignore_index=-100)
    assert loss.item() == pytest.approx(ce.item(), abs=1e-12)
    assert m["loss/sft"] == pytest.approx(ce.item())
    assert m["sft/num_tokens"] == 10


def test_sft_sample_mean_and_errors():
    lp = torch.tensor([[-1.0, -3.0, -7.0], [-2.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    loss, m = sft_loss(lp, mask, "sample_mean")
    assert loss.item() == pytest.approx(((1 + 3) / 2 + 2) / 2)
    assert m["sft/nll_token_mean"] == pytest.approx((1 + 3 + 2) / 3)
    with pytest.raises(ValueError, match="loss_reducer"):
        sft_loss(lp, mask, "median")


def test_distill_advantages():
    teacher = torch.tensor([[-0.5, -2.0, -1.0]])
    student = torch.tensor([[-1.0, -1.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = distill_advantages(teacher, student, mask, coef=2.0)
    assert adv.tolist() == [[1.0, -2.0, 0.0]]
    assert not adv.requires_grad


def test_reverse_kl_gradient_is_k1_times_score():
    lp = torch.tensor([[-0.2, -1.5, -3.0]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-0.7, -1.0, -3.0]], dtype=torch.float64)
    loss = reverse_kl_loss(lp, teacher)
    assert loss.tolist()[0] == pytest.approx([0.5 * 0.25, 0.5 * 0.25, 0.0])
    loss.sum().backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.5, -0.5, 0.0])
