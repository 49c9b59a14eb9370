"""Training: the FSDP2 trainer, batching, optimiser, checkpoints, LoRA, export; the loss hub lives in `losses/`."""
