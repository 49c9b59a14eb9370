"""The tiny-model factory: reloadable with transformers, exact token ids, cached."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from furlong.models import SIZES, create_model
from furlong.models.tokenizer import build_tokenizer

TEXTS = [
    "What is 12 + 345? Answer: 357",
    "0123456789 9876543210 -42 3.14159 1e-5",
    "héllo wörld — naïve café, 日本語, emoji 🎉🚀, Ωmega ß",
    "tabs\tand\nnewlines\r\n  double  spaces",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_created_model_reloads_with_identical_token_ids(arch, tmp_path):
    out = create_model(arch, "tiny", tmp_path / "m")
    reloaded = AutoTokenizer.from_pretrained(out)
    trained = build_tokenizer(SIZES["tiny"].vocab, seed=0)
    for text in TEXTS:
        ids = trained.encode(text)
        assert reloaded.encode(text) == ids, text
        assert reloaded.decode(ids) == text
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "3+4=?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3+4"}}}
            ],
        },
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "Answer: 7"},
    ]
    a = trained.apply_chat_template(messages, tokenize=False)
    b = reloaded.apply_chat_template(messages, tokenize=False)
    assert a == b and "<tool_response>7</tool_response>" in a and "<|im_start|>tool\n" in a
    assert trained.encode(a) == reloaded.encode(a)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.head_dim in (32, 64)
    assert model.config.vocab_size >= len(reloaded)
    with torch.no_grad():
        logits = model(torch.tensor([reloaded.encode(TEXTS[0])])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


def test_tool_tokens_are_single_tokens_kept_by_skip_special():
    tok = build_tokenizer()
    for t in ("<tool_call>", "</tool_call>", "<|im_end|>"):
        assert len(tok.encode(t)) == 1, t
    ids = tok.encode("<tool_call>x</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_cache_makes_a_second_call_cheap_and_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("FURLONG_CACHE", str(tmp_path / "cache"))
    first = create_model("llama", "tiny")
    stamp = json.loads((first / "furlong_model.json").read_text())
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    again = create_model("llama", "tiny")
    assert again == first and (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert json.loads((again / "furlong_model.json").read_text()) == stamp


def test_m25_has_the_documented_shape():
    from furlong.models.factory import hf_config

    cfg = hf_config("qwen3", SIZES["m25"])
    assert (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    ) == (512, 8, 8, 4, 64, 1536)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert 24e6 < n < 27e6


def test_bad_arguments_name_the_flag():
    with pytest.raises(ValueError, match="--arch"):
        create_model("gpt2", "tiny")
    with pytest.raises(ValueError, match="--size"):
        create_model("qwen3", "huge")
