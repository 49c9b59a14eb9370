"""LoRA through PEFT: wrap the policy, and give engines its adapters alone, or merged weights.

Only the adapter matrices are trainable (PEFT freezes the base), so the optimiser
and its state hold adapters alone. Two ways to the engines (`train.lora.sync`):

- `adapter` (default): only A, B of every target module travel (`adapter_items`), named
  `lora::policy::<HF module>.lora_A|lora_B` plus one config tensor (scaling, module count);
  the built-in engine applies them at run time as its policy adapter (`engine/adapters.py`).
  Rank 8 on q/k/v/o of the m25 model moves 0.9% of the full weights' bytes.
- several adapters (`train.lora.adapters`, multi_lora.py): each travels under its own name.
- `merged`: engines that do not serve adapters (SGLang, the HF fallback) receive
  W + (B·A)·scale, computed one layer at a time from full tensors, under the plain HF names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from furlong.config.schema import LoraConfig

ADAPTER = "default"
SYNC_ADAPTER = "policy"  # the name the run's adapter has on the engines
_PREFIX = "base_model.model."


def lora_dict(lora: LoraConfig) -> dict[str, Any] | None:
    """`train.lora` as a plain dict, or None when disabled.

    The dict is what the checkpoint's meta.json records, so a resume can refuse a checkpoint
    whose adapters do not match the trainer's (JSON types: int rank, float alpha and dropout).
    """
    if not lora.enabled:
        return None
    out: dict[str, Any] = {
        "r": int(lora.r),
        "alpha": float(lora.alpha),
        "dropout": float(lora.dropout),
        "target_modules": list(lora.target_modules),
    }
    return out | ({"adapters": list(lora.adapters)} if lora.adapters else {})  # multi-LoRA: their names


def apply_lora(model: nn.Module, lora: dict[str, Any], names: list[str] | None = None) -> nn.Module:
    """Wrap `model` with fresh adapters (B = 0, so the wrapped model starts equal to the base).

    `names` (multi-LoRA, `train.lora.adapters`): one adapter per name, all of the same shape; see multi_lora.py.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=lora["target_modules"],
        task_type="CAUSAL_LM",
    )
    if not names:
        return get_peft_model(model, config)
    peft = get_peft_model(model, config, adapter_name=names[0])
    for name in names[1:]:
        peft.add_adapter(name, config)
    return peft


def hf_name(peft_name: str) -> str:
    """`base_model.model.model.layers.0.q_proj.base_layer.weight` → `model.layers.0.q_proj.weight`."""
    name = peft_name[len(_PREFIX) :] if peft_name.startswith(_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


def merged_items(model: nn.Module, items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a PEFT model's (name, full tensor) stream into merged (HF name, tensor) pairs.

    A LoRA layer's base weight and its A and B arrive in turn; the layer is
    yielded once all three are seen, so at most one layer is buffered.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in items:
        if f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name or name.endswith(".base_layer.weight"):
            if name.endswith(".base_layer.weight"):
                prefix, part = name[: -len(".base_layer.weight")], "W"
            else:
                prefix, part = name.split(".lora_")[0], "A" if ".lora_A." in name else "B"
            got = pending.setdefault(prefix, {})
            got[part] = t
            if len(got) == 3:
                del pending[prefix]
                layer = model.get_submodule(prefix)
                delta = (got["B"].float() @ got["A"].float()) * layer.scaling[ADAPTER]
                if getattr(layer, "fan_in_fan_out", False):
                    delta = delta.T
                yield hf_name(prefix + ".weight"), (got["W"].float() + delta).to(got["W"].dtype)
        elif ".lora_" not in name:
            yield hf_name(name), t
    if pending:
        raise RuntimeError(f"LoRA merge: incomplete layers {sorted(pending)[:3]}")


def adapter_items(
    model: nn.Module, items: Iterator[tuple[str, torch.Tensor]], names: dict[str, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the adapter tensors of a PEFT model's (name, full tensor) stream, under engine adapter names.

    `names` maps each PEFT adapter to its engine name: by default the one adapter (`default`) travels as
    `policy`; multi-LoRA sends every adapter under its own name, each resident in the engine beside the others.
    The whole stream is still drained (it is a collective under FSDP); the base tensors are dropped.
    Each adapter's config tensor [scaling, number of modules] goes first so the engine knows when its set is complete.
    """
    from furlong.core.api import lora_tensor_name

    names = names or {ADAPTER: SYNC_ADAPTER}
    for peft_name, sync_name in names.items():
        layers = {n: m for n, m in model.named_modules() if peft_name in getattr(m, "lora_A", {})}
        scales = {float(m.scaling[peft_name]) for m in layers.values()}
        if len(scales) != 1 or any(getattr(m, "fan_in_fan_out", False) for m in layers.values()):
            raise RuntimeError(
                f"adapter sync of {peft_name!r}: expected one scaling and no fan_in_fan_out, got scalings {sorted(scales)}"
            )
        yield lora_tensor_name(sync_name, "", "config"), torch.tensor([scales.pop(), float(len(layers))])
    for name, t in items:
        for part in ("lora_A", "lora_B"):
            for peft_name, sync_name in names.items():
                if f".{part}.{peft_name}." in name:
                    yield lora_tensor_name(sync_name, hf_name(name.split(f".{part}.")[0]), part), t
