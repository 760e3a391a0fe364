#!/usr/bin/env bash
# The main job: set up, then a multi-turn CLI chat. Without --model it runs offline on a tiny
# Qwen3-VL built in code (random weights, says so). Extra arguments go to `python -m raincheck_hf chat`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
  set -- --question "What is in this image?" --question "What colour is the top-left corner?"
fi
exec .venv/bin/python -m raincheck_hf chat "$@"
