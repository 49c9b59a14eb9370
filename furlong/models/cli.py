"""`furlong models create --arch A --size S [--max-positions N] [--template STYLE] --out DIR`."""

from __future__ import annotations

import argparse
import json

from furlong.models.factory import ARCHS, SIZES, create_model
from furlong.models.tokenizer import styles


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="furlong models")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="build a random-init model and its tokenizer locally (cached)")
    c.add_argument("--arch", choices=ARCHS, default="qwen3")
    c.add_argument("--size", choices=list(SIZES), default="tiny")
    c.add_argument("--out", default=None, help="directory to write (default: the cache directory)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--max-positions", type=int, default=2048, help="context length (RoPE positions)")
    c.add_argument(
        "--template", choices=list(styles()), default=None, help="chat-template style (default: the arch's family's)"
    )
    args = p.parse_args(argv)
    path = create_model(
        args.arch, args.size, args.out, args.seed, max_positions=args.max_positions, template=args.template
    )
    info = json.loads((path / "furlong_model.json").read_text())
    print(f"{path}  ({info['arch']}/{info['size']}, {info['parameters'] / 1e6:.2f}M parameters)")
    return 0
