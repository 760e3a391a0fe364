#!/usr/bin/env bash
# Set up, then run the test suite (CPU; GPU-only tests skip without CUDA). -rs ends the run with
# the reason of every skip (e.g. "needs CUDA"), grouped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The test files run on up to 4 worker processes, one per core (pytest-xdist; a file stays on one worker, so its
# module fixtures are built once); pass -n 0 to run them in this process, one after another.
exec .venv/bin/python -m pytest tests -q -rs -n auto --maxprocesses 4 --dist loadfile "$@"
