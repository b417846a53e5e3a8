"""torchpm: a differentiable, distributed particle-mesh N-body solver for PyTorch."""

import os

import torch

# The op library (kernels and TORCH_LIBRARY registrations of torch.ops.torchpm)
# is a plain shared library without Python, the one LibTorch programs link.
_OPS_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtorchpm_ops.so")
try:
    torch.ops.load_library(_OPS_LIBRARY)
except OSError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        f"torchpm's op library ({_OPS_LIBRARY}) could not be loaded: "
        f"{error}. Build it against the installed torch with "
        "`pip install --no-build-isolation -e .` (or `make test`), and rebuild "
        "after upgrading torch."
    ) from error

from . import ops  # noqa: E402
from .ops import check, cic_paint, cic_readout, get_error_checking, paint, readout, set_error_checking  # noqa: E402

# A bad TORCHPM_ERROR_CHECKING is reported here, at import, not at the first op.
get_error_checking()

from . import adjoint, analysis, bispectrum, cosmology, distributed, fourier, ic, lensing, mesh, nn, pm  # noqa: E402
from . import config, halos, io, resources  # noqa: E402  (io imports h5py only when used)
from .cosmology import Cosmology, Planck15, Planck18, PowerTable, linear_power  # noqa: E402
from .halos import HaloCatalog, find_halos, friends_of_friends, halo_catalog  # noqa: E402
from .mesh import LocalMesh  # noqa: E402
from .simulation import MeshUnitsState, Simulation, SimulationState  # noqa: E402

__version__ = "0.1.0"

# A bad TORCHPM_CPU_KERNELS is reported here too (csrc/cpu/kernel_variant.h).
torch.ops.torchpm._cpu_kernels()


def has_cuda_kernels() -> bool:
    """True when this build of torchpm contains its CUDA kernels."""
    return bool(torch.ops.torchpm._cuda_kernels_built())


def ops_library() -> str:
    """Path of the op library this import loaded (``libtorchpm_ops.so``): the file
    a LibTorch program can link, e.g. through CMake's ``TORCHPM_PREBUILT_LIBRARY``."""
    return _OPS_LIBRARY


def cpu_kernels() -> str:
    """Which build of the CPU mass-assignment kernels this process runs: ``"avx2"``
    (x86-64 cores with AVX2) or ``"baseline"``. Both give the same bits. The
    environment variable ``TORCHPM_CPU_KERNELS`` (``"auto"``, ``"avx2"`` or
    ``"baseline"``), read when torchpm is imported, can pick one."""
    return str(torch.ops.torchpm._cpu_kernels())


__all__ = [
    "paint",
    "readout",
    "cic_paint",
    "cic_readout",
    "has_cuda_kernels",
    "ops_library",
    "cpu_kernels",
    "check",
    "set_error_checking",
    "get_error_checking",
    "ops",
    "adjoint",
    "nn",
    "analysis",
    "bispectrum",
    "cosmology",
    "distributed",
    "ic",
    "lensing",
    "halos",
    "config",
    "io",
    "resources",
    "mesh",
    "pm",
    "Cosmology",
    "Planck15",
    "Planck18",
    "PowerTable",
    "linear_power",
    "LocalMesh",
    "HaloCatalog",
    "friends_of_friends",
    "halo_catalog",
    "find_halos",
    "Simulation",
    "SimulationState",
    "MeshUnitsState",
]
