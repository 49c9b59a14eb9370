"""LoRA through PEFT: wrap the policy, and give engines merged weights under HF names.

Only the adapter matrices are trainable (PEFT freezes the base), so the optimiser
and its state hold adapters alone. Engines that do not serve adapters receive
merged weights, W + (B·A)·scale, computed one layer at a time from full tensors,
under the plain HF names the base model uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from furlong.config.schema import LoraConfig

ADAPTER = "default"
_PREFIX = "base_model.model."


def lora_dict(lora: LoraConfig) -> dict[str, Any] | None:
    """`train.lora` as a plain dict, or None when disabled.

    The dict is what the checkpoint's meta.json records, so a resume can refuse a checkpoint
    whose adapters do not match the trainer's (JSON types: int rank, float alpha and dropout).
    """
    if not lora.enabled:
        return None
    return {
        "r": int(lora.r),
        "alpha": float(lora.alpha),
        "dropout": float(lora.dropout),
        "target_modules": list(lora.target_modules),
    }


def apply_lora(model: nn.Module, lora: dict[str, Any]) -> nn.Module:
    """Wrap `model` with fresh adapters (B = 0, so the wrapped model starts equal to the base)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=lora["target_modules"],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


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
