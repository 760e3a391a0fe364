#!/usr/bin/env bash
# Set up, then start the Gradio demo at http://127.0.0.1:7860 (offline; without --model it runs the
# bundled tiny Qwen3-VL with random weights, and says so). Extra arguments go to `python -m demo.app`:
# --model PATH_OR_HUB_ID, --host, --port, --share (a public link, off unless asked), --slow-motion-ms.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m demo.app "$@"
