"""The `train.lora` refusals, multi-LoRA's among them (moved out of checks.py, which is at its size cap).

Multi-LoRA (`train.lora.adapters`) trains one adapter per name on the prompts tagged with it
(`data.mix[].adapter`, or a file row's `adapter` field via `data.metadata_keys`). What is built is
refused nowhere; what is not (several adapters merged into one weight set, FSDP across ranks, more
than one optimiser step per rollout, an SFT warm-up that would train one adapter on every task) is
refused here, naming the fields.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from furlong.config.checks import Bad

NAME = re.compile(r"[A-Za-z0-9_.-]+")  # an adapter name travels inside `lora::<name>::...` tensor names


def check_lora(cfg: Any, bad: Bad) -> None:
    """Adapter sync needs an engine that serves adapters; multi-LoRA needs its adapters named and used."""
    tr = cfg.train
    if tr.lora.enabled and cfg.weights.transport == "p2p":
        bad(
            ("train.lora.enabled", "weights.transport"),
            "train.lora.enabled=true syncs whole tensors (the adapters, or base and adapters merged), which "
            "weights.transport=p2p (each rank sends its own shards of the base) cannot carry; "
            "use shm, broadcast, disk or delta",
        )
    why = "backend" if cfg.engine.backend == "sglang" else "quantization" if cfg.engine.quantization != "none" else None
    if tr.lora.enabled and tr.lora.sync == "adapter" and why:
        bad(
            ("train.lora.sync", f"engine.{why}"),
            "train.lora.sync=adapter needs engines that add the synced adapter to dense projections at run time "
            f"(the built-in engine, unquantised); with engine.{why}={getattr(cfg.engine, why)} set train.lora.sync=merged",
        )
    if tr.qat != "none" and tr.lora.enabled:
        bad(
            ("train.qat", "train.lora.enabled"),
            f"train.qat={tr.qat} with train.lora.enabled=true is not supported: the rollout would quantise "
            "the merged W + B·A, which a fake-quantised base plus a full-precision adapter does not equal; "
            "use one or the other",
        )
    _check_multi(cfg, bad)


def _check_multi(cfg: Any, bad: Bad) -> None:
    tr, data = cfg.train, cfg.data
    names = list(tr.lora.adapters)
    tagged = [m.adapter for m in data.mix if m.adapter is not None]
    if data.mix and (data.path is not None or data.task is not None):
        bad(
            ("data.mix", "data.task", "data.path"),
            "data.mix lists the tasks itself: leave data.task and data.path unset",
        )
    if data.mix and (data.eval_path is not None or data.eval_task is not None):
        bad(("data.mix", "data.eval_task"), "data.mix evaluates on each task's held-out split: leave data.eval_* unset")
    for i, m in enumerate(data.mix):
        if m.adapter is not None and m.adapter not in names:
            bad(
                (f"data.mix[{i}].adapter", "train.lora.adapters"),
                f"data.mix[{i}].adapter={m.adapter!r} is not one of train.lora.adapters={names}",
            )
    if not names:
        return
    if not tr.lora.enabled:
        bad(("train.lora.adapters", "train.lora.enabled"), "train.lora.adapters needs train.lora.enabled=true")
    if len(set(names)) != len(names) or any(not NAME.fullmatch(n) or n == "policy" for n in names):
        bad(
            ("train.lora.adapters",),
            f"train.lora.adapters={names}: names must be distinct, of letters, digits, '_', '.', '-', "
            "and not 'policy' (the single-adapter sync name)",
        )
    unused = [n for n in names if n not in tagged]
    if data.mix and unused:
        bad(("train.lora.adapters", "data.mix"), f"train.lora.adapters {unused}: no data.mix entry trains them")
    if data.mix and len(tagged) != len(data.mix):
        bad(("data.mix",), "with train.lora.adapters set, every data.mix entry names its adapter")
    if not data.mix and "adapter" not in data.metadata_keys:
        bad(
            ("train.lora.adapters", "data.mix"),
            "train.lora.adapters needs prompts tagged with their adapter: data.mix[].adapter, or a data.path "
            "whose rows hold an `adapter` field with data.metadata_keys: [adapter]",
        )
    for field, value, why in (
        ("train.lora.sync", tr.lora.sync != "adapter", "=merged folds one adapter into the weights; use adapter"),
        ("train.world_size", tr.world_size > 1, ">1: multi-LoRA is built for one trainer rank"),
        ("train.num_steps_per_rollout", tr.num_steps_per_rollout > 1, ">1: each adapter takes one step per rollout"),
        ("train.sft_steps", tr.sft_steps > 0, ">0: an SFT warm-up would train one adapter on every task"),
        (
            "rollout.generate_fn",
            cfg.rollout.generate_fn is not None,
            ": only the default generate fn names the adapter",
        ),
        ("rollout.agent_fn", cfg.rollout.agent_fn is not None, ": only the default generate fn names the adapter"),
    ):
        if value:
            bad((field, "train.lora.adapters"), f"{field}{why} (with train.lora.adapters, not supported)")
