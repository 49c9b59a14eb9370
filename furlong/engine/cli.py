"""`furlong serve`: load a model into the built-in engine and serve it over HTTP.

The admin token comes from ``--admin-token-file``, ``--admin-token`` or
``$FURLONG_ADMIN_TOKEN`` (see `engine.admin_token`: off loopback one is generated when none
is given; on loopback the open control endpoints are warned about).
"""

from __future__ import annotations

import argparse
import logging
import os


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="furlong serve", description="Serve a local HF model with the built-in engine.")
    p.add_argument("--model", required=True, help="local model directory (HF format)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "fp8", "mxfp8", "nvfp4", "int4"],
        help="hold the dense projections as codes + scales in this format (engine.quantization)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: cuda:0 when visible, else cpu)")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay decode steps as CUDA graphs, one per batch-size bucket (engine.cuda_graphs; CUDA only)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode and mixed steps (engine.compile): compiled once, then faster steps on CPU",
    )
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache budget in MiB")
    p.add_argument("--max-running", type=int, default=64, help="most sequences decoded together")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="most tokens (prompt + output) per request; default: the model's max positions",
    )
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="never reuse the KV of a cached prompt prefix (every prompt is computed in full)",
    )
    p.add_argument(
        "--backend", default="auto", choices=["auto", "native", "hf"], help="native fast path or generic HF fallback"
    )
    p.add_argument(
        "--admin-token",
        default=None,
        help="bearer token for control endpoints; visible to every local user in `ps`: prefer "
        "--admin-token-file or $FURLONG_ADMIN_TOKEN",
    )
    p.add_argument("--admin-token-file", default=None, metavar="PATH", help="file holding the admin token (mode 0600)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument(
        "--niceness", type=int, default=0, help="lower this engine's CPU priority by N (nice) before it computes"
    )
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not os.path.isdir(args.model):
        parser().error(f"--model: {args.model!r} is not a directory")
    logging.basicConfig(level=args.log_level.upper())
    from furlong.engine import admin_token

    try:
        token = admin_token.resolve("furlong serve", args.host, args.port, args.admin_token, args.admin_token_file)
    except ValueError as e:
        parser().error(str(e))
    if args.niceness:  # before any thread exists: every thread it starts inherits the priority
        os.nice(args.niceness)
    import torch
    import uvicorn

    from furlong.engine.engine import Engine
    from furlong.engine.server import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = Engine(
            args.model,
            dtype=args.dtype,
            kv_cache_mb=args.kv_cache_mb,
            max_running=args.max_running,
            block_size=args.block_size,
            backend=args.backend,
            max_context=args.max_context,
            prefix_cache=args.prefix_cache,
            device=args.device,
            cuda_graphs=args.cuda_graphs,
            compile_decode=args.compile,
            quantization=args.quantization,
        )
    except ValueError as e:
        parser().error(str(e))
    engine.start()
    app = create_app(engine, token)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
