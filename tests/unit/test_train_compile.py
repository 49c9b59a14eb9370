"""`train.compile`: compiled decoder layers train like eager ones, compile once for every batch shape,
and report their compile time apart; the config refuses it with R3 routing replay.

Tolerance: compiled kernels reorder fp32 reductions, so log-probs, losses and gradients are compared at
1e-4 (absolute on log-probs, relative on scalars) where eager-vs-eager is exact."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics

from furlong.config import load_config
from furlong.config.schema import ConfigError, TrainConfig
from furlong.models import create_model
from furlong.train import compiled
from furlong.train.trainer import Trainer
from tests.unit.test_train_trainer import algo, samples

torch.set_num_threads(1)
MODEL = create_model("qwen3", "tiny")
pytestmark = pytest.mark.timeout(600)  # two cold Inductor compiles (C++ builds) on a loaded 2-core machine


def _compiles() -> int:
    return len(compilation_time_metrics.get("_compile.compile_inner", []))


def two_steps(on_step=lambda: None, **settings) -> tuple[Trainer, list[dict], list[dict], list]:
    """Two RL steps on batches of other lengths: each step's record, its gradients and `on_step()` after it."""
    tr = Trainer(MODEL, TrainConfig(lr=1e-3, micro_batch_tokens=40, **settings), algo())
    records, grads, marks = [], [], []
    for seed in (1, 2):
        records.append(tr.train_rollout(samples(seed=seed)))
        grads.append({n: p.grad.clone() for n, p in tr.policy.named_parameters() if p.grad is not None})
        marks.append(on_step())
    return tr, records, grads, marks


def assert_trains_alike(ref: tuple[list[dict], list[dict]], got: tuple[list[dict], list[dict]]) -> None:
    """(records, gradients) of two runs: log-probs within 1e-4 (absolute), losses and grad norms within 1e-4
    (relative), gradients within 1e-4 / 1e-3."""
    for e, c in zip(*(r for r, _ in (ref, got))):
        for le, lc in zip(e["train_logprobs"], c["train_logprobs"]):
            torch.testing.assert_close(torch.tensor(lc), torch.tensor(le), atol=1e-4, rtol=0)
        em, cm = e["metrics"][0], c["metrics"][0]
        for k in ("loss", "grad_norm"):
            assert abs(em[k] - cm[k]) <= 1e-4 * max(1.0, abs(em[k])), (k, em[k], cm[k])
    for ge, gc in zip(ref[1], got[1]):
        assert ge.keys() == gc.keys()
        for n in ge:
            torch.testing.assert_close(gc[n], ge[n], atol=1e-4, rtol=1e-3, msg=n)


def test_compiled_layers_train_like_eager_within_1e_4() -> None:
    eager, eager_rec, eager_grads, (before, _) = two_steps(_compiles, compile=False)
    assert not compiled.is_compiled(eager.policy) and "perf/compile_s" not in eager_rec[0]["metrics"][0]
    comp, comp_rec, comp_grads, (after_first, after_second) = two_steps(_compiles, compile=True)
    assert compiled.is_compiled(comp.policy)
    first, second = (r["metrics"][0] for r in comp_rec)
    assert after_first > before and first["perf/compile_s"] > 0  # the first step compiled, and says how long
    assert after_second == after_first  # the second batch (other rows and lengths) compiled nothing new
    assert second["perf/compile_s"] == 0.0
    assert_trains_alike((eager_rec, eager_grads), (comp_rec, comp_grads))


def test_setting_resolves_by_device_and_rejects_unknown_values() -> None:
    assert compiled.wanted(True, torch.device("cpu")) and not compiled.wanted(False, torch.device("cuda"))
    assert compiled.wanted("auto", torch.device("cuda")) and not compiled.wanted("auto", torch.device("cpu"))
    with pytest.raises(ValueError, match="train.compile"):
        compiled.wanted("yes", torch.device("cpu"))


def test_routing_replay_refuses_compile_on_and_turns_auto_off() -> None:
    r3 = ["model.arch=qwen3_moe", "rollout.routing_replay=true"]
    with pytest.raises(ConfigError, match="train.compile=true: a compiled layer does not run its hooks"):
        load_config(None, [*r3, "train.compile=on"])  # YAML's on: true
    assert load_config(None, r3).train.compile is False
    assert load_config(None, []).train.compile == "auto"
