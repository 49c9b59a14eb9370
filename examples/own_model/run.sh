#!/usr/bin/env bash
# Bring your own model: point furlong at a local Hugging Face directory, check its chat template
# for token-in/token-out, then train on it. Here the "own model" is a tiny random-weight Mistral
# built locally (no hub); with yours, skip step 1 and set MODEL to its directory.
#   bash examples/own_model/run.sh            (writes under runs/own_model/; OUT=DIR to change)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/own_model}
FURLONG=${FURLONG:-.venv/bin/furlong}
MODEL=${MODEL:-$OUT/model}

# 1. A local model directory: config.json, safetensors weights, tokenizer files with a chat template.
[ -e "$MODEL/config.json" ] || "$FURLONG" models create --arch mistral --size tiny --out "$MODEL"

# 2. Does the template keep a multi-turn, tool-using conversation append-only (what TITO needs)?
"$FURLONG" tito check "$MODEL"

# 3. Train on it: any recipe, with model.path pointing at the directory.
"$FURLONG" train recipes/debug.yaml "model.path=$MODEL" "run_dir=$OUT/run"
