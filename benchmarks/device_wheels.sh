#!/usr/bin/env bash
# The wheels the GPU runs of benchmarks/h200_run.sh carry in .whl/ (git-ignored): the package's own pins and the
# server tests' clients at the versions .venv holds, for CPython 3.12 on manylinux x86-64 (the GPU machine's Python),
# with transformers slimmed to the model folders the package imports (benchmarks/slim_wheel.py; the full wheel is
# kept in .whl_spare/). The GPU machine has torch, triton, huggingface_hub, tokenizers, safetensors and numpy of its
# own; those are not carried. Needs .venv (bash scripts/setup.sh) and PyPI.
#
#   bash benchmarks/device_wheels.sh        # then carry [".whl"] and start the command with h200_run.sh's install
#   SPY=1 bash benchmarks/device_wheels.sh  # with py-spy too (serve_load SPY=1); the tree may then exceed the carry limit
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "needs .venv: bash scripts/setup.sh" >&2; exit 1; }
version() { .venv/bin/python -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
want=()
for name in transformers fastapi starlette uvicorn pydantic pydantic_core annotated-doc opentelemetry-api openai \
            httpx2 httpcore2 truststore typing-inspection jiter anyio sniffio h11 typing_extensions python-multipart \
            annotated-types click idna; do
    v=$(version "$name")
    [ -n "$v" ] || { echo "$name is not in .venv" >&2; exit 1; }
    want+=("$name==$v")
done
want+=("fla-core==0.6.0" "flash-linear-attention==0.6.0")  # the GPU path's Gated DeltaNet kernels (pyproject's [gpu])
rm -rf .whl && mkdir -p .whl .whl_spare
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${want[@]}"
.venv/bin/python benchmarks/slim_wheel.py .whl/transformers-*.whl
mv .whl/*.full .whl_spare/ 2>/dev/null || true
# py-spy (a sampling profiler of every thread: h200_run.sh serve_load SPY=1, benchmarks/spy_summary.py) only when asked:
# its 2.9 MB put the working tree and .whl/ together past the device tool's 64 MiB carry limit
if [ -n "${SPY:-}" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux1_x86_64 -d .whl "py-spy==0.4.3"
fi
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
