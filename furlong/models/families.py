"""The model families furlong builds tiny random-weight models of, from the real `transformers` config classes.

Why: "any Hugging Face causal LM" is only a claim until each family's layers (biases,
norms, soft-capping, routed experts, fused projections, tied embeddings) and its chat
template have gone through the engine, the trainer and a weight sync. Each entry here
names the config class, the family's template style (`templates.py`) and the config
values that differ from the factory's common ones; `tests/unit/test_architectures.py`
runs every entry and `tools/model_table.py` turns that list into the docs table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# What tests/unit/test_architectures.py checks for every family (the docs table's last column).
CHECKS = (
    "engine path",
    "greedy = HF",
    "log-probs = trainer (1e-4)",
    "GRPO step",
    "weight sync (shm, verified)",
)


@dataclass(frozen=True)
class Family:
    arch: str  # the config's model_type, also the factory's --arch
    config_class: str  # the transformers config class
    style: str  # the tokenizer's chat-template style
    label: str  # the family as users know it
    extra: dict[str, Any] = field(default_factory=dict)  # config values beyond the common ones
    moe: bool = False


FAMILIES: dict[str, Family] = {
    f.arch: f
    for f in (
        Family("qwen2", "Qwen2Config", "chatml", "Qwen2 / Qwen2.5", {"attention_bias": True}),
        Family("qwen3", "Qwen3Config", "chatml", "Qwen3"),
        Family("llama", "LlamaConfig", "llama3", "Llama 2 / 3"),
        Family("mistral", "MistralConfig", "mistral", "Mistral", {"sliding_window": None}),
        Family(
            "mixtral",
            "MixtralConfig",
            "mistral",
            "Mixtral (MoE)",
            {"num_local_experts": 4, "num_experts_per_tok": 2},
            moe=True,
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "chatml",
            "Qwen3-MoE",
            {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1},
            moe=True,
        ),
        Family(
            "gemma2",
            "Gemma2Config",
            "gemma",
            "Gemma 2",
            {"tie_word_embeddings": True, "query_pre_attn_scalar": 32, "sliding_window": 16},
        ),
        Family(
            "gemma3_text",
            "Gemma3TextConfig",
            "gemma",
            "Gemma 3 (text)",
            {"tie_word_embeddings": True, "query_pre_attn_scalar": 32, "sliding_window": 16},
        ),
        Family("phi3", "Phi3Config", "phi3", "Phi-3"),
        Family("olmo2", "Olmo2Config", "tulu", "OLMo 2"),
    )
}


def family_config(arch: str, common: dict[str, Any], moe_ffn: int):
    """The transformers config of `arch` with the factory's common sizes and the family's own values."""
    import transformers

    fam = FAMILIES[arch]
    kw = dict(common)
    if fam.arch == "qwen3_moe":
        kw["moe_intermediate_size"] = moe_ffn
    kw.update(fam.extra)
    return getattr(transformers, fam.config_class)(**kw)
