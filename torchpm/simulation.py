"""`torchpm.Simulation`: the differentiable FastPM simulation as an ``nn.Module``."""

from __future__ import annotations

import math
import numbers
from typing import Callable, NamedTuple, Sequence

import torch
from torch import nn

from .cosmology import Cosmology, Planck15, growth_table, resolve_power, PowerTable
from .ic import (
    check_finite,
    grid_positions,
    linear_field,
    lpt_displacements,
    lpt_initial_state,
    power_kernel,
    white_noise as make_white_noise,
)
from .mesh import LocalMesh, as_box_size, as_shape
from .fourier import FourierKernels
from .pm import compute_forces, kick_drift_kick, step_factors
from .ops._arguments import ORDER_NAMES, order_number

__all__ = ["Simulation", "SimulationState"]


class SimulationState(NamedTuple):
    """Particles of a batch of simulations at scale factor ``a``.

    Attributes:
        positions: ``(B, N, 3)`` comoving positions in Mpc/h, wrapped into the box.
        momenta: ``(B, N, 3)`` ``p = a^3 E dx/da`` in Mpc/h (``H0 = 1``); the peculiar
            velocity in km/s is ``100 p / a``.
        a: the scale factor (float).
        ids: ``(B, N)`` int64, each particle's Lagrangian index ``(i * ny + j) * nz + k``
            on the global particle grid; ``-1`` marks an empty (padding) slot.
    """

    positions: torch.Tensor
    momenta: torch.Tensor
    a: float
    ids: torch.Tensor | None = None


def _scale_factors(a_start, steps, a_end) -> list[float]:
    a_start = float(a_start)
    if not (0 < a_start <= 1):
        raise ValueError(f"`a_start` must be in (0, 1], got {a_start}")
    if isinstance(steps, bool):
        raise ValueError(f"`steps` must be a number of steps or a list of scale factors, got {steps!r}")
    if isinstance(steps, numbers.Integral) or (isinstance(steps, numbers.Real) and float(steps).is_integer()):
        steps = int(steps)
        if steps < 0:
            raise ValueError(f"`steps` must not be negative, got {steps}")
        a_end = float(a_end)
        if not (0 < a_end <= 1):
            raise ValueError(f"`a_end` must be in (0, 1], got {a_end}")
        if steps > 0 and a_end <= a_start:
            raise ValueError(f"`a_end` ({a_end}) must be larger than `a_start` ({a_start})")
        if steps == 0:
            return [a_start]
        # Steps linear in a, the FastPM default.
        return [a_start + (a_end - a_start) * i / steps for i in range(steps + 1)]
    try:
        values = [float(s) for s in steps]
    except (TypeError, ValueError):
        raise ValueError(f"`steps` must be a number of steps or a list of scale factors, got {steps!r}") from None
    if not all(0 < s <= 1 for s in values):
        raise ValueError(f"every scale factor in `steps` must be in (0, 1], got {values}")
    grid = [a_start] + values
    if any(b <= a for a, b in zip(grid, grid[1:])):
        raise ValueError(
            f"`steps` must be strictly increasing scale factors after `a_start` = {a_start}, got {values}"
        )
    return grid


class Simulation(nn.Module):
    """A particle-mesh N-body simulation with the FastPM scheme (DESIGN.md).

    Args:
        n_particles: particles per side (int) or ``(nx, ny, nz)``; also the grid of
            the white noise and of the linear field.
        box_size: box side(s) in Mpc/h.
        mesh_factor: integer B; the force mesh is ``B * n_particles`` per side.
        a_start: scale factor of the initial conditions.
        steps: number of steps (linear in a from ``a_start`` to ``a_end``; 0 gives the
            LPT initial conditions only) or the increasing list of scale factors to
            step to after ``a_start``.
        a_end: final scale factor when ``steps`` is a number.
        cosmology: a :class:`torchpm.Cosmology` (default Planck15). Its tensor
            parameters are used as they are at each call, so gradients flow to them.
        power_spectrum: ``"eisenstein_hu"``, ``"eisenstein_hu_nowiggle"``, the path
            of a two-column table (k h/Mpc, P (Mpc/h)^3) or a callable
            ``(k, cosmology) -> P`` of the linear power at ``a = 1`` (a fixed function:
            its result is reused while the cosmology does not change, unless it
            requires grad).
        lpt_order: 1 or 2.
        integrator: ``"fastpm"`` (growth-corrected kick-drift-kick) or ``"leapfrog"``.
        gradient: ``"fd4"`` (default) or ``"exact"``; laplacian: ``"exact"`` or ``"fd"``.
        paint_order: mass-assignment window of the force calculation's paint and
            readout: ``"ngp"``, ``"cic"`` (default), ``"tsc"`` or ``"pcs"``.
        window_compensation: divide the force kernel by ``W^2``, ``W`` the window of
            ``paint_order`` (``prod_i sinc(w_i/2pi)^p``; once for paint, once for readout).
        cic_compensation: the older switch, unchanged: divide by the CIC window once
            (``prod_i sinc(w_i/2pi)^-2``, the FastPM/JaxPM convention); CIC only, not
            together with ``window_compensation``.
        force_correction: optional callable or ``nn.Module`` ``(k, a) -> filter``
            (``k``: ``|k|`` mesh in h/Mpc, ``a``: 0-d tensor) multiplying the potential.
        dtype: of particles and fields (float32 default; the background is float64).
        checkpoint: recompute each step in the backward pass instead of keeping its
            intermediate meshes, so memory does not grow with the number of steps.

    ``forward(white_noise)`` returns a :class:`SimulationState` in Mpc/h. Shapes:
    white noise ``(B, nx, ny, nz)`` (or without the batch axis), positions and
    momenta ``(B, N, 3)`` with ``N = nx ny nz`` in C order of the grid.
    """

    def __init__(
        self,
        n_particles: int | Sequence[int] = 64,
        box_size: float | Sequence[float] = 256.0,
        mesh_factor: int = 1,
        a_start: float = 0.1,
        steps: int | Sequence[float] = 10,
        *,
        a_end: float = 1.0,
        cosmology: Cosmology | None = None,
        power_spectrum="eisenstein_hu",
        lpt_order: int = 2,
        integrator: str = "fastpm",
        gradient: str = "fd4",
        laplacian: str = "exact",
        cic_compensation: bool = False,
        force_correction: Callable | None = None,
        paint_order: str = "cic",
        window_compensation: bool = False,
        dtype: torch.dtype = torch.float32,
        checkpoint: bool = False,
    ):
        super().__init__()
        self.particle_shape = as_shape(n_particles, "n_particles")
        self.box_size = as_box_size(box_size)
        if isinstance(mesh_factor, bool) or not float(mesh_factor).is_integer() or int(mesh_factor) < 1:
            raise ValueError(f"`mesh_factor` must be a positive integer, got {mesh_factor!r}")
        self.mesh_factor = int(mesh_factor)
        self.scale_factors = _scale_factors(a_start, steps, a_end)
        self.a_start = self.scale_factors[0]
        if lpt_order not in (1, 2):
            raise ValueError(f"`lpt_order` must be 1 or 2, got {lpt_order!r}")
        self.lpt_order = lpt_order
        if integrator not in ("fastpm", "leapfrog"):
            raise ValueError(f"`integrator` must be 'fastpm' or 'leapfrog', got {integrator!r}")
        self.integrator = integrator
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"`dtype` must be torch.float32 or torch.float64, got {dtype}")
        self.dtype = dtype
        if cosmology is None:
            cosmology = Planck15()
        if not isinstance(cosmology, Cosmology):
            raise ValueError(f"`cosmology` must be a torchpm.Cosmology, got {type(cosmology).__name__}")
        self.cosmology = cosmology
        self.power = resolve_power(power_spectrum)
        if force_correction is not None and not callable(force_correction):
            raise ValueError("`force_correction` must be a callable (k, a) -> filter, e.g. an nn.Module")
        # An nn.Module correction becomes a submodule: .to() moves it, .parameters() lists it.
        self.force_correction = force_correction
        self.checkpoint = bool(checkpoint)
        self.kernel_options = dict(gradient=gradient, laplacian=laplacian)
        for name, value in (("cic_compensation", cic_compensation), ("window_compensation", window_compensation)):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {value!r}")
        self.paint_order = ORDER_NAMES[order_number(paint_order, "Simulation", "paint_order")]
        if cic_compensation and (window_compensation or self.paint_order != "cic"):
            raise ValueError(
                "`cic_compensation` is the CIC-only older switch; with `paint_order` or "
                "`window_compensation` use `window_compensation=True` alone"
            )
        self.cic_compensation = cic_compensation
        self.window_compensation = window_compensation

        self.mesh_shape = tuple(n * self.mesh_factor for n in self.particle_shape)
        self.particle_mesh = LocalMesh(self.particle_shape)
        self.force_mesh = LocalMesh(self.mesh_shape)
        self.particle_cell = tuple(b / n for b, n in zip(self.box_size, self.particle_shape))
        self.cell_size = tuple(b / n for b, n in zip(self.box_size, self.mesh_shape))
        self.n_total = math.prod(self.particle_shape)
        # Mesh cells per particle: the painted density then has mean 1.
        self.particle_mass = math.prod(self.mesh_shape) / self.n_total
        if isinstance(self.power, PowerTable):
            self.power.check_covers(*self._k_range())
        self._kernels: dict = {}
        self._constant_cache: dict = {}
        # A buffer so that .to(device) tells us where to run.
        self.register_buffer("_anchor", torch.zeros((), dtype=dtype), persistent=False)

    # ------------------------------------------------------------------------------
    def _k_range(self):
        """Smallest and largest |k| (h/Mpc) of the particle grid, where P is evaluated."""
        k_min = min(2 * math.pi / b for b in self.box_size)
        k_max = math.sqrt(sum((math.pi * n / b) ** 2 for n, b in zip(self.particle_shape, self.box_size)))
        return k_min, k_max

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    @property
    def steps(self) -> int:
        return len(self.scale_factors) - 1

    def kernels(self, which: str) -> FourierKernels:
        """The cached :class:`FourierKernels` of the ``"particle"`` grid or the ``"force"`` mesh."""
        key = (which, self.device, self.dtype)
        if key not in self._kernels:
            if which == "particle":
                mesh, cell, compensate = self.particle_mesh, self.particle_cell, False
            else:
                mesh, cell, compensate = self.force_mesh, self.cell_size, self.cic_compensation
            window = self.paint_order if which == "force" and self.window_compensation else None
            self._kernels[key] = FourierKernels(
                mesh,
                cell,
                cic_compensation=compensate,
                window_compensation=window,
                dtype=self.dtype,
                device=self.device,
                **self.kernel_options,
            )
        return self._kernels[key]

    def white_noise(self, batch: int = 1, seed: int = 0) -> torch.Tensor:
        """Seeded white noise ``(batch, *n_particles)`` on this module's device and dtype."""
        return make_white_noise(
            self.particle_shape, batch=batch, seed=seed, dtype=self.dtype, device=self.device, mesh=self.particle_mesh
        )

    def _check_field(self, field, name) -> torch.Tensor:
        if not isinstance(field, torch.Tensor):
            raise ValueError(f"`{name}` must be a tensor of shape (B, *{self.particle_shape}), got {type(field).__name__}")
        if tuple(field.shape[-3:]) != self.particle_shape or field.dim() not in (3, 4):
            raise ValueError(
                f"`{name}` must have shape (B, {', '.join(map(str, self.particle_shape))}) or "
                f"{self.particle_shape}, got {tuple(field.shape)}"
            )
        if field.is_complex() or not field.is_floating_point():
            raise ValueError(f"`{name}` must be a real floating-point tensor, got {field.dtype}")
        check_finite(field, name)
        if field.dim() == 3:
            field = field.unsqueeze(0)
        return field.to(dtype=self.dtype, device=self.device)

    def _cached(self, name, cosmology, build):
        """``build()``, reused while the cosmology's values are unchanged and nothing
        about it needs gradients (then the result is a constant of the run)."""
        parameters = cosmology.parameters().values()
        if any(p.requires_grad for p in parameters):
            return build()
        key = (name, tuple(float(p) for p in parameters), self.device, self.dtype)
        if key in self._constant_cache:
            return self._constant_cache[key]
        result = build()
        tensors = result if isinstance(result, torch.Tensor) else result.values
        if not (torch.is_grad_enabled() and tensors.requires_grad):  # e.g. a power callable with parameters
            # One entry per kind: a new cosmology replaces the old one.
            for old in [k for k in self._constant_cache if k[0] == name]:
                del self._constant_cache[old]
            self._constant_cache[key] = result
        return result

    def growth_table(self, cosmology: Cosmology | None = None):
        """The :class:`~torchpm.cosmology.GrowthTable` of a run (built once per cosmology)."""
        cosmology = cosmology or self.cosmology
        a_min = min(1e-3, 0.5 * self.a_start)
        return self._cached("growth", cosmology, lambda: growth_table(cosmology, a_min=a_min))

    def linear_field(self, white_noise: torch.Tensor, cosmology: Cosmology | None = None) -> torch.Tensor:
        """The linear overdensity at ``a = 1`` on the particle grid, ``(B, *n_particles)``."""
        noise = self._check_field(white_noise, "white_noise")
        cosmology = cosmology or self.cosmology
        kernels = self.kernels("particle")
        amplitude = self._cached(
            "power", cosmology, lambda: power_kernel(kernels, self.box_size, self.power, cosmology)
        )
        return linear_field(noise, amplitude, self.particle_mesh)

    def linear_power(self, k, cosmology: Cosmology | None = None) -> torch.Tensor:
        """The linear power at ``a = 1`` used by this simulation, at ``k`` in h/Mpc."""
        cosmology = (cosmology or self.cosmology)
        return self.power(torch.as_tensor(k, dtype=torch.float64).to(cosmology.device), cosmology)

    # ------------------------------------------------------------------------------
    def forward(
        self,
        white_noise: torch.Tensor | None = None,
        *,
        linear_field: torch.Tensor | None = None,
        callback: Callable | None = None,
        return_mesh_units: bool = False,
    ) -> SimulationState:
        """Run the simulation from white noise (or from a given linear field).

        Args:
            white_noise: ``(B, *n_particles)`` or ``n_particles``-shaped standard normal noise.
            linear_field: instead of ``white_noise``, the linear overdensity at ``a = 1``
                on the particle grid (same shapes).
            callback: called as ``callback(step, a)`` after the LPT (step 0) and after
                each step, e.g. to advance a progress bar.
            return_mesh_units: return positions (unwrapped) and momenta in force-mesh cells.

        Returns:
            :class:`SimulationState` at the last scale factor.
        """
        if (white_noise is None) == (linear_field is None):
            raise ValueError("pass exactly one of `white_noise` and `linear_field`")
        cosmology = self.cosmology
        table = self.growth_table(cosmology)
        if linear_field is None:
            delta = self.linear_field(white_noise, cosmology)
        else:
            delta = self._check_field(linear_field, "linear_field")
        positions, momenta = self.lpt(delta, table)
        if callback is not None:
            callback(0, self.a_start)
        if self.steps:
            positions, momenta = self.evolve(positions, momenta, table, callback=callback)
        if return_mesh_units:
            return SimulationState(positions, momenta, self.scale_factors[-1])
        return self.to_physical(positions, momenta, self.scale_factors[-1])

    def lpt(self, delta: torch.Tensor, table=None):
        """LPT positions and momenta at ``a_start`` in force-mesh cells, each ``(B, N, 3)``."""
        table = table or self.growth_table()
        psi1, psi2 = lpt_displacements(delta, self.kernels("particle"), self.lpt_order)
        growth = table.at(torch.tensor(self.a_start, dtype=torch.float64))
        q = grid_positions(
            self.particle_shape, self.mesh_factor, dtype=self.dtype, device=self.device,
            offset=self.particle_mesh.local_real_offset,
        )
        return lpt_initial_state(psi1, psi2, growth, q, self.cell_size)

    def forces(self, positions: torch.Tensor, a) -> torch.Tensor:
        """PM forces ``(B, N, 3)`` in mesh units at positions in force-mesh cells."""
        return compute_forces(
            positions,
            self.kernels("force"),
            a=a,
            particle_mass=self.particle_mass,
            force_scale=1.5 * self.cosmology.Omega_m,
            force_correction=self.force_correction,
            order=self.paint_order,
        )

    def evolve(self, positions, momenta, table, callback=None):
        """Integrate from ``a_start`` over ``scale_factors`` (mesh units in and out)."""
        factors = step_factors(
            table, torch.tensor(self.scale_factors, dtype=torch.float64), self.integrator
        )
        forces = self.forces(positions, factors[0].a_start)
        for number, factor in enumerate(factors, start=1):
            if self.checkpoint and torch.is_grad_enabled():
                positions, momenta, forces = torch.utils.checkpoint.checkpoint(
                    kick_drift_kick, positions, momenta, forces, factor, self.forces, use_reentrant=False
                )
            else:
                positions, momenta, forces = kick_drift_kick(positions, momenta, forces, factor, self.forces)
            if callback is not None:
                callback(number, float(factor.a_end))
        return positions, momenta

    # ------------------------------------------------------------------------------
    def to_physical(self, positions, momenta, a) -> SimulationState:
        """Mesh-unit particles to a :class:`SimulationState` in Mpc/h (positions wrapped)."""
        cell = torch.tensor(self.cell_size, dtype=positions.dtype, device=positions.device)
        box = torch.tensor(self.box_size, dtype=positions.dtype, device=positions.device)
        physical = torch.remainder(positions * cell, box)
        # remainder can round up to exactly the box size in float32; fold it back.
        physical = torch.where(physical >= box, physical - box, physical)
        return SimulationState(physical, momenta * cell, a)

    def density(self, state: SimulationState | torch.Tensor) -> torch.Tensor:
        """The CIC-painted density ``1 + delta`` (mean 1) on the force mesh, ``(B, *mesh_shape)``.

        Accepts a :class:`SimulationState` or positions ``(B, N, 3)`` in Mpc/h.
        """
        positions = state.positions if isinstance(state, SimulationState) else state
        cell = torch.tensor(self.cell_size, dtype=positions.dtype, device=positions.device)
        return self.force_mesh.paint(positions / cell) * self.particle_mass

    def extra_repr(self) -> str:
        return (
            f"n_particles={self.particle_shape}, box_size={self.box_size}, mesh_factor={self.mesh_factor}, "
            f"steps={self.steps}, a={self.scale_factors[0]:.4g}->{self.scale_factors[-1]:.4g}, "
            f"integrator={self.integrator!r}, lpt_order={self.lpt_order}, dtype={self.dtype}"
        )
