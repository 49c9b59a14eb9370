"""The trainer's plug points, as resolved callables: what the composition root hands the trainer.

The config names plug points by dotted path (`train.loss_fn: my_pkg.losses:my_loss`);
the driver's composition root resolves and checks every path once, at start
(`furlong.config.registry.load_all`), and passes the functions here. The trainer
never imports a path itself, so a typo fails before any process starts, and a test
can hand the trainer a lambda.

`None` means "the algorithm's built-in": the estimator, correction and reducer that
`algo.advantage`, `algo.correction` and `algo.loss_reducer` name, the PPO clipped
surrogate, `TrainBatch.from_samples`, and no hook. Each function is called exactly as
its Protocol in `furlong.config.registry` says. A user function that raises is reported
as a `PlugPointFailed` naming its config key, so a failing run says *which* setting broke.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from furlong.config.protocols import AdvantageFn, BeforeTrainStepFn, ConvertFn, CorrectionFn, LossFn, ReducerFn


class PlugPointFailed(RuntimeError):
    """A plug-point function raised; names the config key and the function, chained to the original error."""

    def __init__(self, key: str, fn: Callable[..., Any], error: BaseException):
        self.key, self.fn, self.error = key, fn, error
        where = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        super().__init__(f"{key} ({where}) raised {type(error).__name__}: {error}")


@dataclass
class TrainerHooks:
    """Resolved trainer plug points (field name = the key under `train.` in the config); None = built in."""

    loss_fn: LossFn | None = None
    advantage_fn: AdvantageFn | None = None
    correction_fn: CorrectionFn | None = None
    reducer_fn: ReducerFn | None = None
    convert_fn: ConvertFn | None = None
    before_train_step: BeforeTrainStepFn | None = None

    def named(self) -> TrainerHooks:
        """A copy whose every function reports its failures as `PlugPointFailed` naming `train.<field>`."""
        return TrainerHooks(**{f.name: _named(f"train.{f.name}", getattr(self, f.name)) for f in fields(self)})


def _named(key: str, fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
    if fn is None:
        return None

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PlugPointFailed:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised, naming the setting that supplied the function
            raise PlugPointFailed(key, fn, e) from e

    functools.update_wrapper(call, fn, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    return call
