"""INT4 quantisation-aware training (`train.qat=int4`): the policy's linears compute with fake-quantised weights.

Why: an INT4 rollout serves int4(W), not W, so a trainer computing with W scores samples under a policy
the engine never ran (the train/rollout log-prob gap). With QAT the forward uses
`fake_int4(W) = int4_dequantize(int4_quantize(W))`, the very functions of `furlong.weights.quant.formats`
(symmetric, groups of 128 along the input dim, scale = amax / 7, round half to even, q in [-8, 7]), so the
weights the trainer computes with are bit for bit those an INT4 engine would dequantise. The backward is a
straight-through estimator: dL/dW := dL/dfake_int4(W), handed unchanged to the master weight (the parameter,
in `train.dtype`), which the optimiser updates. With scale = amax / 7 no element is ever clipped, so the
plain STE and the clipped one are the same thing here.

Which layers: every `nn.Linear` except `lm_head`, the same set `quantize_model_linears` quantises on the
rollout side (its default skip list, tested equal). `lm_head` stays full precision because its error reaches
the log-probs undamped and weight-only INT4 recipes leave it out; embeddings are lookups, not matmuls (no
input dim to group along), and with tied weights they are lm_head. Fused MoE expert tensors (HF's 3-D
`experts.gate_up_proj`) are not `nn.Linear` and are left out on both sides alike. The reference model
(KL) gets the same treatment, so it is the initial policy as the rollout served it (KL starts at 0); the
critic is never synced to an engine and is not quantised.

How: each target layer's class is switched to `Int4QATLinear` (an `nn.Linear` subclass whose forward
fake-quantises). Nothing is re-registered, so parameter names, state dicts, checkpoints (the fp32 masters are
what they save and resume from), optimiser state and FSDP2 sharding are those of the plain model: FSDP2
all-gathers a block's masters before its forward and the fake-quantisation runs on the full weight. A
`torch.nn.utils.parametrize` parametrization would rename every weight to `...parametrizations.weight.original`.

What the engine gets: `sync_items` sends the fake-quantised weights (in the parameter dtype) under the plain
names, so an engine that serves them as they are (`engine.quantization=none`) computes exactly what training
saw, and an engine quantising them to INT4 at load gets back the same codes and scales: with fp32 weights,
re-quantising `fake_int4(W)` is the identity (tested; the scale round trip amax -> s = amax/7 -> 7·s -> s
was also checked once over every fp32 mantissa). In bf16, `bf16(q·s)` is what both the trainer's and an INT4 engine's
bf16 forward use, but re-quantising bf16 values need not return the same scales.

LoRA + QAT is refused (config checks and `check_lora`): the rollout would quantise the merged W + B·A, which a
fake-quantised base plus a full-precision adapter does not equal. torchao's QAT is not used: its int4
fake-quantiser is asymmetric (zero points), so it could not match `weights.quant`'s format bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from furlong.weights.quant.formats import INT4_GROUP, int4_dequantize, int4_quantize

QAT_MODES = ("none", "int4")
SKIP = ("lm_head",)  # = quantize_model_linears' default skip: the rollout side keeps the same layers


def fake_int4(w: Tensor, group: int = INT4_GROUP) -> Tensor:
    """`int4_dequantize(int4_quantize(w))` in `w`'s dtype (no gradient); non-finite elements pass through.

    NaN/inf are kept as they are (the quantiser would turn them into arbitrary codes), so a diverged weight
    still makes the loss non-finite and the trainer skips that step instead of training on garbage.
    """
    with torch.no_grad():
        enc = int4_quantize(w.detach().float(), group)
        out = int4_dequantize(enc.data, enc.scales, group, tuple(w.shape), slice(None)).to(w.dtype)
        return torch.where(torch.isfinite(w), out, w)


class _StraightThrough(torch.autograd.Function):
    """Forward: fake_int4(w). Backward: the gradient w.r.t. the fake-quantised weight, unchanged."""

    @staticmethod
    def forward(ctx, w: Tensor, group: int) -> Tensor:
        return fake_int4(w, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def int4_ste(w: Tensor, group: int = INT4_GROUP) -> Tensor:
    """fake_int4(w) with a straight-through gradient to `w`."""
    return _StraightThrough.apply(w, group)


class Int4QATLinear(nn.Linear):
    """An nn.Linear computing `x @ fake_int4(W).T + b` (bias in full precision, as INT4 weight-only keeps it)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, int4_ste(self.weight), self.bias)


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    """Whole dotted components, as the rollout side matches them: "lm_head" skips "lm_head", not "lm_head_x"."""
    return any(f".{s}." in f".{name}." for s in skip)


def apply_qat(model: nn.Module, mode: str, skip: tuple[str, ...] = SKIP) -> list[str]:
    """Make every `nn.Linear` of `model` (bar `skip`) fake-quantise its weight; return their module names.

    `mode` is `train.qat`: "none" changes nothing. Raises ValueError for an unknown mode, or for a layer that
    is a *subclass* of nn.Linear (its own forward would be lost; the rollout side would quantise it anyway).
    """
    if mode not in QAT_MODES:
        raise ValueError(f"train.qat: unknown mode {mode!r}; choose one of {list(QAT_MODES)}")
    if mode == "none":
        return []
    names = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or _skipped(name, skip) or type(m) is Int4QATLinear:
            continue
        if type(m) is not nn.Linear:
            raise ValueError(f"train.qat={mode}: {name} is a {type(m).__name__}, not a plain nn.Linear")
        m.__class__ = Int4QATLinear
        names.append(name)
    return names


def check_lora(mode: str, lora_enabled: bool) -> None:
    """Refuse LoRA with QAT (the config checks do too; this covers a Trainer built directly)."""
    if mode != "none" and lora_enabled:
        raise ValueError(
            f"train.qat={mode} with train.lora.enabled=true is not supported: the rollout would quantise the "
            "merged W + B·A, which a fake-quantised base plus a full-precision adapter does not equal"
        )


def sync_items(model: nn.Module, items: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The (name, full tensor) stream for the engines, with each QAT layer's weight fake-quantised.

    Names are the model's own (for an HF model, its HF names); a model without QAT layers passes through.
    """
    names = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Int4QATLinear)}
    for name, t in items:
        yield name, (fake_int4(t) if name in names else t)
