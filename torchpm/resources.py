"""Up-front resource checks: a run's peak memory, estimated before anything is allocated.

The estimate counts what a FastPM run holds at its peak, per rank (mesh and
particle terms divided by the number of ranks; uneven splits add at most one
plane, which the margin covers), in units of one real value ``s`` (4 or 8 bytes),
for ``N`` particles and ``M = B^3 N`` mesh cells:

* particles: positions and momenta ``(B, N, 3)`` and one more such array of
  temporaries, plus the int64 ids: ``(9 s + 8) N``;
* the initial conditions on the particle grid (noise, its transform, the 1LPT and
  2LPT displacements and the 2LPT source), at their peak: ``21 s N``;
* the force computation on the mesh (painted density, its R2C transform,
  potential, the 3-channel force mesh, FFT and paint work buffers): ``10 s M``;

all times 1.2 for allocator slack. The coefficients were fitted to the peak resident
set of runs without gradients (``benchmarks/memory_estimate.py``, 32^3 to 192^3
particles, mesh factors 1 to 4, float32 and float64; results in
``benchmarks/RESULTS.md``): without the 1.2 they are 6 % to 40 % above the
measured peak, with it 27 % to 68 % (2-core CPU; on the H100 a 512^3 step needed
about 13 s per cell above the particle state, within the estimate). Before
2026-11-25 the estimate counted the initial conditions and the force meshes as if
both were held at once and was about twice the measured peak.
A run with gradients keeps more (every step's meshes unless ``checkpoint=True``).
``memory_check="warn"`` or ``"off"`` overrides the refusal.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import NamedTuple

import torch

__all__ = ["MemoryEstimate", "estimate_memory", "available_memory", "check_memory"]

MESH_COPIES = 10
LPT_COPIES = 21
PARTICLE_VECTORS = 3
SLACK = 1.2


class MemoryEstimate(NamedTuple):
    """Bytes per rank: ``particles``, ``force_meshes``, ``lpt_fields`` and the ``peak``."""

    particles: int
    force_meshes: int
    lpt_fields: int
    peak: int

    def describe(self) -> str:
        return (
            f"{_gib(self.peak)} peak (particles {_gib(self.particles)}, force meshes and FFT buffers "
            f"{_gib(self.force_meshes)}, initial-condition fields {_gib(self.lpt_fields)})"
        )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def estimate_memory(particle_shape, mesh_factor: int, dtype=torch.float32, batch: int = 1, ranks: int = 1) -> MemoryEstimate:
    """Estimated peak memory of a run, in bytes per rank.

    Args:
        particle_shape: ``(nx, ny, nz)`` particles per side.
        mesh_factor: force-mesh cells per particle per side.
        dtype: float32 or float64 (particles and fields).
        batch: simulations run together.
        ranks: processes sharing the mesh and the particles.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    n_particles = math.prod(particle_shape) * batch
    n_mesh = n_particles * mesh_factor**3
    particles = (PARTICLE_VECTORS * 3 * itemsize + 8) * n_particles / ranks
    force_meshes = MESH_COPIES * itemsize * n_mesh / ranks
    lpt_fields = LPT_COPIES * itemsize * n_particles / ranks
    peak = SLACK * (particles + force_meshes + lpt_fields)
    return MemoryEstimate(int(particles), int(force_meshes), int(lpt_fields), int(peak))


def _cgroup_limit() -> int | None:
    """Memory left under this process's cgroup (v2 or v1) limit, when there is one."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as handle:
                limit = handle.read().strip()
            with open(usage_path) as handle:
                usage = int(handle.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            return max(int(limit) - usage, 0)
    return None


def available_memory(device) -> int | None:
    """Bytes that can still be allocated on ``device`` (None when unknown).

    CUDA: ``torch.cuda.mem_get_info`` (free) plus what torch's caching allocator
    holds but does not use. CPU: ``psutil`` when installed, else ``MemAvailable``
    of /proc/meminfo, else ``os.sysconf``; bounded by the cgroup limit.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    if device.type != "cpu":
        return None
    available = None
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            with open("/proc/meminfo") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        available = int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
        if available is None:
            try:
                available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                return None
    limit = _cgroup_limit()
    return min(available, limit) if limit is not None else available


def check_memory(estimate: MemoryEstimate, device, mode: str = "error", what: str = "this simulation") -> None:
    """Refuse (``mode="error"``) or warn (``"warn"``) when ``estimate`` exceeds what
    ``device`` has available; ``"off"`` skips the check."""
    if mode == "off":
        return
    if mode not in ("error", "warn"):
        raise ValueError(f"`memory_check` must be 'error', 'warn' or 'off', got {mode!r}")
    available = available_memory(device)
    if available is None or estimate.peak <= available:
        return
    message = (
        f"{what} needs about {estimate.describe()} on {device}, but only {_gib(available)} is available. "
        "Use fewer particles, a smaller mesh_factor or batch, float32, more ranks, or pass "
        "memory_check='warn' / 'off' (CLI: memory_check = \"off\") to run anyway."
    )
    if mode == "error":
        raise MemoryError(message)
    warnings.warn(message, ResourceWarning, stacklevel=3)
