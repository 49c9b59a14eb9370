"""Real checkpoint layouts: sharded safetensors with an index, tied embeddings on the native path, with and
without generation_config.json, tokenizer-only directories, chat_template.jinja vs an inline template, and
errors that name the missing path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.engine.engine import Engine
from furlong.engine.request import Request
from furlong.engine.sampler import SamplingParams
from furlong.models import ModelDirError, check_model_dir, create_model, load_model, load_tokenizer
from furlong.models.factory import SIZES, hf_config
from furlong.models.loading import generation_eos, weight_files
from furlong.models.tokenizer import IM_END

torch.set_num_threads(1)
PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


def greedy(path) -> list[int]:
    engine = Engine(path, kv_cache_mb=1, block_size=4).start()
    try:
        return engine.generate([Request(PROMPT, GREEDY)], timeout=60)[0].output_ids
    finally:
        engine.stop()


def copy_tokenizer(src, dst) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy2(f, dst / f.name)


@pytest.fixture(scope="module")
def base():
    return create_model("qwen3", "tiny")


@pytest.mark.timeout(180)
def test_sharded_safetensors_with_index(base, tmp_path) -> None:
    out = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(base).save_pretrained(out, max_shard_size="100KB")
    copy_tokenizer(base, out)
    shards = weight_files(out)
    assert (out / "model.safetensors.index.json").is_file() and len(shards) > 1
    assert greedy(out) == greedy(base)
    shards[1].unlink()
    with pytest.raises(ModelDirError, match=f"{shards[1]} is missing .*model.safetensors.index.json"):
        Engine(out, kv_cache_mb=1)
    with pytest.raises(ModelDirError, match="is missing"):
        load_model(out)


@pytest.mark.timeout(180)
def test_tied_embeddings_on_the_native_path(base, tmp_path) -> None:
    """A tied checkpoint stores no lm_head; the engine reads the tied matrix and matches HF."""
    cfg = hf_config("llama", SIZES["tiny"])
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out = tmp_path / "tied"
    model.save_pretrained(out)
    copy_tokenizer(base, out)
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    engine = Engine(out, kv_cache_mb=1, block_size=4).start()
    try:
        assert engine.backend == "NativeModel"
        assert engine.generate([Request(PROMPT, GREEDY)], timeout=60)[0].output_ids == ids[len(PROMPT) :]
    finally:
        engine.stop()


def test_stop_tokens_from_generation_config_and_template(base, tmp_path) -> None:
    im_end = load_tokenizer(base).convert_tokens_to_ids(IM_END)
    assert generation_eos(base) == [0, im_end]  # the factory's generation_config.json lists EOS and end of turn
    assert Engine(base, kv_cache_mb=1).eos_ids == {0, im_end}
    out = tmp_path / "nogen"
    shutil.copytree(base, out)
    (out / "generation_config.json").unlink()
    assert generation_eos(out) == [0]  # from config.json when generation_config.json is absent
    # the engine still stops at the end of turn: it reads it from the template's closing
    assert Engine(out, kv_cache_mb=1).eos_ids == {0, im_end}


def test_tokenizer_only_dir_and_chat_template_files(base, tmp_path) -> None:
    only = tmp_path / "tok"
    copy_tokenizer(base, only)
    assert (only / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((only / "tokenizer_config.json").read_text())
    tok = load_tokenizer(only)
    assert tok.chat_template == (only / "chat_template.jinja").read_text()
    assert check_model_dir(only, weights=False) == only
    with pytest.raises(ModelDirError, match=f"{only / 'config.json'} is missing"):
        load_model(only)
    with pytest.raises(ModelDirError, match="config.json is missing"):
        Engine(only, kv_cache_mb=1)
    # The older layout: the template inline in tokenizer_config.json, no .jinja file.
    inline = tmp_path / "inline"
    copy_tokenizer(base, inline)
    cfg = json.loads((inline / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (inline / "chat_template.jinja").read_text()
    (inline / "tokenizer_config.json").write_text(json.dumps(cfg))
    (inline / "chat_template.jinja").unlink()
    assert load_tokenizer(inline).chat_template == tok.chat_template


def test_missing_paths_are_named(base, tmp_path) -> None:
    with pytest.raises(ModelDirError, match=f"model directory {tmp_path / 'nope'} does not exist"):
        load_tokenizer(tmp_path / "nope")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy2(base / "config.json", bare / "config.json")
    with pytest.raises(ModelDirError, match=f"{bare} has no weights: expected one of model.safetensors"):
        check_model_dir(bare)
    shutil.copy2(base / "model.safetensors", bare / "model.safetensors")
    with pytest.raises(ModelDirError, match=f"{bare} has no tokenizer"):
        check_model_dir(bare)
    (bare / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ModelDirError, match="not a weight index"):
        weight_files(bare)
