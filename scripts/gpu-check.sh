#!/usr/bin/env bash
# The GPU check, for one GPU machine (made for one H200: PyTorch 2.11 + CUDA 13, transformers 5.17, no Ray,
# no network), in under 8 minutes. Writes the figures to $GPU_CHECK_OUT (default gpu-check.json in the
# repository root): engine greedy vs HF and the log-prob gap, engine tokens/s vs HF generate (~0.5B Qwen3-shaped
# random model, batch 64, 256 new tokens), weight-sync GB/s over CUDA IPC (and NCCL with a second GPU) against
# device-to-device copy bandwidth, 5 GRPO steps with trainer and engine in separate processes, and decode
# tokens/s with and without engine.cuda_graphs (tests/gpu/gpu_check.py says how each is measured). Then runs the gpu-marked tests in tests/gpu when pytest is
# installed. Exit status: 0 when every step passed its check.
#
#   GPU_CHECK_TINY=1 scripts/gpu-check.sh     the same steps on CPU with the tiny model: proves the script runs
#                                             (its speed figures mean nothing; the cuda_graphs arm is
#                                             skipped there, its reason printed and recorded)
#
# Packages the GPU machine lacks (fastapi, uvicorn, pydantic, httpx, pyyaml, ...) are installed with no network
# from .gpu-wheels/ when that folder exists: fill it here with scripts/gpu-wheels.sh and let it travel with the tree.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${GPU_CHECK_TINY:-}" ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-gpu-check.json}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
missing=$("$PY" -c '
import importlib.util as u
need = {"fastapi": "fastapi", "uvicorn": "uvicorn", "pydantic": "pydantic", "httpx": "httpx", "yaml": "pyyaml",
        "safetensors": "safetensors", "transformers": "transformers"}
print(" ".join(pkg for mod, pkg in need.items() if u.find_spec(mod) is None))')
if [ -n "$missing" ]; then
  if [ -d .gpu-wheels ]; then
    echo "gpu-check: installing $missing from .gpu-wheels/ (no network)"
    "$PY" -m pip install -q --no-index --find-links .gpu-wheels $missing || { echo "gpu-check: install failed" >&2; exit 2; }
  else
    echo "gpu-check: missing Python packages: $missing (fill .gpu-wheels/ with scripts/gpu-wheels.sh)" >&2; exit 2
  fi
fi
tiny=(); [ -n "${GPU_CHECK_TINY:-}" ] && tiny=(--tiny)
timeout 380 "$PY" tests/gpu/gpu_check.py --out "$OUT" "${tiny[@]}"
rc=$?
echo "gpu-check: figures in $OUT (exit $rc)"
if [ -z "${GPU_CHECK_TINY:-}" ]; then
  if "$PY" -c 'import pytest' 2>/dev/null; then
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts= -m gpu -rs tests/gpu | tee "${OUT%.json}-tests.txt"
    trc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] && rc=$trc
  else
    echo "gpu-check: pytest not installed: tests/gpu not run" | tee "${OUT%.json}-tests.txt"
  fi
fi
exit "$rc"
