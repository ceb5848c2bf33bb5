#!/usr/bin/env bash
# Fill .gpu-wheels/ (ignored by git) with the pure-Python wheels of tools/gpu-wheels.txt for Python 3.12 on
# x86-64 Linux, here where PyPI is reachable, so that the device call can carry them (about 1 MB).
#     tools/gpu_wheels.sh            # then: run the device call of docs/gpu.md, carry [".gpu-wheels"]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    --platform manylinux2014_x86_64 -d .gpu-wheels -r tools/gpu-wheels.txt
ls .gpu-wheels
