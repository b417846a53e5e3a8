#!/usr/bin/env bash
# Everything a session with a lent GPU runs, in phases that each fit one device call
# (10 minutes). Logs go to $OUT (or ./gpu-logs); every number they print belongs in
# benchmarks/RESULTS.md with the device, the date and the command.
#
#   bash tools/gpu_session.sh first       # one call for a 15-minute device budget (below)
#   bash tools/gpu_session.sh full        # the same budget's one call, after `first` ran once (below)
#   bash tools/gpu_session.sh suite       # every CUDA case not marked slow, without the JaxPM files (300 s),
#                                         # beside memcheck over MEMCHECK_FILES -k MEMCHECK_K; then
#                                         # bench_anchors.py (150 s): run it with timeout_s 520
#   bash tools/gpu_session.sh test        # build, then every CUDA case of the suite and the C++ API
#   bash tools/gpu_session.sh memcheck    # build, then the CUDA op tests under compute-sanitizer memcheck
#   bash tools/gpu_session.sh racecheck   # the same under racecheck
#   bash tools/gpu_session.sh bench       # build, then the GPU benchmarks at 256^3 and 512^3 (timeout_s 590)
#   bash tools/gpu_session.sh determinism # build, then the deterministic paint against the atomic one
#   bash tools/gpu_session.sh tiled       # build, then the tiled paint against the scatter, kernels and step
#   bash tools/gpu_session.sh layout      # build, then the reads of planar against interleaved meshes
#
# A machine goes back 30 s after a call, so every call builds again (about 2 minutes of
# device time on 16 cores, which the test and memcheck phases' timeouts do not leave
# room for) unless the library comes with it: `make gpu-prepare`
# (tools/gpu_prepare.sh) builds it here against the GPU machine's torch into .gpuso/ and
# fetches the JaxPM wheels for the bench phase into .whl/ (jaxpm 0.1.6, jax-cosmo 0.1.0,
# jaxdecomp 0.3.4, which works with the machine's jax 0.11); carry both.
#
# A task is lent 15 device-minutes in all (a machine's start included), and one call may
# run 10 minutes: `first` is that budget's one call (run it with timeout_s 590). It runs,
# each bounded so that the whole ends near 9 minutes: the CUDA tests of the code written
# since the one H100 session (never run on a GPU: the fused readout and updates, the
# in-place updates, the 4-point stencil's fill-written scale, the paint routing, the
# migration's CUDA twin, the deferred checks, the CUDA-graph capture of a step); every
# CUDA case of the suite; the PM step at 256^3 and 512^3 without JaxPM (section 0 of
# benchmarks/RESULTS.md has the JaxPM ratios); memcheck over the new kernels' tests.
# The other phases are for a session with more device time.
#
# The GPU machine has torch, pytest, pytest-xdist, hypothesis, scipy, h5py, safetensors and
# matplotlib, but not the test-only oracles astropy, colossus, pynbody and JaxPM: those
# tests skip or are deselected here (they run in CI on the CPU).
set -u -o pipefail
phase=${1:?usage: gpu_session.sh first|full|suite|test|memcheck|racecheck|bench|determinism|tiled|layout}
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# JAX shares the GPU with torch here: no preallocation of 75% of it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python=${PYTHON:-python3}

if [ -f .gpuso/libtorchpm_ops.so ]; then
    # Only a library built from these very sources (make gpu-prepare after the last csrc change).
    if [ "$(cat .gpuso/SOURCE 2>/dev/null)" = "$(bash tools/source_hash.sh)" ]; then
        cp .gpuso/libtorchpm_ops.so torchpm/libtorchpm_ops.so || exit 1
    else
        echo "gpu_session: .gpuso/ was built from other sources than csrc/ and setup.py here: building"
        rm -f torchpm/libtorchpm_ops.so
    fi
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
parallel=""
if $python -c "import xdist" 2>/dev/null; then parallel="-n 8"; fi

build() {
    if $python -c "import torchpm, sys; sys.exit(0 if torchpm.has_cuda_kernels() else 1)" 2>/dev/null; then
        echo "build: reusing torchpm/libtorchpm_ops.so (has CUDA kernels)"
        return 0
    fi
    local start=$SECONDS
    # The system compiler when there is one: a library built there with the g++ first on
    # PATH (/opt/gcc) turned every C++ exception into a segfault (exit 139), CPU tensors
    # too (2026-11-27, an H200), while a library built on the development VM raised them.
    if [ -z "${CXX:-}" ] && [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
    # Bounded: a stale .gpuso/ must not spend the whole call on a build (about 5 min on 16 cores).
    TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} timeout ${BUILD_TIMEOUT:-420} $python setup.py build_ext --inplace \
        >"$out/build.log" 2>&1 || { echo "build failed or passed ${BUILD_TIMEOUT:-420} s"; tail -50 "$out/build.log"; exit 1; }
    echo "build: $((SECONDS - start)) s (CXX=${CXX:-c++}: $(${CXX:-c++} --version | head -1))"
    $python -c "import torch, torchpm; print('torch', torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(), 'cuda kernels', torchpm.has_cuda_kernels())" | tee "$out/device.txt"
}

# Does the library raise its errors (a C++ exception through the dispatcher), on the CPU
# and on CUDA? A process that dies here (139: a segfault) makes every error test crash.
raises() {
    $python - <<'PY' 2>&1 | tail -3
import torch, torchpm
for device in ("cpu", "cuda"):
    x = torch.full((1, 2, 3), float("nan"), dtype=torch.float64, device=device)
    try:
        torchpm.cic_paint(x, None, (4, 4, 4))
        torchpm.check()
        print(f"raises: {device}: NO ERROR for NaN positions")
    except ValueError as error:
        print(f"raises: {device}: ok ({str(error)[:60]}...)")
PY
    echo "raises: exit ${PIPESTATUS[0]} (139: C++ exceptions crash this library; rebuild with the system g++)"
}

oracle_free="--ignore=tests/test_against_jaxpm.py --ignore=tests/test_jaxpm_reference.py"

# The test files of the CUDA code written after the H100 run (see `first`); they first
# ran, and passed, on an H200 on 2026-11-27 (benchmarks/RESULTS.md section 0b).
never_run="tests/test_readout_kick_drift.py tests/test_updates.py tests/test_finite_difference.py \
tests/test_paint_variants.py tests/test_deferred_checks.py tests/test_simulation.py"

case $phase in
first)
    build
    raises
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/device.txt"
    timeout 90 $python -m pytest -q -ra -m cuda $parallel -p no:cacheprovider $never_run \
        tests/test_distributed_simulation.py::test_migration_holes_op_matches_its_pure_torch_twin_and_hand_cases \
        2>&1 | tee "$out/pytest-new.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -30
    echo "pytest -m cuda (code not run on a GPU before): exit ${PIPESTATUS[0]} (124: timed out)"
    # The new kernels under memcheck second, so that a long test run cannot crowd it out.
    # Without torch's caching allocator each tensor is its own allocation: a read past a
    # tensor's end inside a cached segment is otherwise invisible to memcheck.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
        --print-limit 20 $python -m pytest -q -x -m cuda -p no:cacheprovider tests/test_readout_kick_drift.py \
        tests/test_updates.py -k "not simulation" 2>&1 | tee "$out/sanitizer-memcheck-new.log" | tail -8
    echo "compute-sanitizer memcheck (new kernels): exit ${PIPESTATUS[0]}"
    # Every other CUDA case; -v so that a run cut by its timeout still says what passed.
    # The timeouts sum to 574 s (90 + 60 + 200 + 80 + 144), inside a 590 s call.
    timeout 200 $python -m pytest -v -ra -m cuda $parallel $oracle_free -p no:cacheprovider \
        $(for f in $never_run; do echo "--ignore=$f"; done) 2>&1 \
        | tee "$out/pytest-cuda.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -30
    echo "pytest -m cuda (the rest): exit ${PIPESTATUS[0]} (124: timed out; see pytest-cuda.log)"
    for n in 256 512; do
        timeout $((n / 4 + 16)) $python benchmarks/bench_pm.py --device cuda --no-jaxpm --sizes $n 2>&1 \
            | tee "$out/bench_pm_$n.log"
    done
    ;;
full)
    # One 590 s call: the suite on CUDA and the sanitizers side by side (8 xdist workers
    # and one sanitized process on 16 cores; the GPU is shared, which only timings would
    # mind), then the benchmarks alone. Groups, most needed first: (1) the code whose tests
    # ran on the CPU only (tests/test_cuda_parity.py) and the CUDA cases of the analysis
    # added after the H100 run; (2) every other CUDA case not run since the H100; (3) the
    # files that first ran on 2026-11-27 (section 0b). Memcheck over the kernels it has
    # not seen, racecheck over the one kernel with shared memory (the tiled paint).
    build
    raises | tee -a "$out/device.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/device.txt"
    group1="tests/test_cuda_parity.py tests/test_lensing.py tests/test_trajectory.py tests/test_halos.py \
tests/test_halos_cells.py tests/test_bispectrum.py tests/test_mesh_analysis.py"
    group3="tests/test_mass_assignment.py tests/test_paint_variants.py tests/test_finite_difference.py \
tests/test_readout_kick_drift.py tests/test_updates.py tests/test_deferred_checks.py tests/test_tiled_paint.py \
tests/test_simulation.py"
    ignore=$(for f in $group1 $group3; do echo "--ignore=$f"; done)
    (
        timeout 100 $python -m pytest -v -ra -m cuda $parallel -p no:cacheprovider $group1 >"$out/pytest-1.log" 2>&1
        echo "group 1 exit $? (124: timed out)" | tee -a "$out/pytest-1.log"
        timeout 150 $python -m pytest -v -ra -m "cuda and not slow" $parallel $oracle_free -p no:cacheprovider $ignore \
            >"$out/pytest-2.log" 2>&1
        echo "group 2 exit $? (124: timed out)" | tee -a "$out/pytest-2.log"
        timeout 45 $python -m pytest -q -ra -m cuda $parallel -p no:cacheprovider $group3 >"$out/pytest-3.log" 2>&1
        echo "group 3 exit $? (124: timed out)" | tee -a "$out/pytest-3.log"
    ) &
    (
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 160 compute-sanitizer --tool memcheck --error-exitcode 9 \
            --print-limit 20 $python -m pytest -v -x -m cuda -p no:cacheprovider tests/test_readout_kick_drift.py \
            tests/test_updates.py tests/test_cic.py -k "not gradgrad and not compile" >"$out/sanitizer.log" 2>&1
        echo "memcheck exit $? (9: an error found; 124: timed out)" | tee -a "$out/sanitizer.log"
        timeout 130 compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 20 \
            $python -m pytest -v -x -m cuda -p no:cacheprovider tests/test_tiled_paint.py tests/test_paint_variants.py \
            -k "tiled and not gradgrad and not compile" >>"$out/sanitizer.log" 2>&1
        echo "racecheck exit $? (9: an error found; 124: timed out)" | tee -a "$out/sanitizer.log"
    ) &
    wait
    grep -hE "^(FAILED|ERROR)|passed|failed" "$out"/pytest-*.log | tail -40
    for n in 256 512; do
        timeout $((n / 4 + 16)) $python benchmarks/bench_pm.py --device cuda --no-jaxpm --sizes $n 2>&1 \
            | tee -a "$out/bench.log"
    done
    timeout 30 $python benchmarks/bench_mass_assignment.py --device cuda --sizes 256 512 --orders cic tsc \
        --layouts late late-sorted --repeats 5 2>&1 | tee -a "$out/bench.log"
    ;;
suite)
    # After `full`: every CUDA case again (fixes in between), beside memcheck over what
    # the last call's memcheck did not reach. The default is what was left after the H200
    # run of 2026-11-28 (benchmarks/RESULTS.md section 0c): test_cic.py from
    # test_gradcheck_paint on, and the distributed ops' CUDA cases (63 cases).
    memcheck_files="tests/test_cic.py tests/test_distributed_ops.py"
    memcheck_k="(not gradgrad and not compile) and (bad_mesh_sizes or cuda_deterministic_mode or device_mismatch \
or gradcheck_readout or gradients_match_reference or non_finite_or_absurd or opcheck or wrong_position_shapes \
or wrong_weights_and_mesh or gradcheck_paint or distributed_ops)"
    build
    raises | tee -a "$out/device.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/device.txt"
    (
        timeout 300 $python -m pytest -q -ra -m "cuda and not slow" $parallel $oracle_free -p no:cacheprovider \
            >"$out/pytest-cuda.log" 2>&1
        echo "pytest -m cuda: exit $? (124: timed out)" | tee -a "$out/pytest-cuda.log"
    ) &
    (
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 280 compute-sanitizer --tool memcheck --error-exitcode 9 \
            --print-limit 20 $python -m pytest -v -m cuda -p no:cacheprovider ${MEMCHECK_FILES:-$memcheck_files} \
            -k "${MEMCHECK_K:-$memcheck_k}" >"$out/sanitizer.log" 2>&1
        echo "memcheck exit $? (9: an error found; 124: timed out)" | tee -a "$out/sanitizer.log"
    ) &
    wait
    grep -hE "^(FAILED|ERROR)|passed|failed" "$out/pytest-cuda.log" | tail -40
    grep -E "ERROR SUMMARY|passed|failed" "$out/sanitizer.log" | tail -5
    # then alone on the GPU: pmwd's configurations (512^3 particles on a 1024^3 mesh, 63 steps)
    timeout 150 $python benchmarks/bench_anchors.py --device cuda 2>&1 | tee "$out/bench_anchors.log"
    ;;
test)
    build
    raises
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/device.txt"
    # All CUDA cases (about 4.5 minutes with 8 workers on an H100), then the C++ API
    # against the CUDA LibTorch, on the library just built (the from-source CMake
    # build, marked slow, would compile the CUDA kernels again).
    timeout 330 $python -m pytest -q -ra -m cuda $parallel $oracle_free -p no:cacheprovider 2>&1 \
        | tee "$out/pytest-cuda.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
    echo "pytest -m cuda: exit ${PIPESTATUS[0]} (124: timed out)"
    timeout 200 $python -m pytest -q -ra -m "not slow" -p no:cacheprovider tests/test_cpp.py 2>&1 | tee "$out/pytest-cpp.log" | tail -5
    echo "pytest tests/test_cpp.py: exit ${PIPESTATUS[0]}"
    ;;
memcheck|racecheck)
    build
    raises
    # With 4 workers memcheck got through about 95% of these in 170 s, racecheck about 55%.
    timeout 520 compute-sanitizer --tool $phase --error-exitcode 9 --print-limit 20 \
        $python -m pytest -q -x -m cuda ${parallel:+-n 4} -p no:cacheprovider tests/test_mass_assignment.py \
        tests/test_tiled_paint.py tests/test_deterministic_paint.py tests/test_finite_difference.py \
        tests/test_paint_variants.py -k "not gradgrad and not compile" 2>&1 | tee "$out/sanitizer-$phase.log" | tail -25
    echo "compute-sanitizer $phase: exit ${PIPESTATUS[0]}"
    ;;
bench)
    # Bounded to fit one call (timeouts 500 s in all; run it with timeout_s 590) and the
    # tool's 8 files: the kernels and the step into bench_kernels.log, the rest into
    # bench_features.log.
    build
    raises
    k="$out/bench_kernels.log" f="$out/bench_features.log"
    # The readouts of the interleaved force field the simulation reads (the layout phase
    # compares the planar one).
    timeout 100 $python benchmarks/bench_mass_assignment.py --device cuda --sizes 256 512 --repeats 10 \
        --mesh-layouts interleaved 2>&1 | tee -a "$k"
    # One process per size: XLA keeps its memory pool, and JaxPM's 2LPT at 512^3 ran out
    # of memory after its 256^3 run in the same process.
    timeout 80 $python benchmarks/bench_pm.py --device cuda --sizes 256 2>&1 | tee -a "$k"
    timeout 110 $python benchmarks/bench_pm.py --device cuda --sizes 512 2>&1 | tee -a "$k"
    timeout 40 $python benchmarks/bench_dfft.py --gpu 2>&1 | tee -a "$k"
    timeout 60 $python benchmarks/bench_adjoint.py --device cuda --size 128 --no-memory --repeats 3 2>&1 | tee -a "$f"
    # P(k) and its multipoles of a 256^3 and a 512^3 field: time and peak GPU memory
    timeout 30 $python benchmarks/bench_analysis.py --device cuda --sizes 256 512 2>&1 | tee -a "$f"
    # a light cone of 64 x 64 x 320 particles with 10 lens planes: the run alone, with its planes, the Born map
    timeout 30 $python benchmarks/bench_lensing.py --device cuda --particles 64 2>&1 | tee -a "$f"
    # friends-of-friends on 64^3 and 128^3 evolved particles against scipy (on the host) in the same run
    timeout 50 $python benchmarks/bench_halos.py --device cuda --particles 64 128 --repeats 3 2>&1 | tee -a "$f"
    ;;
determinism)
    build
    raises
    timeout 400 $python benchmarks/bench_mass_assignment.py --deterministic --device cuda --sizes 256 512 \
        --orders cic tsc --layouts lattice late uniform --repeats 5 2>&1 | tee "$out/bench_deterministic.log"
    ;;
tiled)
    build
    raises
    timeout 300 $python benchmarks/bench_mass_assignment.py --tiled --device cuda --sizes 256 512 \
        --orders cic tsc --layouts uniform lattice late late-sorted --repeats 5 2>&1 | tee "$out/bench_tiled.log"
    # the step with the scatter paint only (the bench phase runs the default, "auto")
    timeout 250 $python benchmarks/bench_pm.py --device cuda --sizes 256 512 --no-jaxpm --paint-method scatter \
        2>&1 | tee "$out/bench_pm_scatter.log"
    ;;
layout)
    build
    raises
    timeout 400 $python benchmarks/bench_mass_assignment.py --device cuda --sizes 256 512 --orders cic tsc \
        --layouts lattice late uniform --mesh-layouts planar interleaved --repeats 5 \
        2>&1 | tee "$out/bench_layout.log"
    ;;
*)
    echo "unknown phase $phase (first, full, suite, test, memcheck, racecheck, bench, determinism, tiled, layout)"; exit 2 ;;
esac
