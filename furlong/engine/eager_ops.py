"""Opaque operators of the compiled steps: Python functions a compiled graph calls as they are, when it runs.

Why: a compiled step cannot trace everything it runs — a projection reads whatever weights the model
holds at that moment (`compiled_step.proj_op`), the decode attention is a C kernel behind ctypes
(`rows_kernel.attend_rows`), routed experts group tokens by data (`compiled_step.experts_op`). Each is
an operator `furlong::<name>` with a fake (shape-only) kernel for tracing and the Python function as
its kernel for every device.

Why not `torch.library.custom_op`, which does the same in one decorator: its per-call wrapper (a frame
with Dynamo disabled, an autograd shim that runs Python under `no_grad`, an aliasing check of every
output) cost ~10 us a call on the 2-vCPU Xeon with AMX, where an operator defined on a
`torch.library.Library` with a CompositeExplicitAutograd kernel costs ~2.5 us (an op returning a fresh
tensor, `no_grad`). A bf16 decode step of the benchmark's model calls 41 of them (33 projections, 8
attentions): ~0.3 ms of a ~10 ms step. What the shim and the check guarded is kept by construction:
these functions never take part in autograd (the engine runs under `no_grad`), and each returns a
tensor it made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("furlong", "FRAGMENT")  # noqa: TOR901 - held for the process's lifetime


def op(name: str, schema: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Decorator: define `furlong::<name><schema>` with the decorated function as its kernel and `fake` as
    its shape function; returns the operator (call it like the function)."""

    def define(fn: Callable) -> Callable:
        _LIB.define(f"{name}{schema}")
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"furlong::{name}", fake, lib=_LIB)
        return getattr(torch.ops.furlong, name).default

    return define
