"""The trainer's CPU threads, raised mid-step while the rollout engines have nothing to compute.

`cluster.borrow_idle_cores` (async modes, cores split between trainer and engines): a trainer-bound
step leaves the engines idle once they have generated the next batch, and their cores with them. The
driver sees that moment (the buffer full of ended episodes, nothing in flight) and lends those cores
to the trainer (`TrainerActor.borrow_cores`, served on a thread of its own while the step runs); the
trainer takes them mid-step and gives them back when the step ends, before the engines
get work again. Asymmetric on purpose: the engines never compute beside a trainer on borrowed threads,
whose OpenMP barriers would wait for any thread that lost its core (docs/async.md#borrowed-cores).

Why between micro-batches and backward nodes: OpenMP's thread count is a setting of the thread that
starts a parallel region, read when it starts, so only the computing thread can change it, and only
between regions; the trainer checks the lease where it has control (each micro-batch's start, the
start of its backward pass, and before each node of that pass). A compiled layer (`train.compile`)
compiles once more for the second count (Dynamo guards the thread count, and Inductor writes it into its
kernels), then keeps both; a backward switched mid-way runs the products on the new count and the fused
elementwise kernels on the count its forward was compiled for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


class Lease:
    """One process's trainer threads: its own count, and the count lent to it until the driver takes it back."""

    def __init__(self) -> None:
        self.base = 0  # the threads the trainer has between lends (set at each step's start)
        self.lent = 0  # threads lent to the trainer's micro-batches (0: none); written by the control thread
        self.borrowed = 0  # micro-batches of the current step that ran on lent threads, wholly or in part
        self.armed = False  # a lend has come once: from then on a backward pass may take one mid-way

    def lend(self, threads: int) -> None:
        """Any thread: compute with `threads` from the next micro-batch (or backward node) on; 0 takes them back.

        The driver lends during a train step and takes back after it, having waited for the lend's answer,
        so a lend that reaches the rank just before its step starts still counts for that step, and none
        outlives it."""
        if threads < 0:
            raise ValueError(f"Lease.lend: threads must be >= 0, got {threads}")
        self.armed = True
        self.lent = threads

    @contextlib.contextmanager
    def step(self, base: int | None) -> Iterator[None]:
        """One train step on the computing thread: it starts and ends on `base` threads (None: as they are)."""
        self.borrowed = 0
        self.base = base or torch.get_num_threads()
        _set(self.base)
        try:
            yield
        finally:
            _set(self.base)

    def each(self, micro_batches: Iterable[T]) -> Iterator[T]:
        """The micro-batches, each started on the lent threads while there are any."""
        for item in micro_batches:
            _set(self.lent or self.base or torch.get_num_threads())
            self.borrowed += bool(self.lent)
            yield item

    def backward(self, loss: Tensor) -> None:
        """`loss.backward()`, taking a lend that arrives during it before the next autograd node runs.

        A micro-batch's backward is about two thirds of its compute, and a lend waits on average half a
        micro-batch for the next one to start: each node of the graph (a compiled layer's backward is one)
        checks the lease first, and a lend that came during the forward is taken before the backward starts.
        The checks cost a Python call a node, so only a lease that has been lent to before, and is not lent
        now, adds them."""
        if self.lent:  # lent during the forward
            self._take_mid_way(None)
        elif self.armed and loss.grad_fn is not None:
            for node in _nodes(loss.grad_fn):
                if node.next_functions:  # not a parameter's AccumulateGrad, which outlives the graph
                    node.register_prehook(self._take_mid_way)
        loss.backward()

    def _take_mid_way(self, grad_outputs: Any) -> None:
        if self.lent and torch.get_num_threads() != self.lent:
            torch.set_num_threads(self.lent)
            self.borrowed += 1


def _nodes(root: Any) -> Iterator[Any]:
    """Every node of an autograd graph, once."""
    seen, todo = {id(root)}, [root]
    while todo:
        node = todo.pop()
        yield node
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)


def _set(threads: int) -> None:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


LEASE = Lease()  # one trainer per process: the thread count is the process's computing thread's
