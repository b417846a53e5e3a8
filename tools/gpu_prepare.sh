#!/usr/bin/env bash
# Prepares, on this machine, what a GPU session carries (tools/gpu_session.sh), so that
# no device minute goes into building or fetching:
#   .gpuso/libtorchpm_ops.so  the library with its CUDA kernels (sm_90), built against the
#                             GPU machine's torch (2.11.0+cu130) by tools/compat_build.sh;
#   .whl/                     JaxPM 0.1.6, jax-cosmo 0.1.0 and jaxdecomp 0.3.4 wheels for
#                             Python 3.12 (the GPU machine has jax 0.11 but not these).
# Both folders are added to .git/info/exclude. Then, per device call:
#   carry [".gpuso", ".whl"], command `bash tools/gpu_session.sh PHASE` (64 MiB in all;
#   `first` runs without JaxPM: carry [".gpuso"] alone).
#
#   bash tools/gpu_prepare.sh [WORKDIR]     # make gpu-prepare
set -u -o pipefail
repo=$(git rev-parse --show-toplevel)
work=${1:-${TMPDIR:-/tmp}/torchpm-torch-2.11.0}
python=${PYTHON:-python3}
cd "$repo" || exit 1
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for folder in /.gpuso/ /.whl/; do
    grep -qxF "$folder" "$exclude" 2>/dev/null || echo "$folder" >>"$exclude"
done

command -v nvcc >/dev/null 2>&1 || { echo "gpu_prepare: nvcc not found: the library would have no CUDA kernels"; exit 1; }
if ! git diff --quiet HEAD -- csrc setup.py; then
    echo "gpu_prepare: csrc/ or setup.py has uncommitted changes; the library is built from HEAD: commit first"
    exit 1
fi
COMPAT_BUILD_ONLY=1 bash tools/compat_build.sh 2.11.0 "$work" || exit 1
mkdir -p .gpuso
cp "$work/src/torchpm/libtorchpm_ops.so" .gpuso/ || exit 1
# A device call carries at most 64 MiB: the build's debug sections (Python's -g) make
# the library about 66 MiB, 16 MiB without them (the CUDA fatbin is kept).
strip --strip-debug .gpuso/libtorchpm_ops.so || exit 1
size=$(stat -c %s .gpuso/libtorchpm_ops.so)
if [ "$size" -gt $((48 * 1024 * 1024)) ]; then
    echo "gpu_prepare: .gpuso/libtorchpm_ops.so is $size bytes; a device call carries 64 MiB in all"
    exit 1
fi
# The sources it was built from: gpu_session.sh takes the library only while they match.
(cd "$work/src" && bash tools/source_hash.sh) >.gpuso/SOURCE || exit 1
echo "library: .gpuso/libtorchpm_ops.so ($(git -C "$work/src" rev-parse --short HEAD), sources $(cat .gpuso/SOURCE))"

mkdir -p .whl
rm -f .whl/*.whl
$python -m pip wheel -q --no-deps -w .whl jax-cosmo==0.1.0 jaxpm==0.1.6 || exit 1
$python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl jaxdecomp==0.3.4 || exit 1
ls .whl
