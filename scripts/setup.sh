#!/usr/bin/env bash
# Create .venv with everything the project needs. Torch is pinned first, to the build that pairs
# with a torchvision wheel (transformers' Qwen image/video processors need it); a bare `torch`
# requirement on a fresh machine may pull a different multi-GB build.
#
# The install runs only when .venv is missing or out of date: .venv/.raincheck-setup holds a hash of
# pyproject.toml and this script, written after a successful install, so a second call (chat.sh,
# demo.sh, test.sh) starts at once. RAINCHECK_SETUP=force reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.raincheck-setup
wanted=$(cat pyproject.toml scripts/setup.sh | "$PY" -c "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ] && [ "${RAINCHECK_SETUP:-}" != force ]; then
  echo "[setup] .venv is up to date (delete $STAMP or set RAINCHECK_SETUP=force to reinstall)" >&2
else
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  rm -f "$STAMP"
  echo "[setup] installing into .venv (torch, transformers, the demo, serve and test extras)..." >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
  # the package with its demo, serve and test extras: gradio + gradio_client, PyAV for video files,
  # fastapi + uvicorn for the server, pytest, nbclient, the openai client and httpx the server's
  # tests talk to it with, and Playwright's Python package (its own browser download is never used)
  .venv/bin/python -m pip install -q -e ".[demo,serve,test]"
  echo "$wanted" > "$STAMP"
fi
# the browser test drives Debian's Chromium; install it when missing and we may (root, apt)
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1; then
    echo "[setup] could not install chromium: tests/test_demo_browser.py will skip" >&2
  fi
fi
