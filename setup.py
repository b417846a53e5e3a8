"""Build of the torchpm op library (metadata lives in pyproject.toml).

The kernels and op registrations go into ``torchpm/libtorchpm_ops.so``, a plain
shared library with no Python in it (it links libtorch, not libtorch_python or
libpython), which ``torchpm/__init__.py`` loads with ``torch.ops.load_library``.
CMakeLists.txt builds the same library, from the same list of sources
(csrc/sources.txt), for LibTorch programs.

Build without isolation so the installed torch is used::

    pip install --no-build-isolation -e .

Switches (environment variables):
    TORCHPM_FORCE_CUDA=1  build the CUDA kernels even when torch reports no CUDA
    TORCHPM_NO_CUDA=1     never build the CUDA kernels
    TORCHPM_DEBUG=1       -O0 -g, no NDEBUG
"""

import glob
import os
import subprocess
import sys
import tempfile

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def flag(name):
    return os.environ.get(name, "0").lower() not in ("", "0", "false", "no")


def compiler_has_openmp():
    """True when the C++ compiler accepts -fopenmp (it may not, e.g. Apple clang)."""
    compiler = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "omp.cpp")
        with open(source, "w") as f:
            f.write("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        try:
            result = subprocess.run(
                [compiler, "-fopenmp", source, "-o", os.path.join(tmp, "omp")],
                capture_output=True,
            )
        except OSError:
            return False
        return result.returncode == 0


def decide_cuda():
    if flag("TORCHPM_NO_CUDA"):
        return False, "TORCHPM_NO_CUDA=1"
    if flag("TORCHPM_FORCE_CUDA"):
        return True, "TORCHPM_FORCE_CUDA=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} was built without CUDA"
    if CUDA_HOME is None:
        return False, "nvcc not found (set CUDA_HOME)"
    return True, f"torch CUDA {torch.version.cuda}, toolkit at {CUDA_HOME}"


def read_sources(with_cuda):
    """The sources of the op library: csrc/sources.txt, its globs expanded."""
    sources = []
    with open(os.path.join(ROOT, "csrc", "sources.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            condition, _, pattern = line.rpartition(":")
            pattern = pattern.strip()
            if condition not in ("", "cuda", "no-cuda"):
                raise ValueError(f"csrc/sources.txt: unknown condition {condition!r} in {line!r}")
            if (condition == "cuda" and not with_cuda) or (condition == "no-cuda" and with_cuda):
                continue
            matches = sorted(glob.glob(os.path.join("csrc", pattern)))
            if not matches:
                raise ValueError(f"csrc/sources.txt: {pattern!r} matches no file under csrc/")
            sources += [m for m in matches if m not in sources]
    return sources


class BuildOpLibrary(BuildExtension):
    """BuildExtension naming the op library libtorchpm_ops.so (no Python ABI tag:
    it is not a Python module)."""

    def get_ext_filename(self, ext_name):
        if ext_name.split(".")[-1] == "libtorchpm_ops":
            return os.path.join(*ext_name.split(".")) + ".so"
        return super().get_ext_filename(ext_name)


def extensions():
    debug = flag("TORCHPM_DEBUG")
    with_cuda, why = decide_cuda()
    openmp = compiler_has_openmp()

    sources = read_sources(with_cuda)
    define_macros = []
    # -fno-trapping-math: floating-point operations may be assumed not to trap
    # (nothing here enables FP exceptions), so the compiler may turn the
    # branch-free floors of the CPU stencils (csrc/cpu/stencil_block.h) into
    # vector code. It changes no result: no reassociation, no contraction.
    cxx = ["-std=c++17", "-O0" if debug else "-O3", "-fno-trapping-math"]
    link = []
    if debug:
        cxx.append("-g")
        define_macros.append(("TORCHPM_DEBUG", "1"))
    if openmp:
        cxx.append("-fopenmp")
        link.append("-fopenmp")

    nvcc = ["-O3", "--expt-relaxed-constexpr", "-std=c++17"]
    if with_cuda:
        define_macros.append(("TORCHPM_WITH_CUDA", "1"))
        extension = CUDAExtension
        extra = {"cxx": cxx, "nvcc": nvcc + (["-g", "-G"] if debug else [])}
    else:
        extension = CppExtension
        extra = {"cxx": cxx}

    print(
        f"torchpm build: CPU kernels yes; OpenMP {'yes' if openmp else 'no'}; "
        f"CUDA kernels {'yes' if with_cuda else 'no'} ({why}); debug {'yes' if debug else 'no'}",
        file=sys.stderr,
    )
    return [
        extension(
            "torchpm.libtorchpm_ops",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")],
            # Leaves libtorch_python out of the link: the library must load in a
            # process without Python.
            py_limited_api=True,
            define_macros=define_macros,
            extra_compile_args=extra,
            extra_link_args=link,
        )
    ]


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildOpLibrary.with_options(use_ninja=True)},
)
