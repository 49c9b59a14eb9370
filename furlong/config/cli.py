"""`furlong config show RECIPE [key=value ...]` and `furlong plugins [--markdown]`.

`config show` prints the resolved config exactly as a run would save it to
`runs/<name>/config.yaml`, so a user sees every derived value (presets, the
fourth batch field, staleness) before spending an hour on a run. A bad config
exits 2 with the problem list and no traceback.
"""

from __future__ import annotations

import argparse
import sys

from furlong.config.loader import load_config
from furlong.config.schema import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="furlong config", description="inspect a run's resolved config")
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config of RECIPE with overrides applied")
    show.add_argument("recipe", nargs="?", help="a YAML recipe; '-' or omitted: defaults only")
    show.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. rollout.n_samples_per_prompt=8"
    )
    show.add_argument("--plugins", action="store_true", help="also import and check every plug point the config names")
    args = parser.parse_args(argv)
    recipe = args.recipe
    overrides = list(args.overrides)
    if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        overrides.insert(0, recipe)  # `furlong config show a.b=1`: no recipe, only overrides
        recipe = None
    try:
        cfg = load_config(None if recipe in (None, "-") else recipe, overrides)
        if args.plugins:
            from furlong.config.registry import load_all

            load_all(cfg)
    except ConfigError as e:
        print(f"furlong config: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(cfg.to_yaml())
    return 0


def plugins_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="furlong plugins", description="list every plug point and its signature")
    parser.add_argument("--markdown", action="store_true", help="print the docs page (docs/plug-points.md)")
    args = parser.parse_args(argv)
    from furlong.config.registry import PLUG_POINTS, markdown

    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    width = max(len(p.key) for p in PLUG_POINTS)
    print(f"{len(PLUG_POINTS)} plug points (config key, signature, default):")
    for p in PLUG_POINTS:
        print(f"\n{p.key:<{width}}  {p.signature()}")
        print(f"{'':<{width}}  {p.doc}")
        print(f"{'':<{width}}  default: {p.default or '-'}" + (f"; offered: {', '.join(p.offers)}" if p.offers else ""))
    return 0
