"""Weight-sync bandwidth: every transport, trainer process → a real engine process, next to memcpy.

Two models: the locally built `m25` (~25.7M parameters) and a ~100M qwen3
built for this run in a temporary directory (random init, the m25
tokenizer). For each, one engine server runs as its own process
(`furlong serve`) and this process plays the trainer: it pushes the whole
model `--repeats` times per transport (alternating two weight sets, so every
push changes every tensor — the RL case; delta therefore sends everything and
pays for its checksums) and reports end-to-end GB/s: payload bytes / time
from the first byte written until the engine acknowledged the new version.
After each transport the engine's checksums are compared with the pushed
tensors (`weights.verify`), so a figure never comes from a broken sync.

The reference is this machine's memcpy, measured in the same run: a
model-sized torch copy into an already-touched buffer (best of 5), and a
copy into fresh memory (what a copy that must first fault its pages in costs).
p2p runs with one trainer rank here (it is then the shm path with p2p's
bookkeeping); its multi-rank form is exercised by tests/integration/test_weights_p2p.py.
`shm_resident` is the shm transport with the sending process's parameters resident in shared
memory (`weights/resident.py`, what a one-rank trainer does): the engine reads them in place,
so the sender copies nothing.

    python benchmarks/weight_sync.py [--models m25,100m] [--repeats 3] [--bucket-mb 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from furlong.core.net import free_port
from furlong.weights.factory import TRANSPORTS

VARIANTS = [*TRANSPORTS, "shm_resident"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402

TOKEN = "bench"


def memcpy_gbps(nbytes: int) -> tuple[float, float]:
    """(copy into a touched buffer, copy into fresh memory) in GB/s, best of 5 each."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    warm, fresh = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = src.clone()
        fresh.append(time.perf_counter() - t0)
        del out
    return nbytes / min(warm) / 1e9, nbytes / min(fresh) / 1e9


def build_100m(dest: Path) -> Path:
    """A ~104M-parameter qwen3 (hidden 768, 15 layers, FFN 2304) with the m25 tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from furlong.models import create_model
    from furlong.models.factory import Size, hf_config

    m25 = create_model("qwen3", "m25")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        hf_config("qwen3", Size(hidden=768, layers=15, heads=12, kv_heads=4, head_dim=64, ffn=2304)),
        dtype=torch.float32,
    )
    tok = AutoTokenizer.from_pretrained(m25)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def start_engine(model: Path, threads: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "FURLONG_ADMIN_TOKEN": TOKEN}  # never on the command line
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "furlong.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--kv-cache-mb",
            "16",
            "--threads",
            str(threads),
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine for {model} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"engine for {model} not healthy after 300 s")


def bench_model(name: str, path: Path, args, workdir: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from furlong.weights.checksums import verify
    from furlong.weights.factory import make_sender

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    sets = [{n: t.clone() for n, t in base.items()}, {n: t * 1.001 for n, t in base.items()}]
    del base
    residents = resident_sets(path) if "shm_resident" in args.transports else []
    size = sum(t.numel() * 4 for t in sets[0].values())
    params = sum(t.numel() for t in sets[0].values())
    print(f"[{name}] {params / 1e6:.1f}M parameters, {size / 1e6:.0f} MB fp32; starting the engine ...", flush=True)
    proc, url = start_engine(path, args.threads)
    rows, version = [], 0
    try:
        for transport in args.transports:
            opts = {"bucket_mb": args.bucket_mb}
            if transport == "disk":
                opts["directory"] = workdir / f"weights-{name}"
            sender = make_sender(transport.removesuffix("_resident"), **opts)
            sender.connect([url], TOKEN)
            rates = []
            try:
                for _ in range(args.repeats):
                    version += 1
                    if transport == "shm_resident":  # the engine reads these parameters in place
                        sender.resident = residents[version % 2][0]
                    pushed = residents[version % 2][1] if transport == "shm_resident" else sets[version % 2]
                    report = sender.push(pushed.items(), version)
                    rates.append(report.gbps)
                    print(f"  {report.summary()}", flush=True)
            finally:
                sender.close()
            verify([url], TOKEN, pushed.items())
            rows.append(
                {
                    "model": name,
                    "params_m": params / 1e6,
                    "mb": size / 1e6,
                    "transport": transport,
                    "best": max(rates),
                    "median": statistics.median(rates),
                }
            )
    finally:
        proc.terminate()
        proc.wait(30)
        for resident, _ in residents:
            resident.close()
    return rows


def resident_sets(path: Path) -> list[tuple[object, dict[str, torch.Tensor]]]:
    """Two weight sets (the model, and it x 1.001), each a model whose parameters are resident in shared
    memory: (ResidentWeights, its state dict)."""
    from transformers import AutoModelForCausalLM

    from furlong.weights.resident import ResidentWeights

    out = []
    for scale in (1.0, 1.001):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        resident = ResidentWeights.adopt(model)
        if resident is None:
            raise SystemExit("shm_resident: /dev/shm has no room for two copies of the model")
        out.append((resident, model.state_dict()))
    return out


def shm_anatomy(path: Path, bucket_mb: float) -> dict[str, float]:
    """GB/s of the pieces of an shm sync, in this process, no HTTP (best of 4 after a warm-up):

    - `write_fresh`: the sender's copy into new segments (pays the page faults);
    - `apply_fresh`: the engine's read of those (`tensors.shm_views` on a new mapping,
      copied straight into the parameters; the mapping's page faults are paid again);
    - `write_reused`: the sender's copy into reused segments (what ShmSender does after its first sync);
    - `apply_reused`: the engine's read of those, through its kept mapping (the shm path's steady state);
    - `sync`: write_reused + apply_reused back to back: the shm path without HTTP.
    """
    from transformers import AutoModelForCausalLM

    from furlong.weights.base import buckets, nbytes
    from furlong.weights.shm import unlink, write_segment
    from furlong.weights.tensors import shm_views, write_shm

    sd = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    params = {n: t.clone() for n, t in sd.items()}
    groups = buckets(list(sd.items()), int(bucket_mb * 2**20))
    total = sum(nbytes(t) for t in sd.values())
    best = {k: 0.0 for k in ("write_fresh", "apply_fresh", "write_reused", "apply_reused", "sync")}

    def timed(key: str, fn):
        t0 = time.perf_counter()
        out = fn()
        best[key] = max(best[key], total / (time.perf_counter() - t0) / 1e9)
        return out

    @torch.no_grad()
    def apply(handles) -> None:
        for h in handles:
            with shm_views(h) as views:
                for name, v in views.items():
                    params[name].copy_(v)

    free: list = []
    for _ in range(5):
        fresh = timed("write_fresh", lambda: [write_shm(dict(g), with_checksum=False) for g in groups])
        timed("apply_fresh", lambda fresh=fresh: apply([h for _, h in fresh]))
        for seg, _ in fresh:
            unlink(seg)
        if not free:  # first round: create (and fault in) the segments the later rounds reuse
            free = [write_segment(g, [], None, int(bucket_mb * 2**20))[0] for g in groups]
        t0 = time.perf_counter()
        segs = timed("write_reused", lambda free=free: [write_segment(g, free, None) for g in groups])
        timed("apply_reused", lambda segs=segs: apply([h for _, h in segs]))
        best["sync"] = max(best["sync"], total / (time.perf_counter() - t0) / 1e9)
        free = [s for s, _ in segs]
    for s in free:
        unlink(s)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="m25,100m", help="comma list of m25 and 100m")
    p.add_argument("--transports", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process and of the engine")
    args = p.parse_args(argv)
    args.transports = [t for t in args.transports.split(",") if t]
    bad = [t for t in args.transports if t not in VARIANTS]
    if bad:
        p.error(f"--transports: unknown {bad}; choose from {VARIANTS}")
    torch.set_num_threads(args.threads)
    _machine.header()
    from furlong.models import create_model

    workdir = Path(tempfile.mkdtemp(prefix="furlong-wsync-"))
    try:
        models = {}
        for m in args.models.split(","):
            if m == "m25":
                models[m] = create_model("qwen3", "m25")
            elif m == "100m":
                print("[100m] building a ~100M qwen3 in a temporary directory ...", flush=True)
                models[m] = build_100m(workdir / "qwen3-100m")
            else:
                p.error(f"--models: unknown model {m!r}; choose m25 or 100m")
        biggest = max(sum(f.stat().st_size for f in Path(d).glob("*.safetensors")) for d in models.values())
        warm, fresh = memcpy_gbps(biggest)
        rows = [r for name, path in models.items() for r in bench_model(name, path, args, workdir)]
        anatomy = shm_anatomy(next(iter(models.values())), args.bucket_mb)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"\nmemcpy ({biggest / 1e6:.0f} MB, {args.threads} thread): {warm:.2f} GB/s into touched memory, "
        f"{fresh:.2f} GB/s into fresh memory"
    )
    print(
        f"shm pieces ({next(iter(models))}, in-process, no HTTP), GB/s: "
        + ", ".join(f"{k} {v:.2f} ({v / warm:.0%} of memcpy)" for k, v in anatomy.items())
    )
    print("\n| model | params | MB | transport | GB/s best | GB/s median | best / memcpy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_m']:.1f}M | {r['mb']:.0f} | {r['transport']} | {r['best']:.3f} | "
            f"{r['median']:.3f} | {r['best'] / warm:.1%} |"
        )
    shm = [r["best"] / warm for r in rows if r["transport"] in ("shm", "shm_resident")]
    print("\nRATIO " + " ".join(f"{r['model']}_{r['transport']}_vs_memcpy={r['best'] / warm:.3f}" for r in rows))
    if shm:
        print(f"RESULT shm_vs_memcpy={max(shm):.3f} target=0.5 {'MET' if max(shm) >= 0.5 else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
