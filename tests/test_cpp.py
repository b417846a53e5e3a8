"""torchpm from LibTorch C++, without Python.

Packages the op library with CMake (CMakeLists.txt), installs it, builds the C++
example examples/cpp against the installed package (find_package(torchpm)), runs
it, and compares its PM forces and their position gradient with the Python code
on the same particles (float64, max abs difference <= 1e-12). Also checks that
the example binary and the op library do not link libpython.

Two ways of making the package, each a parameter of the `example` fixture:
"package" installs the library `import torchpm` loads (setup.py's build,
TORCHPM_PREBUILT_LIBRARY) and compiles only the examples; "source" compiles the
library from csrc/ with CMake, as a LibTorch user without Python does (marked
slow: minutes of compiling; `make test-all` or `pytest -m slow` runs it).

The CMake builds are cached in build/cpp (git-ignored; TORCHPM_CPP_BUILD_DIR
moves it). Skipped, with the reason, only when cmake or a C++ compiler is
missing.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

import torchpm
from torchpm.fourier import FourierKernels
from torchpm.mesh import LocalMesh
from torchpm.pm import compute_forces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("TORCHPM_CPP_BUILD_DIR", os.path.join(ROOT, "build", "cpp"))
MESH = 16
FORCE_SCALE = 0.45  # 1.5 Omega_m for Omega_m = 0.3


def _compiler():
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _run(command, log):
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    log.append(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}")
    if result.returncode != 0:
        raise AssertionError(f"command failed ({result.returncode}):\n" + "\n".join(log[-1:]))
    return result


@pytest.fixture(scope="module", params=["package", pytest.param("source", marks=pytest.mark.slow)])
def example(request):
    """Path of the built pm_forces binary (building the library and it if needed)."""
    cmake, compiler = shutil.which("cmake"), _compiler()
    if cmake is None or compiler is None:
        reason = "C++ check skipped: " + ("cmake not found" if cmake is None else "no C++ compiler found")
        print(reason)
        pytest.skip(reason)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    # "source": the directories `make cpp` uses, so either reuses the other's build.
    build = BUILD if request.param == "source" else os.path.join(BUILD, "package")
    library_build = os.path.join(build, "lib")
    example_build = os.path.join(build, "example")
    install = os.path.join(build, "install")
    prefix = torch.utils.cmake_prefix_path
    packaged = [f"-DTORCHPM_PREBUILT_LIBRARY={torchpm.ops_library()}"] if request.param == "package" else []
    log = []
    # Configure once; later builds re-run the configuration themselves when a
    # CMakeLists.txt or csrc/sources.txt (or a globbed directory, or the packaged
    # library) changed. The package is configured each time (seconds), in case
    # torchpm is now loaded from elsewhere.
    if packaged or not os.path.exists(os.path.join(library_build, "CMakeCache.txt")):
        _run(
            [cmake, "-S", ROOT, "-B", library_build, *generator, "-DCMAKE_BUILD_TYPE=Release",
             f"-DCMAKE_CXX_COMPILER={compiler}", f"-DCMAKE_PREFIX_PATH={prefix}",
             f"-DCMAKE_INSTALL_PREFIX={install}", *packaged],
            log,
        )
    _run([cmake, "--build", library_build], log)
    _run([cmake, "--install", library_build], log)
    if not os.path.exists(os.path.join(example_build, "CMakeCache.txt")):
        _run(
            [cmake, "-S", os.path.join(ROOT, "examples", "cpp"), "-B", example_build, *generator,
             "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_CXX_COMPILER={compiler}",
             f"-DCMAKE_PREFIX_PATH={install};{prefix}"],
            log,
        )
    _run([cmake, "--build", example_build], log)
    return os.path.join(example_build, "pm_forces")


@pytest.fixture(scope="module")
def api_checks(example):
    return os.path.join(os.path.dirname(example), "api_checks")


def _python_forces(positions, gradient):
    """torchpm's Python force evaluation (fd4 gradient, exact inverse Laplacian,
    unit cubic cells) and, when asked, d(sum F^2)/dx by autograd."""
    mesh = LocalMesh(MESH)
    kernels = FourierKernels(
        mesh, (1.0, 1.0, 1.0), gradient="fd4", laplacian="exact", dtype=torch.float64, device=positions.device
    )
    particle_mass = MESH**3 / positions.shape[1]
    if not gradient:
        with torch.no_grad():
            return compute_forces(positions, kernels, a=1.0, particle_mass=particle_mass, force_scale=FORCE_SCALE), None
    positions = positions.detach().clone().requires_grad_(True)
    forces = compute_forces(positions, kernels, a=1.0, particle_mass=particle_mass, force_scale=FORCE_SCALE)
    (grad,) = torch.autograd.grad((forces * forces).sum(), positions)
    return forces.detach(), grad


def _run_example(binary, positions, tmp_path, device="cpu"):
    source = tmp_path / "positions.f64"
    output = tmp_path / "forces.f64"
    positions.detach().cpu().numpy().astype("<f8").tofile(source)
    result = subprocess.run(
        [binary, str(MESH), repr(FORCE_SCALE), str(source), str(output), device],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # the C++ program loads the library itself: the same build of the CPU kernels
    assert f"CPU kernels {torchpm.cpu_kernels()}\n" in result.stdout, result.stdout
    values = torch.from_numpy(np.fromfile(output, dtype="<f8")).view(2, *positions.shape)
    return values[0], values[1]


def test_cpp_forces_and_gradient_match_python(example, tmp_path, device):
    generator = torch.Generator().manual_seed(10)
    count = 1111  # not a cube: the mean-1 normalisation is not 1
    positions = torch.rand(1, count, 3, generator=generator, dtype=torch.float64) * MESH
    # A clump, so that the forces are far from zero.
    positions[0, : count // 3] = 3.0 + 2.0 * torch.rand(count // 3, 3, generator=generator, dtype=torch.float64)
    positions = positions.to(device)

    cpp_forces, cpp_gradient = _run_example(example, positions, tmp_path, device.type)
    forces, gradient = _python_forces(positions, gradient=True)
    forces_no_grad, _ = _python_forces(positions, gradient=False)

    forces, gradient, forces_no_grad = forces.cpu(), gradient.cpu(), forces_no_grad.cpu()
    assert forces.abs().max() > 0.1 and gradient.abs().max() > 0.1
    assert (cpp_forces - forces).abs().max().item() <= 1e-12
    assert (cpp_forces - forces_no_grad).abs().max().item() <= 1e-12
    assert (cpp_gradient - gradient).abs().max().item() <= 1e-12


def test_cpp_example_rejects_a_bad_positions_file(example, tmp_path):
    source = tmp_path / "positions.f64"
    np.zeros(7, dtype="<f8").tofile(source)  # not a multiple of 3 values
    result = subprocess.run(
        [example, str(MESH), "0.45", str(source), str(tmp_path / "out.f64")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "3 per particle" in result.stderr and "56 bytes" in result.stderr
    for arguments, message in [(["abc", "0.45"], "MESH_SIZE must be an integer, got 'abc'"),
                               (["16x", "0.45"], "MESH_SIZE must be an integer, got '16x'"),
                               ([str(MESH), "nan"], "FORCE_SCALE must be a finite number, got 'nan'"),
                               ([str(MESH), "0.4.5"], "FORCE_SCALE must be a finite number, got '0.4.5'")]:
        result = subprocess.run([example, *arguments, str(source), str(tmp_path / "out.f64")],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and message in result.stderr, result.stderr


def test_cpp_api_gradients_match_python_and_errors_reach_cpp(api_checks, tmp_path):
    """Weighted multi-channel paint and readout through the C++ autograd
    Functions against Python's autograd; the binary also checks error paths."""
    n, count = 8, 300
    generator = torch.Generator().manual_seed(11)
    x = torch.rand(1, count, 3, generator=generator, dtype=torch.float64) * n
    w = torch.randn(1, count, 2, generator=generator, dtype=torch.float64)
    f = torch.randn(1, 2, n, n, n, generator=generator, dtype=torch.float64)
    source, output = tmp_path / "input.f64", tmp_path / "grads.f64"
    torch.cat([x.flatten(), w.flatten(), f.flatten()]).numpy().astype("<f8").tofile(source)
    result = subprocess.run(
        [api_checks, str(n), str(source), str(output)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok: ") == 11, result.stdout

    inputs = [t.clone().requires_grad_(True) for t in (x, w, f)]
    read = torchpm.cic_readout(inputs[2], inputs[0])
    loss = (torchpm.cic_paint(inputs[0], inputs[1], (n, n, n)) * inputs[2]).sum() + (read * read).sum()
    expected = torch.autograd.grad(loss, inputs)
    values = torch.from_numpy(np.fromfile(output, dtype="<f8"))
    for grad, name in zip(expected, ("positions", "weights", "mesh")):
        cpp, values = values[: grad.numel()].view_as(grad), values[grad.numel() :]
        assert grad.abs().max() > 0.1, name
        assert (cpp - grad).abs().max().item() <= 1e-12, name
    assert values.numel() == 0


def _linked(path):
    result = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_cpp_example_and_op_library_do_not_link_python(example):
    if shutil.which("ldd") is None:
        pytest.skip("ldd not found")
    linked = _linked(example)
    assert "libtorchpm_ops" in linked  # the ops come from the library ...
    assert "libpython" not in linked and "libtorch_python" not in linked  # ... without Python
    # The library the Python package loads is built from the same sources with
    # setup.py; it must not need Python either.
    (python_side,) = glob.glob(os.path.join(os.path.dirname(torchpm.__file__), "libtorchpm_ops.so"))
    linked = _linked(python_side)
    assert "libpython" not in linked and "libtorch_python" not in linked


def test_cpp_package_holds_its_library_and_says_whether_it_has_cuda(example, request):
    install = os.path.join(os.path.dirname(os.path.dirname(example)), "install")
    (installed,) = glob.glob(os.path.join(install, "lib*", "libtorchpm_ops.so"))
    (config,) = glob.glob(os.path.join(install, "lib*", "cmake", "torchpm", "torchpmConfig.cmake"))
    with open(config) as f:
        with_cuda = "set(torchpm_WITH_CUDA ON)" in f.read()
    if request.node.callspec.params["example"] == "package":
        # the library `import torchpm` loads, byte for byte; CUDA read from its links
        with open(torchpm.ops_library(), "rb") as loaded, open(installed, "rb") as packaged:
            assert loaded.read() == packaged.read(), "the package holds another library than torchpm's"
        assert with_cuda == torchpm.has_cuda_kernels()
    else:  # CMake's decision: CUDA kernels when the LibTorch has CUDA
        assert with_cuda == (torch.version.cuda is not None)


def _configure_consumer(directory, prefix_path, *extra):
    """Configures a project that only calls find_package(torchpm REQUIRED)."""
    source = directory / "consumer"
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(consumer LANGUAGES NONE)\nfind_package(torchpm REQUIRED)\n"
    )
    result = subprocess.run(
        [shutil.which("cmake"), "-S", str(source), "-B", str(directory / "build"),
         f"-DCMAKE_PREFIX_PATH={prefix_path}", *extra],
        capture_output=True, text=True, timeout=300,
    )
    return result.returncode, " ".join((result.stdout + result.stderr).split())  # CMake wraps its messages


def test_cpp_package_refuses_another_or_no_libtorch(example, tmp_path):
    """torchpmConfig.cmake names the LibTorch the library was built against when
    that one is not found, and refuses another release (it would configure and
    link, then fail when loaded, with undefined symbols)."""
    install = os.path.join(os.path.dirname(os.path.dirname(example)), "install")
    fake = tmp_path / "fake-torch"
    fake.mkdir()
    (fake / "TorchConfig.cmake").write_text('set(TORCH_LIBRARIES "")\n')
    (fake / "TorchConfigVersion.cmake").write_text(
        'set(PACKAGE_VERSION "2.0.0")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n'
    )
    with open(os.path.join(torch.utils.cmake_prefix_path, "Torch", "TorchConfigVersion.cmake")) as f:
        (built_against,) = re.findall(r'set\(PACKAGE_VERSION "([^"]+)"\)', f.read())
    rc, output = _configure_consumer(tmp_path / "other", install, f"-DTorch_DIR={fake}")
    assert rc != 0
    assert f"torchpm was built against LibTorch {built_against}, but LibTorch 2.0.0 was found" in output, output

    empty = tmp_path / "no-torch"
    empty.mkdir()
    rc, output = _configure_consumer(tmp_path / "none", install, f"-DTorch_DIR={empty}")
    assert rc != 0
    assert f"torchpm needs the LibTorch it was built against ({built_against}" in output, output
    assert "CMAKE_PREFIX_PATH" in output


def test_cpp_package_of_a_missing_library_is_refused(tmp_path):
    cmake = shutil.which("cmake")
    if cmake is None or _compiler() is None:
        pytest.skip("C++ check skipped: cmake or a C++ compiler not found")
    missing = tmp_path / "nothing" / "libtorchpm_ops.so"
    result = subprocess.run(
        [cmake, "-S", ROOT, "-B", str(tmp_path / "build"), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
         f"-DTORCHPM_PREBUILT_LIBRARY={missing}"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    message = " ".join(result.stderr.split())  # CMake wraps its messages
    assert f"TORCHPM_PREBUILT_LIBRARY: no file '{missing}'" in message, result.stderr


def test_source_list_covers_every_source():
    """csrc/sources.txt, the one list both builds read, leaves no kernel file out."""
    patterns = []
    with open(os.path.join(ROOT, "csrc", "sources.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                patterns.append(line.rpartition(":")[2].strip())
    listed = {os.path.normpath(p) for pattern in patterns for p in glob.glob(os.path.join(ROOT, "csrc", pattern))}
    sources = {
        os.path.normpath(p)
        for ext in ("cpp", "cu")
        for p in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True)
    }
    assert sources - listed == set()
