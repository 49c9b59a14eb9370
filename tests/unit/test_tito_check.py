"""`furlong tito check MODEL_DIR`: passes conforming templates, fails (exit 1) on one that strips past reasoning,
naming the first differing position."""

from __future__ import annotations

import re

import pytest

from furlong.cli import main as cli_main
from furlong.models import create_model
from furlong.models.tito_check import CONVERSATION, TOOLS, build_turn_by_turn, check_tokenizer, encode_whole, main
from furlong.models.tokenizer import build_tokenizer, styles


@pytest.mark.parametrize("style", [s for s in styles() if s != "qwen3_thinking"])
def test_family_templates_conform(style: str) -> None:
    report = check_tokenizer(build_tokenizer(512, 0, style))
    assert report.ok, report.text()
    assert report.first_diff is None and [c.name for c in report.checks] == [
        "end of turn",
        "append-only",
        "trainable tokens",
    ]


def test_reasoning_stripping_template_fails_at_the_first_differing_token(tmp_path, capsys) -> None:
    """Qwen3-style: earlier turns lose their <think> block in the whole rendering, so ids differ there."""
    tok = build_tokenizer(512, 0, "qwen3_thinking")
    tok.save_pretrained(tmp_path / "tok")  # a tokenizer-only directory: no config, no weights
    built = build_turn_by_turn(tok, CONVERSATION, TOOLS).ids
    whole = encode_whole(tok, CONVERSATION, TOOLS)
    want = next(k for k, (a, b) in enumerate(zip(built, whole)) if a != b)
    assert tok.decode([built[want]]) == "<think>"  # the stripped reasoning is where they part
    assert main(["check", str(tmp_path / "tok")]) == 1
    out = capsys.readouterr().out
    assert f"FAIL append-only: position {want}:" in out
    assert out.strip().endswith(f"FAIL (first differing position: {want})")


def test_cli_passes_a_conforming_model_dir_and_names_a_missing_one(tmp_path, capsys) -> None:
    path = create_model("qwen3", "tiny")
    assert cli_main(["tito", "check", str(path)]) == 0  # through the `furlong` dispatcher
    out = capsys.readouterr().out
    assert re.search(r"ok +append-only: \d+ tokens, turn by turn == whole", out)
    assert out.strip().endswith("PASS: the template continues token-in-token-out")
    missing = tmp_path / "nowhere"
    assert main(["check", str(missing)]) == 2
    assert f"model directory {missing} does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["check", str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty'} has no tokenizer" in capsys.readouterr().err


def test_no_template_fails(tmp_path) -> None:
    tok = build_tokenizer(512, 0)
    tok.chat_template = None
    report = check_tokenizer(tok)
    assert not report.ok and "no chat template" in report.text()


@pytest.mark.parametrize("style", ["llama3", "gemma", "mistral"])
def test_sft_trains_the_response_and_the_template_end_of_turn(style: str) -> None:
    """Warm-up samples end each demonstrated answer with the family's end of turn, not a ChatML constant."""
    from furlong.data.datasets import Prompt
    from furlong.data.sft import sft_samples

    tok = build_tokenizer(512, 0, style)
    end = styles()[style].end_of_turn
    prompt = [{"role": "user", "content": "What is 3 + 4?"}]
    (s,) = sft_samples([Prompt(0, prompt, None, {"response": "7"})], tok, chat=True)
    assert tok.convert_ids_to_tokens(s.response_tokens[-1]) == end
    assert tok.decode(s.response_tokens) == "7" + end and s.loss_mask == [1] * len(s.response_tokens)
    conversation = [*prompt, {"role": "assistant", "content": "7"}]
    whole = encode_whole(tok, conversation, None)
    assert whole[: len(s.tokens)] == s.tokens  # the prompt + trained answer are what the template renders
