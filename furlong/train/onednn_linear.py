"""`train.onednn_linear`: on CPU the trainer's linears multiply through oneDNN, forward and backward.

Why: a linear's forward and both products of its backward (the input's gradient `g @ W`, the
weight's `g.T @ x`) are most of a training step, and `F.linear` / autograd's `mm` run them through
MKL's sgemm, which on the AMD EPYC machines here reaches half of what oneDNN does (`core/onednn.py`).
Measured on a 2-vCPU AMD EPYC with AVX-512, fp32, 2 threads, the `m25` model's shapes (2048 rows x
512 -> 1536 and back, 512 -> 512 / 256): forward 210-219 GFLOP/s through MKL, 458-494 through
oneDNN; input gradient 208-222 vs 428-495; weight gradient 199-221 vs 329-423. The weights are
multiplied as they are (plain `[out, in]`, not packed): they change every optimiser step, and
oneDNN reaches these figures on plain matrices at the trainer's row counts.

How: each plain `nn.Linear` of a model is switched to `OneDNNLinear` (a subclass, the same pattern as
`qat.py`: nothing is re-registered, so parameter names, state dicts, checkpoints, optimiser state,
FSDP2 sharding and PEFT's LoRA wrapping are those of the plain model). Its forward runs `_LinearFn`
(oneDNN forward, oneDNN backward) where that is exact to do, and `F.linear` otherwise: off the CPU,
under autocast (`train.mixed_precision=bf16` on one rank casts per op, which `F.linear` does), while
`torch.compile` traces (`train.compile`: Inductor picks its own kernels), for a dtype oneDNN rejects
(`core.onednn.available`) and for weights that are not plain tensors (a DTensor shard). QAT's
`Int4QATLinear` layers keep their own forward.

What changes: fp32 summation order, not the maths. Log-probs differ from `F.linear`'s by
reordering only (checked <= 1e-4, `tests/unit/test_onednn_linear.py`), and the same inputs give the
same results on every run, so resumed and sharded runs stay exact against runs of the same setting.
`auto` (the default) is on for CPU trainers on an x86 CPU not made by Intel (`core.onednn.mkl_slow_here`),
where MKL runs at half of oneDNN's rate; on Intel's CPUs MKL is as fast or faster at these shapes (3.49 s
against 3.94 s a step on the AMX Xeon, round 15), so `auto` keeps `F.linear` there; `true` forces it on,
`false` off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from furlong.core import onednn


class _LinearFn(torch.autograd.Function):
    """`x @ w.T + b` for a 2-D `x`, with all three products of forward and backward through oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return onednn.linear(x, w, b)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        want_x, want_w, want_b = ctx.needs_input_grad
        # Transposed views, not copies: oneDNN reads the strides itself, and on the m25 shapes the views
        # took 6.7 / 9.4 ms where contiguous copies took 7.4 / 10.1 ms (input / weight gradient).
        gx = onednn.linear(g, w.t()) if want_x else None  # g @ w: w.T as the [in, out] weight
        gw = onednn.linear(g.t(), x.t()) if want_w else None  # g.T @ x: x.T as the [in, N] weight
        gb = g.sum(0) if ctx.has_bias and want_b else None
        return gx, gw, gb


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or type(t) in (torch.Tensor, nn.Parameter)


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose CPU forward and backward multiply through oneDNN (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if not (
            x.device.type == "cpu"
            and x.dtype == w.dtype
            and (b is None or b.dtype == w.dtype)
            and _plain(w)
            and _plain(b)
            and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
            and onednn.available(w.dtype)
        ):
            return F.linear(x, w, b)
        y = _LinearFn.apply(x.reshape(-1, x.shape[-1]).contiguous(), w, b)
        return y.view(*x.shape[:-1], w.shape[0])


def wanted(setting: bool | str, device: torch.device) -> bool:
    """True: on a CPU trainer; "auto": there too where MKL is slow (`core.onednn.mkl_slow_here`); False: never
    (oneDNN multiplies CPU tensors only)."""
    if setting not in (True, False, "auto") or not isinstance(setting, (bool, str)):
        raise ValueError(f"train.onednn_linear: {setting!r} is not true, false or auto")
    if setting is False or device.type != "cpu":
        return False
    return setting is True or onednn.mkl_slow_here()


def apply(model: nn.Module, setting: bool | str, device: torch.device) -> int:
    """Switch every plain `nn.Linear` of `model` to `OneDNNLinear` in place where `setting` wants it on
    `device`; returns how many. Before FSDP2 sharding and after PEFT wrapping: both see `nn.Linear`s."""
    if not wanted(setting, device):
        return 0
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    for m in layers:
        m.__class__ = OneDNNLinear
    return len(layers)
