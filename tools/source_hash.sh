#!/usr/bin/env bash
# One hash of the sources the op library is built from (csrc/ and setup.py), of their
# contents, so that it is the same in a clone, a work tree and a copy without .git.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
find csrc setup.py -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' -o -name 'setup.py' \) \
    -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
