#!/usr/bin/env bash
# Create .venv with everything the project needs (idempotent). Torch is pinned first, to the
# build that pairs with a torchvision wheel (transformers' Qwen image/video processors need it);
# a bare `torch` requirement on a fresh machine may pull a different multi-GB build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install -q -e ".[test]"
