"""Multi-LoRA training (train/multi_lora.py): each adapter trains on its own samples only, exactly.

A mixed batch's step gives each adapter what a step on its own samples alone gives (bit-identical), a
step on task-a samples leaves adapter b bit-identical (and with no optimiser state), a sync sends
both adapters under their own names, the reference is the base without adapters, a checkpoint keeps
every adapter (and refuses a trainer with other adapters). Plus the config refusals of checks_lora.py.
"""

from __future__ import annotations

import pytest
import torch
from test_train_trainer import algo, samples

from furlong.config import load_config
from furlong.config.schema import ConfigError, LoraConfig, TrainConfig
from furlong.core.sample import SampleError
from furlong.train.trainer import Trainer

RECIPE = "recipes/multi_lora_arithmetic.yaml"


def trainer(model) -> Trainer:
    cfg = TrainConfig(lr=3e-2, lora=LoraConfig(enabled=True, r=4, alpha=8, adapters=["a", "b"]))
    return Trainer(model, cfg, algo())


def tagged(names: list[str]) -> list:
    """8 samples in groups of 4; group g is trained by adapter names[g]."""
    out = samples(seed=1)
    for s in out:
        s.metadata["adapter"] = names[s.group_index]
    return out


def adapter(tr: Trainer, name: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.policy.named_parameters() if f".{name}." in n and ".lora_" in n}


def same(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_each_adapter_trains_on_its_own_samples_only(tiny_model_dir) -> None:
    mixed, only_a, only_b = trainer(tiny_model_dir), trainer(tiny_model_dir), trainer(tiny_model_dir)
    init_a, init_b = adapter(mixed, "a"), adapter(mixed, "b")
    assert same(init_a, adapter(only_a, "a")) and not same(
        init_a, {k.replace(".b.", ".a."): v for k, v in init_b.items()}
    )
    rec = mixed.train_rollout(tagged(["a", "b"]))
    only_a.train_rollout([s for s in tagged(["a", "b"]) if s.metadata["adapter"] == "a"])
    only_b.train_rollout([s for s in tagged(["a", "b"]) if s.metadata["adapter"] == "b"])
    # a step on a's samples leaves b bit-identical and without optimiser state (AdamW skipped its None grads)
    assert same(adapter(only_a, "b"), init_b) and not same(adapter(only_a, "a"), init_a)
    b_params = [p for n, p in only_a.policy.named_parameters() if ".b." in n and ".lora_" in n]
    assert b_params and all(p not in only_a.optimizer.state for p in b_params)
    # the mixed step is exactly the two separate steps
    assert same(adapter(mixed, "a"), adapter(only_a, "a")) and same(adapter(mixed, "b"), adapter(only_b, "b"))
    m = rec["metrics"][0]
    assert m["samples"] == 8 and m["lora/a/samples"] == m["lora/b/samples"] == 4 and m["step"] == mixed.step == 1
    assert len(rec["advantages"]) == 8
    assert mixed.scheduler.last_epoch == 1  # the schedule advanced once for the RL step, not once per adapter


def test_sync_sends_every_adapter_under_its_name(tiny_model_dir) -> None:
    tr = trainer(tiny_model_dir)
    tr.train_rollout(tagged(["a", "b"]))
    names = [n for n, _ in tr.state_dict_for_sync()]
    assert names[:2] == ["lora::a::config", "lora::b::config"]
    for ad in ("a", "b"):
        mine = [n for n in names if n.startswith(f"lora::{ad}::") and n.endswith(("lora_A", "lora_B"))]
        assert len(mine) == 2 * len(tr.policy.base_model.model.model.layers) * 4  # q k v o, A and B
    assert all(n.startswith(("lora::a::", "lora::b::")) for n in names)


def test_untagged_sample_is_refused(tiny_model_dir) -> None:
    with pytest.raises(SampleError, match="not one of train.lora.adapters"):
        trainer(tiny_model_dir).train_rollout(tagged(["a", "c"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lora.adapters=[add]"], "data.mix[1].adapter='rev' is not one of"),
        (["train.lora.adapters=[add,rev,x]"], "no data.mix entry trains them"),
        (["train.lora.enabled=false"], "needs train.lora.enabled=true"),
        (["train.lora.sync=merged"], "train.lora.sync=merged"),
        (["train.num_steps_per_rollout=2", "train.global_batch_size=32"], "train.num_steps_per_rollout>1"),
        (["data.task=arithmetic"], "leave data.task and data.path unset"),
        (["train.lora.adapters=[add,policy]"], "not 'policy'"),
    ],
)
def test_bad_multi_lora_configs_are_refused(overrides: list[str], message: str) -> None:
    load_config(RECIPE)  # the recipe itself is valid
    with pytest.raises(ConfigError, match=None) as e:
        load_config(RECIPE, overrides)
    assert message in str(e.value)


def test_checkpoint_keeps_every_adapter_and_its_names(tiny_model_dir, tmp_path) -> None:
    tr = trainer(tiny_model_dir)
    tr.train_rollout(tagged(["a", "b"]))
    path = tr.save(tmp_path / "ckpt")
    back = trainer(tiny_model_dir)
    back.load(path)
    for name in ("a", "b"):
        assert same(adapter(back, name), adapter(tr, name))
    assert len(back.optimizer.state) == len(tr.optimizer.state) > 0  # both adapters' AdamW moments
    one = Trainer(tiny_model_dir, TrainConfig(lr=3e-2, lora=LoraConfig(enabled=True, r=4, alpha=8)), algo())
    with pytest.raises(ValueError, match="adapters"):
        one.load(path)


def test_reference_is_the_base_without_adapters(tiny_model_dir) -> None:
    cfg = TrainConfig(lr=3e-2, lora=LoraConfig(enabled=True, r=4, alpha=8, adapters=["a", "b"]))
    tr = Trainer(tiny_model_dir, cfg, algo(kl_coef=0.1))
    assert tr.ref is None  # no copy of the base
    rec = tr.train_rollout(tagged(["a", "b"]))
    m = rec["metrics"][0]
    assert m["lora/a/policy/kl_ref"] == m["lora/b/policy/kl_ref"] == 0.0  # first step: every adapter is the base
    base = Trainer(tiny_model_dir, TrainConfig(), algo())
    got = tr.compute_logprobs(tagged(["a", "b"]), which="ref")
    want = base.compute_logprobs(tagged(["a", "b"]))
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-6, rtol=0)
    policy = tr.compute_logprobs(tagged(["a", "b"]))  # the adapters moved: the policy is no longer the base
    assert max(abs(x - y) for g, w in zip(policy, want) for x, y in zip(g, w)) > 1e-3


def test_export_writes_every_adapter_and_refuses_to_merge_several(tiny_model_dir, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from furlong.train.export import export

    tr = trainer(tiny_model_dir)
    tr.train_rollout(tagged(["a", "b"]))
    path = tr.save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="--merge-lora: .* holds 2 adapters"):
        export(path, tmp_path / "merged", merge_lora=True)
    out = export(path, tmp_path / "out")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for name in ("a", "b"):
        loaded = PeftModel.from_pretrained(base, str(out / name), adapter_name=name)  # PEFT: one folder per adapter
        got = {n: p for n, p in loaded.named_parameters() if f".{name}." in n and ".lora_" in n}
        assert same(got, adapter(tr, name))
        base = loaded.unload()
