"""`furlong doctor`: is this machine ready to run furlong?

Each check prints PASS / WARN / FAIL with what it found. FAIL means furlong cannot
run here (exit 1); WARN means an optional capability (GPU, SGLang, a browser for
dashboard tests) is missing, which is normal on a laptop.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REQUIRED = [
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "pydantic",
    "fastapi",
    "uvicorn",
    "httpx",
    "ray",
    "rich",
]
OPTIONAL = ["peft", "datasets", "tensorboard", "openai", "trl", "sglang", "wandb", "mlflow", "playwright"]


@dataclass
class Check:
    name: str
    status: str  # PASS | WARN | FAIL
    detail: str


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def check_packages() -> list[Check]:
    out = [Check("python", "PASS" if sys.version_info >= (3, 11) else "FAIL", sys.version.split()[0])]
    for pkg in REQUIRED:
        v = _version(pkg)
        out.append(Check(pkg, "PASS" if v else "FAIL", v or "not installed (run `make test` or `pip install -e .`)"))
    for pkg in OPTIONAL:
        v = _version(pkg)
        out.append(Check(pkg, "PASS" if v else "WARN", v or "not installed (optional)"))
    torch_v = _version("torch") or ""
    if torch_v and not torch_v.startswith("2.13.0"):
        out.append(Check("torch pin", "WARN", f"torch {torch_v}; constraints.txt pins 2.13.0"))
    return out


def check_threads() -> list[Check]:
    import torch

    cores = os.cpu_count() or 1
    omp = os.environ.get("OMP_NUM_THREADS")
    threads = torch.get_num_threads()
    status = "PASS" if threads <= cores else "WARN"
    return [Check("threads", status, f"{cores} cores, torch uses {threads} threads, OMP_NUM_THREADS={omp or 'unset'}")]


def check_devices() -> list[Check]:
    import torch

    out = []
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        out.append(Check("gpu", "PASS", names))
    else:
        out.append(Check("gpu", "WARN", "no CUDA device: CPU engines and gloo training (the laptop path)"))
    sglang = importlib.util.find_spec("sglang") is not None
    out.append(
        Check("sglang", "PASS" if sglang else "WARN", "importable" if sglang else "not installed: built-in engine only")
    )
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    out.append(Check("chromium", "PASS" if browser else "WARN", browser or "missing: dashboard browser tests need it"))
    return out


def check_ray(start: bool) -> list[Check]:
    if importlib.util.find_spec("ray") is None:
        return [Check("ray", "FAIL", "not installed")]
    if not start:
        return [Check("ray runtime", "PASS", "importable (use --ray to start a local cluster)")]
    import ray

    try:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        res = ray.cluster_resources()
        return [Check("ray runtime", "PASS", f"local cluster started: {res.get('CPU', 0):.0f} CPU")]
    except Exception as e:  # report, do not crash the doctor
        return [Check("ray runtime", "FAIL", f"{type(e).__name__}: {e}")]
    finally:
        ray.shutdown()


def check_run_dir(path: Path) -> list[Check]:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-") as f:
            f.write(b"ok")
        free = shutil.disk_usage(path).free / 2**30
        return [Check("run dir", "PASS" if free > 1 else "WARN", f"{path} writable, {free:.1f} GiB free")]
    except OSError as e:
        return [Check("run dir", "FAIL", f"{path}: {e}")]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="furlong doctor", description=__doc__)
    p.add_argument("--run-dir", default="runs", help="where runs are written (default: runs)")
    p.add_argument("--ray", action="store_true", help="also start and stop a local Ray cluster")
    args = p.parse_args(argv)
    checks = check_packages()
    if not any(c.status == "FAIL" and c.name == "torch" for c in checks):
        checks += check_threads() + check_devices()
    checks += check_ray(args.ray) + check_run_dir(Path(args.run_dir))
    colour = {"PASS": "green", "WARN": "yellow", "FAIL": "red"}
    try:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True)
        for c in checks:
            console.print(f"[{colour[c.status]}]{c.status}[/] {c.name:<14} {c.detail}")
    except ImportError:
        for c in checks:
            print(f"{c.status} {c.name:<14} {c.detail}")
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(f"doctor: {len(checks)} checks, {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0
