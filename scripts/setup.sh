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
  started=$SECONDS
  step() { echo "[setup] ($1/4, $((SECONDS - started)) s) $2" >&2; }
  if [ ! -x .venv/bin/python ]; then
    step 1 "creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
  else
    step 1 "reusing .venv (its stamp is missing or out of date)"
  fi
  rm -f "$STAMP"
  step 2 "upgrading pip"
  .venv/bin/python -m pip install -q --upgrade pip
  # the two big steps show pip's own progress (each download with its size), so a slow one is visible
  step 3 "torch 2.14.1 and torchvision 0.29.1: the largest download (on Linux with its CUDA libraries), minutes on a slow link"
  .venv/bin/python -m pip install --progress-bar on "torch==2.14.1" "torchvision==0.29.1"
  # the package with its demo, serve and test extras: gradio + gradio_client, PyAV for video files,
  # fastapi + uvicorn for the server, pytest, nbclient, the openai client and httpx the server's
  # tests talk to it with, and Playwright's Python package (its own browser download is never used)
  step 4 "raincheck_hf with its demo, serve and test extras (transformers, gradio, fastapi, pytest, ...)"
  .venv/bin/python -m pip install --progress-bar on -e ".[demo,serve,test]"
  echo "$wanted" > "$STAMP"
  echo "[setup] done in $((SECONDS - started)) s; the next call starts at once" >&2
fi
# the browser test drives Debian's Chromium; install it when missing and we may (root, apt)
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing Debian's chromium for the browser test (apt-get, a minute or two)..." >&2
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1; then
    echo "[setup] could not install chromium: tests/test_demo_browser.py will skip" >&2
  fi
fi
