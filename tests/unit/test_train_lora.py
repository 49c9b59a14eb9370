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


def lora_trainer(sync: str = "merged", **algo_kw) -> Trainer:
    targets = ["q_proj", "v_proj", "down_proj"]
    cfg = TrainConfig(lr=1e-2, lora=LoraConfig(enabled=True, r=4, alpha=8, target_modules=targets, sync=sync))
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


def test_adapter_sync_sends_only_adapters_under_engine_names() -> None:
    from furlong.core.api import parse_lora_tensor_name

    tr = lora_trainer(sync="adapter")
    tr.train_step(samples(0))
    items = list(tr.state_dict_for_sync())
    assert items[0][0] == "lora::policy::config" and items[0][1].tolist() == [2.0, 6.0]  # alpha / r, 2 layers x 3
    parsed = [parse_lora_tensor_name(n) for n, _ in items[1:]]
    assert len(parsed) == 12 and all(p is not None and p[2] in ("lora_A", "lora_B") for p in parsed)
    assert {p[1] for p in parsed} == {
        f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }
    peft = dict(tr.policy.named_parameters())
    a = dict(items)["lora::policy::model.layers.1.mlp.down_proj.lora_B"]
    assert torch.equal(a, peft["base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"])


def test_reference_is_the_base_without_adapters_and_no_copy() -> None:
    """With LoRA the trainer holds no reference model: ref log-probs come from the policy with adapters off."""
    from transformers import AutoModelForCausalLM

    tr = lora_trainer(kl_coef=0.1)
    for s in range(2):
        tr.train_step(samples(s))
    assert tr.ref is None
    batch = tr.prepare(samples(5))
    base = AutoModelForCausalLM.from_pretrained(MODEL).eval()
    for s, ref in zip(batch.samples, batch.ref_logprobs):
        with torch.no_grad():
            lp = torch.log_softmax(base(input_ids=torch.tensor([s.tokens])).logits[0].float(), -1)
        n = s.response_length
        want = lp[-n - 1 : -1].gather(1, torch.tensor(s.tokens[-n:])[:, None])[:, 0]
        torch.testing.assert_close(ref[:n].float(), want, atol=1e-5, rtol=0)


def test_adapter_sync_with_sglang_or_a_quantised_engine_is_refused() -> None:
    from furlong.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.lora.sync=merged") as e:
        load_config(None, ["train.lora.enabled=true", "engine.backend=sglang"])
    assert {"train.lora.sync", "engine.backend"} <= set(e.value.fields)
    with pytest.raises(ConfigError) as e:  # on this CPU machine sglang itself is refused, but not the LoRA sync
        load_config(None, ["train.lora.enabled=true", "engine.backend=sglang", "train.lora.sync=merged"])
    assert "train.lora.sync" not in e.value.fields and "engine.backend" in e.value.fields
    with pytest.raises(ConfigError, match="engine.quantization=fp8 set train.lora.sync=merged"):
        load_config(None, ["train.lora.enabled=true", "engine.quantization=fp8"])
