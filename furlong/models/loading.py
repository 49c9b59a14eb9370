"""Loading a local model directory, in the layouts real checkpoints come in, with errors that name the missing file.

Why: `from_pretrained` on a directory that lacks a file says something about the hub (or a
generic OSError) even when nothing may be downloaded; a user pointing a recipe at their own
checkpoint needs to read which path is missing. The layouts handled: one `model.safetensors`,
sharded safetensors with `model.safetensors.index.json` (every shard it lists must exist),
`pytorch_model.bin` (single or indexed), tied or untied embeddings (transformers ties them from
`tie_word_embeddings`), an optional `generation_config.json` (its EOS ids are the stop tokens),
a tokenizer-only directory (enough for `furlong tito check`), and a chat template in
`chat_template.jinja` or inline in `tokenizer_config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelDirError(FileNotFoundError):
    """A model directory lacks a file it needs; the message names the path."""


def _dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelDirError(f"model directory {p} does not exist (model.path must be a local directory)")
    return p


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory; ModelDirError naming what is missing."""
    p = _dir(path)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (p / index).is_file():
            try:
                shards = sorted(set(json.loads((p / index).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError) as e:
                raise ModelDirError(f"{p / index}: not a weight index (needs a 'weight_map' object): {e}") from None
            missing = [s for s in shards if not (p / s).is_file()]
            if missing:
                raise ModelDirError(
                    f"{p / missing[0]} is missing (listed in {p / index}; {len(missing)} shard(s) missing)"
                )
            return [p / s for s in shards]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (p / single).is_file():
            return [p / single]
    raise ModelDirError(f"{p} has no weights: expected one of {', '.join(WEIGHT_FILES)}")


def check_model_dir(path: str | Path, weights: bool = True) -> Path:
    """Check that `path` holds a config (and weights, with `weights`) and a tokenizer; returns the path."""
    p = _dir(path)
    if weights:
        if not (p / "config.json").is_file():
            raise ModelDirError(f"{p / 'config.json'} is missing (the model's architecture is read from it)")
        weight_files(p)
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ModelDirError(f"{p} has no tokenizer: expected one of {', '.join(TOKENIZER_FILES)}")
    return p


def load_tokenizer(path: str | Path) -> Any:
    """The directory's tokenizer, with its chat template from `chat_template.jinja` when the config has none."""
    from transformers import AutoTokenizer

    p = check_model_dir(path, weights=False)
    tok = AutoTokenizer.from_pretrained(str(p))
    jinja = p / "chat_template.jinja"
    if not getattr(tok, "chat_template", None) and jinja.is_file():
        tok.chat_template = jinja.read_text()
    return tok


def load_model(path: str | Path, dtype: str = "float32") -> Any:
    """The directory's causal LM (any `AutoModelForCausalLM` architecture), after checking its files."""
    import torch
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path)
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=getattr(torch, dtype))


def generation_eos(path: str | Path) -> list[int]:
    """The EOS ids of `generation_config.json` (else `config.json`'s): the stop tokens the engine uses."""
    p = _dir(path)
    for name in ("generation_config.json", "config.json"):
        f = p / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []
