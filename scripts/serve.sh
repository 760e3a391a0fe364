#!/usr/bin/env bash
# Set up, then serve an OpenAI-compatible API at http://127.0.0.1:8000/v1 (offline). Without --model it
# serves the bundled glyph Qwen3-VL (it knows only the glyph-grid task's words). Each conversation's
# cache is kept between requests: a follow-up prefills only its new turn. Extra arguments go to
# `python -m raincheck_hf serve`: --model qwen3_5 | tiny | PATH, --host, --port, --api-key,
# --max-cache-gb, --media-root, --mode, --retention, ... (see docs/serving.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m raincheck_hf serve "$@"
