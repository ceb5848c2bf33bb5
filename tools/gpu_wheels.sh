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
# what the device call carries: tracked and untracked-not-ignored files, and the wheels (docs/gpu.md)
limit=$((64 * 1024 * 1024))
travels=$({ git ls-files -z --cached --others --exclude-standard; find .gpu-wheels -type f -print0; } \
    | xargs -0 stat -c %s -- 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
echo "gpu_wheels.sh: the working tree the device call carries, wheels included: $((travels / 1024 / 1024)) MiB of $((limit / 1024 / 1024)) MiB"
if ((travels > limit)); then
    echo "gpu_wheels.sh: over the device tool's 64 MiB: ignore or remove untracked files, or shrink what is tracked" >&2
    exit 1
fi
