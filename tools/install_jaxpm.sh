#!/usr/bin/env bash
# Install the pinned JaxPM reference stack (CPU) into $PYTHON's environment.
# Idempotent: returns in well under a second when every pin is already installed.
# Usage: bash tools/install_jaxpm.sh   (PYTHON=python3 by default)
set -euo pipefail
PYTHON="${PYTHON:-python3}"
REQ="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/jaxpm-requirements.txt"

# Fast path: every pinned distribution present at exactly its pinned version.
if "$PYTHON" - "$REQ" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
ok = True
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, pin = line.split("==")
    try:
        ok &= version(name) == pin
    except PackageNotFoundError:
        ok = False
sys.exit(0 if ok else 1)
PY
then
    echo "install_jaxpm: pinned JaxPM stack already installed"
    exit 0
fi

# Record torch before, and make sure pip neither replaces nor adds one.
TORCH_BEFORE="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)"
"$PYTHON" -m pip install --disable-pip-version-check -r "$REQ"
TORCH_AFTER="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)"
if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then
    echo "install_jaxpm: torch changed ($TORCH_BEFORE -> $TORCH_AFTER); this must not happen" >&2
    exit 1
fi
echo "install_jaxpm: installed the pinned JaxPM stack"
