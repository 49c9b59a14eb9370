"""`furlong export`: checkpoints become HF directories that transformers loads, LoRA merged or not."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_train_trainer import MODEL, algo, samples  # noqa: E402

from furlong.cli import main as furlong  # noqa: E402
from furlong.config.schema import LoraConfig, TrainConfig  # noqa: E402
from furlong.train.trainer import Trainer  # noqa: E402

IDS = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_export_latest_full_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tr = Trainer(MODEL, TrainConfig(lr=1e-2), algo())
    run = tmp_path / "runs" / "demo"
    tr.train_step(samples(0))
    tr.save(run / "checkpoints" / "step_1")
    tr.train_step(samples(1))
    tr.save(run / "checkpoints" / "step_2")
    (run / "checkpoints" / "step_3").mkdir()  # an incomplete save (no meta.json) is skipped
    assert furlong(["export", str(run), "--hf", str(tmp_path / "out")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(_logits(exported), _logits(tr.policy), atol=0, rtol=0)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.encode("3 + 4") == AutoTokenizer.from_pretrained(MODEL).encode("3 + 4")
    assert furlong(["export", str(tmp_path / "nothing"), "--hf", str(tmp_path / "x")]) == 2
    assert furlong(["export", str(run), "--hf", str(tmp_path / "y"), "--merge-lora"]) == 2


def test_export_lora_merged_and_adapter(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(lr=1e-2, lora=LoraConfig(enabled=True, r=4, alpha=8))
    tr = Trainer(MODEL, cfg, algo())
    for s in range(2):
        tr.train_step(samples(s))
    ckpt = tr.save(tmp_path / "run" / "checkpoints" / "step_2")
    want = _logits(tr.policy)
    assert not torch.allclose(want, _logits(AutoModelForCausalLM.from_pretrained(MODEL)), atol=1e-4)

    assert furlong(["export", str(ckpt), "--hf", str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any(".lora_" in k for k in merged.state_dict())
    torch.testing.assert_close(_logits(merged), want, atol=1e-5, rtol=0)

    assert furlong(["export", str(ckpt), "--hf", str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL), tmp_path / "adapter")
    torch.testing.assert_close(_logits(adapted), want, atol=1e-5, rtol=0)
