# The README's two commands: `make run` and `make test`. Each installs what is
# missing (torch 2.13.0 CPU when no torch is importable), builds the extension
# against the installed torch (no build isolation: it would pull a second
# torch), then runs.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
NVCC ?= nvcc
CUDA_ARCH ?= compute_90
STAMP := build/.torchpm-installed
SOURCES := setup.py pyproject.toml csrc/sources.txt $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
CU_SOURCES := $(shell find csrc -name '*.cu')
CU_OBJECTS := $(patsubst csrc/%.cu,.cuda-check/%.o,$(CU_SOURCES))

CPP_BUILD ?= build/cpp

.PHONY: run test test-all deps test-deps build cpp cuda-check compat-check gpu-prepare bench bench-dfft bench-distributed example-dfft test-distributed clean

deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	@$(PYTHON) -c "import numpy, pytest, tqdm, matplotlib, safetensors, h5py" 2>/dev/null || \
		$(PYTHON) -m pip install numpy pytest tqdm matplotlib safetensors h5py

# Independent codes the physics is validated against, and pynbody, an
# independent reader of the Gadget HDF5 snapshots (tests only).
test-deps: deps
	@$(PYTHON) -c "import scipy, astropy, colossus" 2>/dev/null || \
		$(PYTHON) -m pip install scipy astropy==8.0.2 colossus==1.4.0
	@$(PYTHON) -c "import pynbody" 2>/dev/null || $(PYTHON) -m pip install pynbody==2.8.0
	@$(PYTHON) -c "import hypothesis" 2>/dev/null || $(PYTHON) -m pip install hypothesis
	@PYTHON=$(PYTHON) bash tools/install_jaxpm.sh

$(STAMP): $(SOURCES)
	$(PYTHON) -m pip install --no-build-isolation --no-deps -e .
	@mkdir -p build && touch $@

build: deps $(STAMP)

# --overwrite: `make run` replaces the outputs of the previous `make run` in out/.
run: build
	$(PYTHON) -m torchpm run --overwrite

# Compile every CUDA source to an object file whenever nvcc is present, so a CUDA
# compile error fails CI on machines without a GPU (nothing is linked or run).
# Device code goes as far as PTX for compute_90 (C++ front end and cicc; ptxas,
# the PTX-to-SASS step, runs in the real builds: setup.py, CMake, gpu-prepare),
# one source per core.
cuda-check: deps
	@if command -v $(NVCC) >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory -j$$(nproc 2>/dev/null || echo 2) $(CU_OBJECTS); \
	else \
		echo "cuda-check: $(NVCC) not found, CUDA sources not compiled"; \
	fi

.cuda-check/%.o: csrc/%.cu $(SOURCES)
	@mkdir -p $(dir $@)
	@echo "nvcc -c $< ($(CUDA_ARCH))"
	@$(NVCC) -c $< -o $@ -std=c++17 -O1 -arch=$(CUDA_ARCH) --expt-relaxed-constexpr \
		-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -DTORCHPM_WITH_CUDA \
		$$($(PYTHON) tools/torch_includes.py) -Icsrc -Icsrc/include

# The build (with the CUDA kernels when nvcc is found) and the test suite against
# another torch release in a throw-away venv: by default 2.11.0, the GPU
# machine's. Not part of `test` (a ~3 GB download).
COMPAT_TORCH ?= 2.11.0
compat-check:
	bash tools/compat_build.sh $(COMPAT_TORCH)

# What a GPU session carries: the library built against the GPU machine's torch and
# the JaxPM wheels (tools/gpu_prepare.sh; then tools/gpu_session.sh there).
gpu-prepare:
	bash tools/gpu_prepare.sh

# The op library as a CMake package (CMakeLists.txt) against the LibTorch inside
# the installed torch wheel, installed to $(CPP_BUILD)/install, and the C++
# example built on it. tests/test_cpp.py runs the same build (same directories,
# so either reuses the other's) and compares the example with Python.
cpp: deps
	@if ! command -v cmake >/dev/null 2>&1; then \
		echo "cpp: cmake not found, C++ build skipped"; exit 0; fi; \
	prefix=$$($(PYTHON) -c "import torch; print(torch.utils.cmake_prefix_path)"); \
	generator=$$(command -v ninja >/dev/null 2>&1 && echo "-G Ninja"); \
	set -e; \
	test -f $(CPP_BUILD)/lib/CMakeCache.txt || cmake -S . -B $(CPP_BUILD)/lib $$generator \
		-DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$$prefix" \
		-DCMAKE_INSTALL_PREFIX=$(abspath $(CPP_BUILD))/install; \
	cmake --build $(CPP_BUILD)/lib; \
	cmake --install $(CPP_BUILD)/lib; \
	test -f $(CPP_BUILD)/example/CMakeCache.txt || cmake -S examples/cpp -B $(CPP_BUILD)/example $$generator \
		-DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$(abspath $(CPP_BUILD))/install;$$prefix"; \
	cmake --build $(CPP_BUILD)/example; \
	echo "cpp: built $(CPP_BUILD)/example/pm_forces (usage: run it without arguments)"

# The C++ check (tests/test_cpp.py) is part of the pytest run: it packages the
# library setup.py built with CMake and builds the C++ examples on it, or prints
# why it was skipped (no cmake or compiler). Tests marked slow (minutes each on
# 2 cores: the C++ library compiled from source as `make cpp` does, the longer
# runs against JaxPM) run in `make test-all`, which also fuzzes the migration
# longer (1000 random rounds per grid instead of 200).
test: build test-deps cuda-check
	TORCHPM_REQUIRE_ORACLES=1 $(PYTHON) -m pytest -ra --durations=20 -m "not slow"

test-all: build test-deps cuda-check
	TORCHPM_REQUIRE_ORACLES=1 TORCHPM_TEST_MIGRATION_ROUNDS=1000 $(PYTHON) -m pytest -ra --durations=20

bench: build
	$(PYTHON) benchmarks/bench_mass_assignment.py
	$(PYTHON) benchmarks/bench_pm.py

bench-dfft: build
	$(PYTHON) benchmarks/bench_dfft.py

bench-distributed: build
	$(PYTHON) benchmarks/bench_distributed.py
	$(PYTHON) benchmarks/model_distributed.py

example-dfft: build
	torchrun --nproc-per-node=4 examples/distributed_fft.py

test-distributed: build
	$(PYTHON) -m pytest tests/test_distributed_fft.py tests/test_distributed_ops.py tests/test_distributed_simulation.py tests/test_cli_distributed.py tests/test_distributed_agreement.py tests/test_distributed_halos.py

clean:
	rm -rf build .cuda-check torchpm/_C*.so torchpm/libtorchpm_ops.so *.egg-info
