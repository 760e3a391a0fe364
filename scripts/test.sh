#!/usr/bin/env bash
# Set up, then run the test suite (CPU; GPU-only tests skip without CUDA). -rs ends the run with
# the reason of every skip (e.g. "needs CUDA"), grouped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q -rs "$@"
