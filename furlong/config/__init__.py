"""Typed run configuration, recipe loading with overrides, and the plug-point registry.

    from furlong.config import load_config
    cfg = load_config("recipes/grpo_arithmetic.yaml", ["rollout.n_samples_per_prompt=8"])
    cfg.save()                       # runs/<name>/config.yaml; load_config(that file) == cfg

See `schema.py` (sections and defaults), `checks.py` (derivations and contradictions),
`loader.py` (YAML, overrides, did-you-mean) and `registry.py` (plug points).
"""

from furlong.config.loader import load_config
from furlong.config.schema import Config, ConfigError

__all__ = ["Config", "ConfigError", "load_config"]
