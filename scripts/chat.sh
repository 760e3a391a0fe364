#!/usr/bin/env bash
# The main job: set up, then a multi-turn CLI chat, offline. Without arguments it runs the bundled
# glyph Qwen3-VL (trained on the project's glyph-grid benchmark) on a dev-split glyph grid and asks
# that dialogue's first two questions, printing each answer, the reference and Raincheck's figures
# (selected / deferred, restored during and after the answer, TTFT). Extra arguments go to
# `python -m raincheck_hf chat`: --model qwen3_5 (the bundled glyph Qwen3.5), --model tiny (random
# weights, says so), --model PATH (a real checkpoint), --dialogue N, --mode hard, --interactive, ...
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m raincheck_hf chat "$@"
