#!/usr/bin/env bash
# The GPU check as one device call (docs/gpu.md): installs, offline and with no dependency resolution, the wheels
# of .gpu-wheels/ whose module the machine lacks (into $LANTERN_SITE, default /tmp/lantern-site), puts lantern
# and them on PYTHONPATH, then runs tools/gpu_check.py with the arguments given. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
site=${LANTERN_SITE:-/tmp/lantern-site}
missing=()
while read -r dist module; do  # a distribution and the module it provides
    python3 -c "import $module" 2>/dev/null || missing+=("$dist")
done <<'LIST'
platformdirs platformdirs
starlette starlette
uvicorn uvicorn
prometheus-client prometheus_client
httpx httpx
httpcore httpcore
h11 h11
anyio anyio
idna idna
certifi certifi
click click
typing-extensions typing_extensions
LIST
if ((${#missing[@]})); then  # its inputs refused (exit 2) before any section runs, as the check's own arguments
    [[ -d .gpu-wheels ]] || { echo "gpu_check.sh: ${missing[*]} missing here and no .gpu-wheels folder to install" \
        "them from; allowed: a call that carries .gpu-wheels (tools/gpu_wheels.sh fills it; docs/gpu.md)" >&2; exit 2; }
    echo "gpu_check.sh: installing ${missing[*]} from .gpu-wheels" >&2
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links .gpu-wheels \
        --target "$site" "${missing[@]}" || { echo "gpu_check.sh: .gpu-wheels or LANTERN_SITE=$site could not" \
        "provide ${missing[*]} (see above); allowed: the wheels tools/gpu-wheels.txt names, a writable" \
        "LANTERN_SITE" >&2; exit 2; }
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import lantern, platformdirs, starlette, uvicorn, prometheus_client, httpx" \
    || { echo "gpu_check.sh: lantern or a serve dependency does not import (see above)" >&2; exit 2; }
exec python3 tools/gpu_check.py "$@"
