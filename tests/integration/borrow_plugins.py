"""Plug points for `test_borrowed_cores.py`, imported by the trainer's Ray worker."""

from __future__ import annotations

import time

import torch

from furlong.train.threads import LEASE

LEND_WAIT_S = 120.0


def wait_for_lent_cores(step: int, batch) -> None:
    """`train.before_train_step`: hold the step open until the driver lends the engines' idle cores.

    The step starts on the split share (one thread); the engines generate the next window meanwhile, then
    have nothing to do, and the driver lends their cores: every micro-batch of this step then runs on them."""
    if torch.get_num_threads() != 1:
        raise AssertionError(f"step {step} started on {torch.get_num_threads()} threads, not the split share of 1")
    deadline = time.monotonic() + LEND_WAIT_S
    while not LEASE.lent:
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step}: no cores lent within {LEND_WAIT_S:.0f} s")
        time.sleep(0.01)
