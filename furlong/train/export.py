"""`furlong export RUN_DIR --hf OUT`: a training checkpoint → a directory `transformers` loads.

RUN_DIR may be a run directory (its newest complete `checkpoints/step_<n>/` is
used) or one checkpoint directory. The checkpoint is self-contained (its `hf/`
holds the config and tokenizer), so export needs neither the base model's
directory nor a process group: DCP loads the sharded weights in one process.
LoRA runs export the adapter alone (PEFT format, loadable on the base), or with
`--merge-lora` a plain model with the adapters folded in.

Export reads whatever directory it is pointed at, so it unpickles nothing: the DCP
metadata goes through `checkpoint.dcp_reader`'s allowlist and its tensors through
`weights_only` loads; a checkpoint holding anything else is refused, naming the file.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from furlong.train import checkpoint


def resolve(path: str | Path) -> Path:
    """The checkpoint directory meant by `path` (a checkpoint, or a run directory)."""
    path = Path(path)
    if (path / checkpoint.META).exists():
        return path
    found = checkpoint.latest(path)
    if found is None:
        raise FileNotFoundError(
            f"{path}: neither a checkpoint (no {checkpoint.META}) "
            "nor a run directory with a complete checkpoints/step_<n>/"
        )
    return found


def export(ckpt: str | Path, out: str | Path, merge_lora: bool = False) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from furlong.train.lora import apply_lora

    ckpt, out = Path(ckpt), Path(out)
    meta = checkpoint.read_meta(ckpt)
    hf = ckpt / "hf"
    dtype = getattr(torch, meta["dtype"])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf), dtype=dtype)
    lora = meta.get("lora")
    adapters = (lora or {}).get("adapters") or []
    if lora and merge_lora and len(adapters) > 1:
        raise ValueError(
            f"--merge-lora: {ckpt} holds {len(adapters)} adapters ({', '.join(adapters)}); one base cannot fold "
            "them all in — export without --merge-lora (one PEFT adapter folder per adapter)"
        )
    if lora:
        model = apply_lora(model, lora, adapters)
    elif merge_lora:
        raise ValueError(f"--merge-lora: {ckpt} is not a LoRA checkpoint (meta.json lora is null)")
    state = {"policy": get_model_state_dict(model)}
    dcp.load(state, storage_reader=checkpoint.dcp_reader(ckpt / "dcp"), no_dist=True)
    set_model_state_dict(model, state["policy"])
    out.mkdir(parents=True, exist_ok=True)
    if lora and merge_lora:
        model = model.merge_and_unload()
    elif lora:
        for adapter_cfg in model.peft_config.values():
            adapter_cfg.base_model_name_or_path = meta["model_dir"]
    model.save_pretrained(out)
    # Config, generation config and tokenizer files; never overwrite what save_pretrained wrote.
    for f in hf.iterdir():
        if not (out / f.name).exists() and not (lora and not merge_lora and f.name == "config.json"):
            shutil.copy2(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="furlong export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory or one checkpoint directory")
    parser.add_argument("--hf", required=True, metavar="OUT", help="output directory for the HF model")
    parser.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the weights")
    args = parser.parse_args(argv)
    try:
        ckpt = resolve(args.run_dir)
        out = export(ckpt, args.hf, args.merge_lora)
    except (FileNotFoundError, ValueError) as e:
        print(f"furlong export: {e}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
