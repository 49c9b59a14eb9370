"""The trainer's plug points change what it does: loss, advantage, correction, reducer, convert, before-step hook.

Each is handed to the trainer resolved (`TrainerHooks`), the way the driver's composition root
passes what `registry.load_all` loaded, and is called as its Protocol in `config/registry.py` says.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_trainer import MODEL, algo, samples  # noqa: E402

from furlong.config.schema import TrainConfig  # noqa: E402
from furlong.train.batch import TrainBatch  # noqa: E402
from furlong.train.hooks import PlugPointFailed, TrainerHooks  # noqa: E402
from furlong.train.losses import REDUCERS  # noqa: E402
from furlong.train.losses.corrections import Correction  # noqa: E402
from furlong.train.losses.policy import ppo_clip_loss  # noqa: E402
from furlong.train.trainer import Trainer  # noqa: E402


def trainer(hooks: TrainerHooks | None = None, **algo_kw) -> Trainer:
    return Trainer(MODEL, TrainConfig(lr=1e-2), algo(**algo_kw), hooks=hooks)


def test_a_raising_loss_fn_fails_the_step_naming_train_loss_fn() -> None:
    def broken_loss(algo, logprobs, old_logprobs, advantages, mask):
        raise ZeroDivisionError("my loss is broken")

    tr = trainer(TrainerHooks(loss_fn=broken_loss))
    with pytest.raises(PlugPointFailed, match=r"train\.loss_fn .*broken_loss.* raised ZeroDivisionError: my loss") as e:
        tr.train_rollout(samples(0))
    assert isinstance(e.value.__cause__, ZeroDivisionError) and e.value.key == "train.loss_fn"


def test_loss_fn_is_called_as_its_protocol_and_its_loss_is_trained() -> None:
    seen = {}

    def doubled_ppo(algo, logprobs, old_logprobs, advantages, mask):
        seen.update(algo=algo, shapes={t.shape for t in (logprobs, old_logprobs, advantages, mask)})
        loss, metrics = ppo_clip_loss(algo, logprobs, old_logprobs, advantages, mask)
        return 2 * loss, metrics

    plain = trainer().train_step(samples(0))
    custom = trainer(TrainerHooks(loss_fn=doubled_ppo)).train_step(samples(0))
    assert len(seen["shapes"]) == 1 and seen["algo"].name == "grpo"
    assert custom["loss/policy"] == pytest.approx(2 * plain["loss/policy"], rel=1e-5)


def test_zero_advantages_give_zero_policy_gradient() -> None:
    calls = []

    def zero_advantages(algo, rewards, group_index, mask, values, kl):
        calls.append((rewards.shape, group_index.shape, mask.shape, values, kl))
        return torch.zeros_like(mask), None

    batch = samples(0)
    builtin = trainer().train_rollout(batch)
    out = trainer(TrainerHooks(advantage_fn=zero_advantages)).train_rollout(batch)
    assert builtin["metrics"][0]["grad_norm"] > 0
    assert out["metrics"][0]["grad_norm"] == 0.0 and out["metrics"][0]["loss/policy"] == 0.0
    assert all(a == 0.0 for adv in out["advantages"] for a in adv)
    T = max(s.response_length for s in batch)
    assert calls == [((8,), (8,), (8, T), None, None)]  # no critic, no reference: values and kl are None


def test_reducer_fn_scaling_by_two_doubles_the_loss() -> None:
    def twice_sample_mean(values, mask, *, constant, total_tokens, total_samples):
        return 2 * REDUCERS["sample_mean"](
            values, mask, constant=constant, total_tokens=total_tokens, total_samples=total_samples
        )

    plain = trainer(loss_reducer="sample_mean").train_step(samples(0))
    doubled = trainer(TrainerHooks(reducer_fn=twice_sample_mean), loss_reducer="sample_mean").train_step(samples(0))
    for key in ("loss", "loss/policy"):
        assert doubled[key] == pytest.approx(2 * plain[key], rel=1e-5), key


def test_reducer_fn_reduces_the_sft_loss_too() -> None:
    def twice_token_mean(values, mask, *, constant, total_tokens, total_samples):
        return 2 * REDUCERS["token_mean"](values, mask, total_tokens=total_tokens)

    plain = trainer(name="sft").sft_step(samples(0))
    doubled = trainer(TrainerHooks(reducer_fn=twice_token_mean), name="sft").sft_step(samples(0))
    assert doubled["loss"] == pytest.approx(2 * plain["loss"], rel=1e-5)


def test_correction_fn_gets_the_rollout_logprobs_and_its_weights_apply() -> None:
    seen = {}

    def drop_everything(algo, tensors):
        seen.update(tensors)
        mask = tensors["mask"]
        return Correction(weights=torch.zeros_like(mask), metrics={"correction/custom": 1.0})

    batch = samples(0)
    out = trainer(TrainerHooks(correction_fn=drop_everything)).train_rollout(batch)
    for i, s in enumerate(batch):
        got = seen["rollout_logprobs"][i, : s.response_length].tolist()
        assert got == pytest.approx(s.rollout_logprobs, abs=1e-6)
    assert {"logprobs", "old_logprobs", "advantages", "mask"} <= set(seen)
    m = out["metrics"][0]
    assert m["correction/custom"] == 1.0
    assert m["loss/policy"] == 0.0 and m["grad_norm"] == 0.0  # every token weighted 0


def test_convert_fn_and_before_train_step_are_called() -> None:
    converted, hooked = [], []

    def convert(samples):
        converted.append(len(samples))
        return TrainBatch.from_samples(samples)

    def before(step, batch):
        hooked.append((step, len(batch)))

    tr = trainer(TrainerHooks(convert_fn=convert, before_train_step=before))
    tr.train_rollout(samples(0))
    tr.train_rollout(samples(1))
    assert converted == [8, 8] and hooked == [(0, 8), (1, 8)]


def test_train_rollout_returns_its_provenance() -> None:
    batch = samples(0)
    tr = trainer()
    want = tr.compute_logprobs(batch)  # on-policy: the step's own forward gives the train log-probs
    out = tr.train_rollout(batch)
    assert set(out) == {"metrics", "span", "advantages", "train_logprobs"}
    assert len(out["metrics"]) == 1 and out["metrics"][0]["step"] == 1.0
    assert out["span"][0] <= out["span"][1]
    assert [len(a) for a in out["advantages"]] == [s.response_length for s in batch]
    for got, w in zip(out["train_logprobs"], want):
        assert got == pytest.approx(w, abs=1e-5)
