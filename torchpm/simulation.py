"""`torchpm.Simulation`: the differentiable FastPM simulation as an ``nn.Module``."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch
from torch import nn

from .config import as_int, simulation_arguments
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
from .mesh import LocalMesh
from .fourier import FourierKernels
from .pm import compute_forces, kick_drift_kick, step_factors
from .resources import check_memory, estimate_memory

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
        cic_compensation: deconvolve the CIC window in the force kernel.
        force_correction: optional callable or ``nn.Module`` ``(k, a) -> filter``
            (``k``: ``|k|`` mesh in h/Mpc, ``a``: 0-d tensor) multiplying the potential.
        dtype: of particles and fields (float32 default; the background is float64).
        checkpoint: recompute each step in the backward pass instead of keeping its
            intermediate meshes, so memory does not grow with the number of steps.
        memory_check: ``"error"`` (default) refuses a run whose estimated peak memory
            (:func:`torchpm.resources.estimate_memory`) exceeds what the device has
            available — at construction (CPU, batch 1) and before each run on the
            module's device with the actual batch; ``"warn"`` warns; ``"off"`` skips.

    Plain arguments are checked by :func:`torchpm.config.simulation_arguments` (the
    declaration shared with the CLI): strings, bools and non-integral floats where
    numbers or shapes are expected are errors.

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
        dtype: torch.dtype = torch.float32,
        checkpoint: bool = False,
        memory_check: str = "error",
    ):
        super().__init__()
        checked = simulation_arguments(
            n_particles=n_particles, box_size=box_size, mesh_factor=mesh_factor, a_start=a_start, steps=steps,
            a_end=a_end, lpt_order=lpt_order, integrator=integrator, gradient=gradient, laplacian=laplacian,
            cic_compensation=cic_compensation, checkpoint=checkpoint,
        )
        self.particle_shape = checked["particle_shape"]
        self.box_size = checked["box_size"]
        self.mesh_factor = checked["mesh_factor"]
        self.scale_factors = checked["scale_factors"]
        self.a_start = self.scale_factors[0]
        self.lpt_order = checked["lpt_order"]
        self.integrator = checked["integrator"]
        if memory_check not in ("error", "warn", "off"):
            raise ValueError(f"`memory_check` must be 'error', 'warn' or 'off', got {memory_check!r}")
        self.memory_check = memory_check
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"`dtype` must be torch.float32 or torch.float64, got {dtype}")
        self.dtype = dtype
        if cosmology is None:
            cosmology = Planck15()
        if not isinstance(cosmology, Cosmology):
            raise ValueError(f"`cosmology` must be a torchpm.Cosmology, got {type(cosmology).__name__}")
        self.cosmology = cosmology
        try:
            self.power = resolve_power(power_spectrum)
        except UnicodeDecodeError:
            raise ValueError(f"`power_spectrum`: {power_spectrum!r} is not a UTF-8 text table (a binary file?)") from None
        if force_correction is not None and not callable(force_correction):
            raise ValueError("`force_correction` must be a callable (k, a) -> filter, e.g. an nn.Module")
        # An nn.Module correction becomes a submodule: .to() moves it, .parameters() lists it.
        self.force_correction = force_correction
        self.checkpoint = checked["checkpoint"]
        self.kernel_options = dict(gradient=checked["gradient"], laplacian=checked["laplacian"])
        self.cic_compensation = checked["cic_compensation"]
        # Before any allocation: refuse a run that cannot fit (the module starts on the CPU).
        self._memory_checked: set = set()
        self._check_memory(torch.device("cpu"), 1)

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

    def memory_estimate(self, batch: int = 1, ranks: int | None = None):
        """Estimated peak memory per rank, a :class:`torchpm.resources.MemoryEstimate` (bytes);
        ``ranks`` defaults to the size of the force mesh's process grid (1 on one device)."""
        if ranks is None:
            ranks = getattr(getattr(getattr(self, "force_mesh", None), "grid", None), "size", 1)
        return estimate_memory(self.particle_shape, self.mesh_factor, self.dtype, batch=batch, ranks=ranks)

    def _check_memory(self, device: torch.device, batch: int) -> None:
        key = (str(device), int(batch))
        if self.memory_check == "off" or key in self._memory_checked:
            return
        check_memory(self.memory_estimate(batch), device, self.memory_check, what=f"this Simulation (batch {batch})")
        self._memory_checked.add(key)

    def step_index(self, a: float) -> int:
        """The index of ``a`` in :attr:`scale_factors` (0: ``a_start``), or a ValueError."""
        a = float(a)
        for index, value in enumerate(self.scale_factors):
            if abs(a - value) <= 1e-9 * value:
                return index
        raise ValueError(
            f"scale factor {a} is not one of this simulation's scale factors "
            f"({self.scale_factors[0]:.6g} to {self.scale_factors[-1]:.6g}, {self.steps} steps): "
            "a run can stop and resume only at the end of a step"
        )

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
            self._kernels[key] = FourierKernels(
                mesh, cell, cic_compensation=compensate, dtype=self.dtype, device=self.device, **self.kernel_options
            )
        return self._kernels[key]

    def white_noise(self, batch: int = 1, seed: int = 0) -> torch.Tensor:
        """Seeded white noise ``(batch, *n_particles)`` on this module's device and dtype."""
        batch = as_int("batch", batch, 1)
        seed = as_int("seed", seed, 0, 2**63 - 1)
        self._check_memory(self.device, batch)
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
        until: float | None = None,
    ) -> SimulationState:
        """Run the simulation from white noise (or from a given linear field).

        Args:
            white_noise: ``(B, *n_particles)`` or ``n_particles``-shaped standard normal noise.
            linear_field: instead of ``white_noise``, the linear overdensity at ``a = 1``
                on the particle grid (same shapes).
            callback: called as ``callback(step, a)`` after the LPT (step 0) and after
                each step, e.g. to advance a progress bar.
            return_mesh_units: return positions (unwrapped) and momenta in force-mesh cells
                (what :meth:`resume` with ``mesh_units=True`` continues bit for bit).
            until: stop at this scale factor (one of :attr:`scale_factors`) instead of the last.

        Returns:
            :class:`SimulationState` at ``until`` (default: the last scale factor).
        """
        if (white_noise is None) == (linear_field is None):
            raise ValueError("pass exactly one of `white_noise` and `linear_field`")
        stop = self.steps if until is None else self.step_index(until)
        field = white_noise if linear_field is None else linear_field
        if isinstance(field, torch.Tensor):
            self._check_memory(self.device, field.shape[0] if field.dim() == 4 else 1)
        cosmology = self.cosmology
        table = self.growth_table(cosmology)
        if linear_field is None:
            delta = self.linear_field(white_noise, cosmology)
        else:
            delta = self._check_field(linear_field, "linear_field")
        positions, momenta = self.lpt(delta, table)
        if not bool(torch.isfinite(positions).all() & torch.isfinite(momenta).all()):
            raise ValueError(
                "the LPT initial conditions are not finite: the linear power (`power_spectrum`, "
                f"`box_size` = {self.box_size}) is too large for {self.dtype}; check the power table's units "
                "((Mpc/h)^3) and the box size (Mpc/h)"
            )
        if callback is not None:
            callback(0, self.a_start)
        if stop:
            positions, momenta = self.evolve(positions, momenta, table, callback=callback, stop=stop)
        a = self.scale_factors[stop]
        if return_mesh_units:
            return SimulationState(positions, momenta, a)
        return self.to_physical(positions, momenta, a)

    def resume(
        self,
        state: SimulationState,
        *,
        mesh_units: bool = False,
        until: float | None = None,
        callback: Callable | None = None,
        return_mesh_units: bool = False,
    ) -> SimulationState:
        """Continue a run from ``state`` at one of :attr:`scale_factors`.

        The force at ``state.a`` is recomputed from the positions (on the CPU it is
        bit-identical to the one the uninterrupted run kept), so resuming from a
        mesh-unit state returned by ``forward(..., until=a, return_mesh_units=True)``
        (or stored in a snapshot) reproduces the uninterrupted run bit for bit.

        Args:
            state: particles in Mpc/h (positions, momenta ``(B, N, 3)``, in the Lagrangian
                C order of the particle grid), or in force-mesh cells with ``mesh_units=True``.
            until: stop at this scale factor (default: the last).
            callback: ``callback(step, a)`` after each step (steps numbered as in the full run).
            return_mesh_units: as in :meth:`forward`.
        """
        if not isinstance(state, SimulationState):
            raise TypeError(f"`state` must be a torchpm.SimulationState, got {type(state).__name__}")
        start = self.step_index(state.a)
        stop = self.steps if until is None else self.step_index(until)
        if stop < start:
            raise ValueError(f"`until` = {until} is before the state's scale factor {state.a}")
        positions, momenta = state.positions, state.momenta
        expected = (self.n_total, 3)
        for name, tensor in (("positions", positions), ("momenta", momenta)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or tuple(tensor.shape[1:]) != expected:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"`state.{name}` must have shape (B, {self.n_total}, 3), got {shape}")
            if tensor.dtype != self.dtype:
                raise ValueError(f"`state.{name}` has dtype {tensor.dtype}, this simulation runs in {self.dtype}")
            check_finite(tensor, f"state.{name}")
        self._check_memory(self.device, positions.shape[0])
        positions, momenta = positions.to(self.device), momenta.to(self.device)
        if not mesh_units:
            cell = torch.tensor(self.cell_size, dtype=self.dtype, device=self.device)
            positions, momenta = positions / cell, momenta / cell
        if stop > start:
            table = self.growth_table(self.cosmology)
            positions, momenta = self.evolve(positions, momenta, table, callback=callback, start=start, stop=stop)
        a = self.scale_factors[stop]
        if return_mesh_units:
            return SimulationState(positions, momenta, a)
        return self.to_physical(positions, momenta, a)

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
        )

    def evolve(self, positions, momenta, table, callback=None, start: int = 0, stop: int | None = None):
        """Integrate from ``scale_factors[start]`` to ``scale_factors[stop]`` (default: the
        whole run; mesh units in and out)."""
        # The factors of the whole run, then the slice: a resumed run uses the very same numbers.
        factors = step_factors(
            table, torch.tensor(self.scale_factors, dtype=torch.float64), self.integrator
        )[start:stop]
        forces = self.forces(positions, factors[0].a_start)
        for number, factor in enumerate(factors, start=start + 1):
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
