#!/usr/bin/env bash
# Fill .gpu-wheels/ with the wheels scripts/gpu-check.sh needs on a GPU machine that has PyTorch and transformers but
# no network: furlong's server and config dependencies (and pytest for tests/gpu), for that machine's Python.
#   scripts/gpu-wheels.sh [PYTHON_VERSION]      e.g. 3.12 (default: this interpreter's); x86-64 Linux wheels
# The folder is kept out of git (.git/info/exclude) and travels with the working tree (a few MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VER=${1:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
grep -qx '/.gpu-wheels/' .git/info/exclude 2>/dev/null || echo '/.gpu-wheels/' >> .git/info/exclude
"$PY" -m pip download -q -d .gpu-wheels --only-binary=:all: --platform manylinux2014_x86_64 --python-version "$VER" \
  fastapi uvicorn pydantic httpx pyyaml pytest pytest-timeout
du -sh .gpu-wheels
