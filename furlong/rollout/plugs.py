"""The rollout manager's plug points: which keyword argument carries which `rollout` setting, and the check
that a setting the config gives is never silently ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from furlong.config.schema import RolloutConfig

# The manager's plug points: its keyword argument -> the `rollout` config field holding the dotted path.
# It never imports a path itself: the composition root (`furlong.driver.build.rollout_manager`) loads and
# checks them all at start and passes the functions; a path set in the config with no function given fails.
FN_ARGS = "generate_fn reward_fn group_reward_fn dynamic_filter_fn sample_filter_fn reward_post_fn eval_fn".split()
PLUG_ARGS = {**{f: f for f in FN_ARGS}, "buffer_factory": "buffer"}


class RolloutExhausted(RuntimeError):
    """The data source ran out before a full batch could be made."""


def check_given(config: RolloutConfig, given: dict[str, Any]) -> None:
    """A plug point set in the config but not given would silently do nothing: refuse it, naming the key."""
    for arg, field in PLUG_ARGS.items():
        path = getattr(config, field)
        if path is not None and given[arg] is None:
            raise ValueError(
                f"rollout.{field}: {path!r} is set but no {arg} was given; the composition root "
                "(furlong.driver.build.rollout_manager) loads the config's plug points and passes them"
            )
    if config.agent_fn is not None and given["generate_fn"] is None:
        raise ValueError(
            f"rollout.agent_fn: {config.agent_fn!r} is set but no generate_fn was given; pass the one "
            "that runs it (furlong.envs.agent.generate), as furlong.driver.build.rollout_manager does"
        )
