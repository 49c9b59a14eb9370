"""Plug points used by test_driver_hooks.py (imported by dotted path, like a user's module)."""

CALLS: list[tuple[int, str]] = []


def shift_rewards(samples):
    """reward post-process: every reward becomes 0.5 + its sample's index parity / 4."""
    return [0.5 + (s.index % 2) / 4 for s in samples]


def record_save(step, path):
    CALLS.append((step, path))


def raising_loss(algo, logprobs, old_logprobs, advantages, mask):
    """train.loss_fn that always raises: the run must fail naming the setting."""
    raise RuntimeError("loss exploded on purpose")
