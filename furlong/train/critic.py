"""The PPO critic: the policy's backbone (a separate copy) with a scalar value head.

The backbone is the decoder of the policy's checkpoint, so any HF causal LM gets
a critic without per-architecture code; the LM head is dropped. The value head
starts at zero, so the first values are 0 and GAE's first advantages are plain
discounted returns — deterministic across ranks with no seeding games.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class ValueModel(nn.Module):
    def __init__(self, model_dir: str | Path, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        # `base_model` is the decoder without its LM head, for any HF causal LM.
        self.backbone = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).base_model
        self.head = nn.Linear(self.backbone.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Values `[N]` (fp32) at positions `index` of the flattened `[B*L]` block: V(state before each response token)."""
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.head(hidden.flatten(0, 1)[index]).squeeze(-1).float()
