"""Tiny random-weight models of every family in `families.py`, built locally and cached by content hash.

`create_model(arch, size, out)` writes a directory that `AutoTokenizer` and
`AutoModelForCausalLM.from_pretrained` load like any hub model, so every later
stage (engine, trainer, export) treats a tiny model and a real one alike.
Building is deterministic (seeded), and the result is cached under
`$FURLONG_CACHE` (default `~/.cache/furlong/models/<hash>`) so a second call is instant.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from furlong.models.families import FAMILIES, family_config

DEFAULT_POSITIONS = 2048
FACTORY_VERSION = 4  # bump when the factory's output changes, to invalidate caches
BASE_ARCHS = ("qwen3", "llama", "qwen3_moe")  # the recipes' `model.arch`; ChatML tokenizers by default
ARCHS = BASE_ARCHS + tuple(a for a in FAMILIES if a not in BASE_ARCHS)


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int = 512
    experts: int = 4  # MoE only
    experts_per_tok: int = 2
    moe_ffn: int = 0  # MoE only; 0 -> ffn // 2


SIZES: dict[str, Size] = {
    "tiny": Size(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, ffn=128),
    "small": Size(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=768),
    "m25": Size(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, ffn=1536),
}


def cache_root() -> Path:
    return Path(os.environ.get("FURLONG_CACHE", Path.home() / ".cache" / "furlong")) / "models"


def hf_config(arch: str, size: Size, max_positions: int = DEFAULT_POSITIONS):
    """The transformers config for an (arch, size) pair; head_dim is always explicit."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
        rms_norm_eps=1e-6,
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            num_experts=size.experts,
            num_experts_per_tok=size.experts_per_tok,
            moe_intermediate_size=size.moe_ffn or size.ffn // 2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    if arch in FAMILIES:
        return family_config(arch, common, size.moe_ffn or size.ffn // 2)
    raise ValueError(f"model.arch: unknown architecture {arch!r}; choose one of {list(ARCHS)}")


def default_style(arch: str) -> str:
    """The tokenizer template style `arch` gets without `template=`: ChatML for the recipe archs, else its family's."""
    return "chatml" if arch in BASE_ARCHS else FAMILIES[arch].style


def _key(arch: str, size: str, seed: int, max_positions: int = DEFAULT_POSITIONS, style: str | None = None) -> str:
    spec = {"arch": arch, "size": asdict(SIZES[size]), "seed": seed, "factory": FACTORY_VERSION}
    if max_positions != DEFAULT_POSITIONS:  # the default keeps the keys (and caches) models had before the option
        spec["max_positions"] = max_positions
    if style is not None and style != default_style(arch):  # likewise for the template style
        spec["template"] = style
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def create_model(
    arch: str = "qwen3",
    size: str = "tiny",
    out: str | Path | None = None,
    seed: int = 0,
    max_positions: int = DEFAULT_POSITIONS,
    template: str | None = None,
) -> Path:
    """Build (or reuse) a model directory and return its path.

    `template` is the tokenizer's chat-template style (`tokenizer.styles()`: chatml, qwen3_thinking,
    llama3, mistral, gemma, phi3, tulu); None gives the architecture's default (`default_style`).

    `max_positions` is the context length (RoPE positions); agent harnesses with long
    system prompts (Harbor's Terminus: ~2k tokens in this vocabulary) need more than the default.

    With `out`, the cached directory is copied there (skipped when `out` already
    holds the same build). Raises ValueError naming the bad argument.
    """
    if arch not in ARCHS:
        raise ValueError(f"--arch: unknown architecture {arch!r}; choose one of {list(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"--size: unknown size {size!r}; choose one of {list(SIZES)}")
    if not 64 <= max_positions <= 1 << 17:
        raise ValueError(f"--max-positions: {max_positions} is outside [64, 131072]")
    style = template or default_style(arch)
    key = _key(arch, size, seed, max_positions, style)
    cached = cache_root() / f"{arch}-{size}-{key}"
    if not (cached / "furlong_model.json").exists():
        _build(arch, size, seed, cached, key, max_positions, style)
    if out is None:
        return cached
    out = Path(out)
    stamp = out / "furlong_model.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in cached.iterdir():
        shutil.copy2(f, out / f.name)
    return out


def _build(
    arch: str, size: str, seed: int, dest: Path, key: str, max_positions: int = DEFAULT_POSITIONS, style: str = "chatml"
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from furlong.models.tokenizer import build_tokenizer, styles

    spec = SIZES[size]
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_tokenizer(spec.vocab, seed, style)
    st = styles()[style]
    tokenizer.model_max_length = max_positions
    assert len(tokenizer) <= spec.vocab, (len(tokenizer), spec.vocab)
    torch.manual_seed(seed)
    config = hf_config(arch, spec, max_positions)
    if st.bos is not None:
        config.bos_token_id = tokenizer.convert_tokens_to_ids(st.bos)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # The stop tokens: end of text and the template's end of turn, as the family's generation_config lists them.
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(
        list(dict.fromkeys([st.eos, st.end_of_turn]))
    )
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    (tmp / "furlong_model.json").write_text(
        json.dumps(
            {
                "key": key,
                "arch": arch,
                "size": size,
                "seed": seed,
                "max_positions": max_positions,
                "template": style,
                "parameters": n_params,
            },
            indent=2,
        )
    )
    # Atomic publish: concurrent builders (parallel tests) never see a half-written dir.
    try:
        os.rename(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
