#!/usr/bin/env bash
# Builds torchpm against another torch release and runs the test suite with it, in a
# throw-away virtual environment outside the repository (the committed HEAD is cloned
# there). Default: torch 2.11.0, the GPU machine's release (a CUDA 13 wheel on Linux,
# with its NVIDIA libraries: about 3 GB). When nvcc is found the CUDA kernels are
# compiled and linked too, so a machine without a GPU checks the whole CUDA build and
# runs the CPU tests against it (the CUDA tests skip).
#
#   bash tools/compat_build.sh [TORCH_VERSION] [WORKDIR]      # make compat-check
#   COMPAT_BUILD_ONLY=1 bash tools/compat_build.sh 2.11.0 DIR   # the library alone, for a GPU session
#
# The library is left in WORKDIR/src/torchpm/libtorchpm_ops.so: with torch 2.11 and the
# CUDA kernels it is what tools/gpu_session.sh takes from .gpuso/ on the GPU machine.
#
# Not part of `make test` (the download alone takes minutes). The build log and the
# pytest log are left in WORKDIR.
set -u -o pipefail
version=${1:-2.11.0}
work=${2:-${TMPDIR:-/tmp}/torchpm-torch-$version}
repo=$(git rev-parse --show-toplevel)
python=${PYTHON:-python3}

mkdir -p "$work"
if [ ! -x "$work/venv/bin/python" ]; then
    # System site packages: numpy, pytest and the test oracles come from the host.
    $python -m venv --system-site-packages "$work/venv" || exit 1
fi
venv=$work/venv/bin/python
if ! $venv -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$version' else 1)" 2>/dev/null; then
    $venv -m pip install -q "torch==$version" || exit 1
fi
rm -rf "$work/src"
git clone -q "$repo" "$work/src" || exit 1
cd "$work/src" || exit 1

if command -v nvcc >/dev/null 2>&1; then
    if [ -z "${CUDA_HOME:-}" ]; then
        if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
        else CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
    fi
    # CMake (tests/test_cpp.py) finds the toolkit from the nvcc it runs.
    export CUDA_HOME CUDACXX=$CUDA_HOME/bin/nvcc PATH=$CUDA_HOME/bin:$PATH
    export TORCHPM_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
fi
echo "torch $($venv -c 'import torch; print(torch.__version__)'), CUDA kernels: ${TORCHPM_FORCE_CUDA:-0}"
start=$SECONDS
if ! $venv setup.py build_ext --inplace >"$work/build.log" 2>&1; then
    grep -n "error" "$work/build.log" | head -20
    echo "build failed: $work/build.log"
    exit 1
fi
echo "build: $((SECONDS - start)) s"
if [ "${COMPAT_BUILD_ONLY:-0}" = 1 ]; then
    echo "library: $work/src/torchpm/libtorchpm_ops.so"
    exit 0
fi
# The CLI tests start `python -m torchpm` in other folders: the clone must be importable.
PYTHONPATH=$work/src${PYTHONPATH:+:$PYTHONPATH} $venv -m pytest -q -p no:cacheprovider tests/ >"$work/pytest.log" 2>&1
status=$?
tail -3 "$work/pytest.log"
exit $status
