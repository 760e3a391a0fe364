#!/usr/bin/env bash
# Set up, then start the Gradio demo at http://127.0.0.1:7860 (offline). Without --model it runs the
# bundled glyph Qwen3-VL, trained on the project's glyph-grid benchmark: its examples are glyph grids
# with benchmark questions, and it knows only that task's words. Extra arguments go to
# `python -m demo.app`: --model qwen3_5 | tiny (random weights, says so) | PATH_OR_HUB_ID, --host,
# --port, --share (a public link, off unless asked), --slow-motion-ms.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m demo.app "$@"
