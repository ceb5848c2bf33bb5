#!/usr/bin/env bash
# The committed profile suite of this repo: measure the CPU profiles and regenerate the compare report under
# results/.
#   tools/run_profile_suite.sh            resume the results files (only missing or failed cases run)
#   tools/run_profile_suite.sh --fresh    start over (needed when the model changed, e.g. a trained bundle landed)
# Exit code: 0 when every step succeeded or only reported an unavailable backend (3), else the first failure's.
set -u
cd "$(dirname "$0")/.."
PROFILES=(cpu cpu-bf16 onnx-cpu)
status=0
RESULTS=()
for p in "${PROFILES[@]}"; do RESULTS+=("results/$p.json"); done
step() {
    echo "+ $*" >&2
    "$@"
    local rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 3 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}
for p in "${PROFILES[@]}"; do
    step lantern profile run --profile "$p" "$@"
done
step lantern profile compare "${RESULTS[@]}" --out results/report
exit $status
