"""The trainer's own config dataclasses, field-compatible with `furlong.config`'s `train` section.

The trainer reads its config by attribute only, so the config package's pydantic
section can be passed straight in; these dataclasses exist so the trainer (and
its tests) run without the config package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoraSettings:
    enabled: bool = False
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TrainerConfig:
    world_size: int = 1
    backend: str = "auto"  # auto | gloo | nccl
    lr: float = 1e-5
    critic_lr: float | None = None  # PPO critic; None -> lr
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # <= 0: no clipping (the norm is still logged)
    lr_schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0
    total_steps: int = 0
    micro_batch_tokens: int = 512
    global_batch_size: int = 0
    num_steps_per_rollout: int = 1
    dtype: str = "float32"  # float32 | bfloat16
    gradient_checkpointing: bool = False
    ref_update_every: int = 0  # 0: the reference model stays frozen at the initial policy
    checkpoint_every: int = 0
    lora: LoraSettings = field(default_factory=LoraSettings)
    sft_steps: int = 0
    sft_lr: float | None = None  # the SFT warm-up's learning rate; None -> lr
    seed: int = 0  # adapter and value-head initialisation (identical on every rank)


def lora_dict(lora: Any) -> dict[str, Any] | None:
    """The LoRA section as a plain dict (for the checkpoint's meta.json), or None when disabled."""
    if lora is None:
        return None
    get = lora.get if isinstance(lora, dict) else lambda k, d=None: getattr(lora, k, d)
    if not get("enabled", False):
        return None
    targets = get("target_modules", "all-linear")
    return {
        "r": int(get("r", 8)),
        "alpha": float(get("alpha", 16.0)),
        "dropout": float(get("dropout", 0.0)),
        "target_modules": targets if isinstance(targets, str) else list(targets),
    }
