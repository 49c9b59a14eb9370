"""LoRA: only adapters train; the merged weights the engines receive equal base + adapter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_trainer import MODEL, algo, samples  # noqa: E402

from furlong.config.schema import LoraConfig, TrainConfig  # noqa: E402
from furlong.train.trainer import Trainer  # noqa: E402


def lora_trainer(**algo_kw) -> Trainer:
    cfg = TrainConfig(
        lr=1e-2, lora=LoraConfig(enabled=True, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    return Trainer(MODEL, cfg, algo(**algo_kw))


def test_only_adapters_change() -> None:
    tr = lora_trainer(kl_coef=0.1)
    before = {k: v.clone() for k, v in tr.policy.state_dict().items()}
    trainable = {n for n, p in tr.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    for s in range(3):
        m = tr.train_step(samples(s))
    after = tr.policy.state_dict()
    base = [k for k in before if ".lora_" not in k]
    assert base and all(torch.equal(before[k], after[k]) for k in base)
    assert all(not torch.equal(before[k], after[k]) for k in before if ".lora_B." in k)
    assert m["policy/kl_ref"] > 0  # the reference is the base with adapters switched off


def test_merged_sync_weights_equal_adapter_forward() -> None:
    from transformers import AutoModelForCausalLM

    tr = lora_trainer()
    for s in range(2):
        tr.train_step(samples(s))
    merged = dict(tr.state_dict_for_sync())
    plain = AutoModelForCausalLM.from_pretrained(MODEL)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    ids = torch.tensor([[5, 17, 33, 2, 90, 41]])
    tr.policy.eval()
    with torch.no_grad():
        want = tr.policy(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got, AutoModelForCausalLM.from_pretrained(MODEL)(input_ids=ids).logits, atol=1e-4)


def test_lora_with_ref_refresh_is_rejected() -> None:
    cfg = TrainConfig(ref_update_every=2, lora=LoraConfig(enabled=True))
    with pytest.raises(ValueError, match="ref_update_every"):
        Trainer(MODEL, cfg, algo(kl_coef=0.1))
