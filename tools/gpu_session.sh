#!/usr/bin/env bash
# Everything a session with a lent GPU runs, in phases that each fit one device call
# (10 minutes). Logs go to $OUT (or ./gpu-logs); every number they print belongs in
# benchmarks/RESULTS.md with the device, the date and the command.
#
#   bash tools/gpu_session.sh test        # build, then the whole suite with the CUDA cases
#   bash tools/gpu_session.sh sanitize    # build, then the CUDA op tests under compute-sanitizer
#   bash tools/gpu_session.sh bench       # build, then the GPU benchmarks at 256^3 and 512^3
#   bash tools/gpu_session.sh determinism # build, then the deterministic paint against the atomic one
#   bash tools/gpu_session.sh tiled       # build, then the tiled paint against the scatter, kernels and step
#   bash tools/gpu_session.sh layout      # build, then the reads of planar against interleaved meshes
#
# The GPU machine has torch, pytest, hypothesis, scipy, h5py, safetensors and matplotlib,
# but not the test-only oracles astropy, colossus, pynbody and JaxPM: those tests skip
# or are deselected here (they run in CI on the CPU).
set -u -o pipefail
phase=${1:?usage: gpu_session.sh test|sanitize|bench|determinism|tiled|layout}
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python=${PYTHON:-python3}

build() {
    if $python -c "import torchpm, sys; sys.exit(0 if torchpm.has_cuda_kernels() else 1)" 2>/dev/null; then
        echo "build: reusing torchpm/libtorchpm_ops.so (has CUDA kernels)"
        return 0
    fi
    local start=$SECONDS
    TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} $python setup.py build_ext --inplace \
        >"$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
    echo "build: $((SECONDS - start)) s"
    $python -c "import torch, torchpm; print('torch', torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(), 'cuda kernels', torchpm.has_cuda_kernels())" | tee "$out/device.txt"
}

oracle_free="--ignore=tests/test_against_jaxpm.py --ignore=tests/test_jaxpm_reference.py"

case $phase in
test)
    build
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/device.txt"
    # CUDA cases first (fast feedback), then everything else.
    timeout 240 $python -m pytest -q -ra -m cuda $oracle_free 2>&1 | tee "$out/pytest-cuda.log" | tail -40
    timeout 300 $python -m pytest -q -ra -x -m "not cuda" $oracle_free -p no:cacheprovider \
        tests/test_simulation.py tests/test_pm.py tests/test_mass_assignment.py tests/test_nn.py \
        tests/test_adjoint.py tests/test_distributed_fft.py 2>&1 | tee "$out/pytest-rest.log" | tail -20
    ;;
sanitize)
    build
    for tool in memcheck racecheck; do
        timeout 280 compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 \
            $python -m pytest -q -x -m cuda tests/test_mass_assignment.py tests/test_finite_difference.py \
            tests/test_deterministic_paint.py tests/test_tiled_paint.py tests/test_paint_variants.py -k "not gradgrad and not compile" \
            2>&1 | tee "$out/sanitizer-$tool.log" | tail -25
        echo "compute-sanitizer $tool: exit ${PIPESTATUS[0]}"
    done
    ;;
bench)
    build
    # The readouts of the interleaved force field the simulation reads (the layout phase
    # compares the planar one).
    timeout 150 $python benchmarks/bench_mass_assignment.py --device cuda --sizes 256 512 --repeats 10 \
        --mesh-layouts interleaved 2>&1 | tee "$out/bench_mass_assignment.log"
    timeout 200 $python benchmarks/bench_pm.py --device cuda --sizes 256 512 2>&1 | tee "$out/bench_pm.log"
    timeout 100 $python benchmarks/bench_dfft.py --gpu 2>&1 | tee "$out/bench_dfft.log"
    timeout 100 $python benchmarks/bench_adjoint.py --device cuda --no-memory --repeats 5 \
        2>&1 | tee "$out/bench_adjoint.log"
    ;;
determinism)
    build
    timeout 400 $python benchmarks/bench_mass_assignment.py --deterministic --device cuda --sizes 256 512 \
        --orders cic tsc --layouts lattice late uniform --repeats 5 2>&1 | tee "$out/bench_deterministic.log"
    ;;
tiled)
    build
    timeout 300 $python benchmarks/bench_mass_assignment.py --tiled --device cuda --sizes 256 512 \
        --orders cic tsc --layouts uniform lattice late late-sorted --repeats 5 2>&1 | tee "$out/bench_tiled.log"
    timeout 250 $python benchmarks/bench_pm.py --device cuda --sizes 256 512 --no-jaxpm --paint-method tiled \
        2>&1 | tee "$out/bench_pm_tiled.log"
    ;;
layout)
    build
    timeout 400 $python benchmarks/bench_mass_assignment.py --device cuda --sizes 256 512 --orders cic tsc \
        --layouts lattice late uniform --mesh-layouts planar interleaved --repeats 5 \
        2>&1 | tee "$out/bench_layout.log"
    ;;
*)
    echo "unknown phase $phase (test, sanitize, bench, determinism, tiled, layout)"; exit 2 ;;
esac
