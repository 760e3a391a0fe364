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
# the demo and its tests (pyproject's `demo` and `test` extras): gradio + gradio_client, PyAV for
# video files, and Playwright's Python package (its own browser download is never used)
.venv/bin/python -m pip install -q "gradio>=6,<7" "gradio_client>=1.3" "av>=12" "playwright>=1.40"
# the server (pyproject's `serve` extra) and what its tests talk to it with
.venv/bin/python -m pip install -q "fastapi>=0.110" "uvicorn>=0.29" "openai>=1.40" "httpx>=0.27"
# the browser test drives Debian's Chromium; install it when missing and we may (root, apt)
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1; then
    echo "[setup] could not install chromium: tests/test_demo_browser.py will skip" >&2
  fi
fi
