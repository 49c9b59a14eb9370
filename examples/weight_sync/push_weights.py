"""Push new weights into running engines, as the trainer does after every step.

`make_sender(transport)` hides how the bytes travel (`shm`: shared memory on one node;
`delta`: only tensors whose checksum changed; `broadcast`: a torch.distributed group;
`p2p`: each trainer shard to every engine; `disk`: safetensors files). Every transport
checks the whole update against the engine's parameter names and shapes before the
first byte moves, stamps the new weight version once, after the last bucket, and with
`verify=True` compares the engine's CRC32 of every tensor with what was sent.

    furlong models create --arch qwen3 --size tiny            # prints DIR
    FURLONG_ADMIN_TOKEN=T furlong serve --model DIR --port 30001 &
    python examples/weight_sync/push_weights.py --engine http://127.0.0.1:30001 \
        --admin-token T --weights DIR2 --transport shm --version 1

where DIR2 is any checkpoint of the same architecture (e.g. `create_model("qwen3", "tiny", seed=1)`).
"""

from __future__ import annotations

import argparse

from transformers import AutoModelForCausalLM

from furlong.weights import SyncReport, make_sender


def push(
    engine_urls: list[str],
    admin_token: str,
    weights_dir: str,
    version: int,
    transport: str = "shm",
    pause_mode: str = "retract",
    **opts,
) -> SyncReport:
    """Load `weights_dir` and push it to every engine as `version`; returns what each engine did."""
    named = AutoModelForCausalLM.from_pretrained(weights_dir).state_dict()
    with make_sender(transport, verify=True, **opts) as sender:
        sender.connect(engine_urls, admin_token)
        # retract: requests in flight are requeued and recomputed on the new weights
        report = sender.push(named.items(), version, pause_mode=pause_mode)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="append", required=True, help="engine base URL (repeat for more)")
    p.add_argument("--admin-token", required=True, help="the engines' admin token")
    p.add_argument("--weights", required=True, help="a local HF model directory of the same architecture")
    p.add_argument(
        "--transport",
        default="shm",
        choices=["shm", "delta", "disk"],
        help="broadcast and p2p need a torch.distributed group: the trainer sets those up",
    )
    p.add_argument("--directory", help="disk transport: where the safetensors files are written")
    p.add_argument("--version", type=int, default=1)
    args = p.parse_args()
    opts = {"directory": args.directory} if args.transport == "disk" else {}
    print(push(args.engine, args.admin_token, args.weights, args.version, args.transport, **opts).summary())


if __name__ == "__main__":
    main()
