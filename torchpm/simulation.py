"""`torchpm.Simulation`: the differentiable FastPM simulation as an ``nn.Module``."""

from __future__ import annotations

import functools
import math
import numbers
import operator
import re
import warnings
import zlib
from typing import Callable, NamedTuple, Sequence

import torch
from torch import nn

from .config import BY_NAME, as_bool, as_int, simulation_arguments
from .cosmology import _BUILTIN_POWER, Cosmology, Planck15, growth_table, resolve_power, PowerTable, builtin_power_name
from .ic import (
    check_lpt_normalisation,
    fixed_amplitude as fix_amplitude,
    grid_positions,
    linear_field,
    lpt_displacements,
    lpt_initial_state,
    power_kernel,
    primordial_transfer,
    PRIMORDIAL_K,
    PRIMORDIAL_K_TABLE,
    white_noise as make_white_noise,
)
from .distributed.decomposition import PencilDecomposition
from .distributed.groups import GridGroups, WorldGroup, all_gather_grid, eager, unsummed_leaves
from .distributed.layout import balanced_grid
from .distributed.particles import _within_reach, members_not_each_once
from .mesh import LocalMesh
from ._transforms import active_transforms, is_transformed, outside_transforms, plain, transforms_active
from .fourier import FourierKernels
from .pm import StepFactors, add_scaled, add_scaled_, compute_forces, force_field, readout_kick_drift_, step_factors
from .resources import check_memory, estimate_memory
from .adjoint import ParticleMeshForce, adjoint_integrate
from .ordering import restore_id_order, sort_particles
from .ops import halo_widths
from .ops._arguments import ORDER_NAMES, order_number

__all__ = ["Simulation", "SimulationState"]


def _is_boolean(value) -> bool:
    """A Python, numpy or torch boolean (which float() and index() would read as 0 or 1)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def _step_number(value) -> int | None:
    """An integer step number (int, numpy integer, integer 0-d tensor), or None (a boolean
    too)."""
    if _is_boolean(value):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _values_key(value) -> str:
    """A number or tensor's values as text to 10 digits (a scale factor the ranks of a grid
    must agree on; plain values under torch.func transforms)."""
    if value is None:
        return "None"
    with outside_transforms():
        values = plain(value).detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        return repr(tuple(f"{v:.10g}" for v in values.reshape(-1).double().tolist()))


def _table_key(table) -> str:
    """A growth table's values to 10 digits, as two sums (equal tables built with other
    thread counts, or devices, differ in the last bits)."""
    values = getattr(table, "values", None)
    if not isinstance(values, torch.Tensor):
        return type(table).__name__
    with outside_transforms():
        values = plain(values).detach().double()
        return f"{tuple(values.shape)} {float(values.sum()):.10g} {float((values * values).sum()):.10g}"


# What a grid run starts from, agreed first: the ranks' later values follow from it.
_RUN_INPUT = "the run's input (`white_noise`, `linear_field` or `state`)"


def _check_run_arguments(callback, **flags) -> None:
    """A run's ``callback`` (callable or None) and boolean ``flags`` (``mesh_units``,
    ``return_mesh_units``: a string such as "false" would be truthy)."""
    if callback is not None and not callable(callback):
        raise ValueError(f"`callback` must be callable or None, got {type(callback).__name__}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"`{name}` must be True or False, got {value!r}")


def _check_state_tensors(state) -> None:
    """``state.positions`` and ``state.momenta`` floating ``(B, N, 3)`` of one shape, and
    ``state.ids`` None or an integer ``(B, N)`` tensor."""
    positions, momenta, ids = state.positions, state.momenta, state.ids
    for name, value in (("positions", positions), ("momenta", momenta)):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() != 3 \
                or value.shape[-1] != 3:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"`state.{name}` must be a floating-point tensor of shape (B, N, 3), got {shape}")
    if momenta.shape != positions.shape:
        raise ValueError(f"`state.momenta` must have the shape of `state.positions` {tuple(positions.shape)}, got "
                         f"{tuple(momenta.shape)}")
    if ids is not None and (not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex()
                            or ids.dtype == torch.bool
                            or tuple(ids.shape) != tuple(positions.shape[:2])):
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"`state.ids` must be None or an integer tensor of shape {tuple(positions.shape[:2])}, "
                         f"got {shape}")


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


class MeshUnitsState(SimulationState):
    """A :class:`SimulationState` whose positions and momenta are in force-mesh cells (the
    integrator's own values: ``return_mesh_units=True``, :func:`torchpm.io.restart_state`).
    ``density``, ``resume`` and ``write_snapshot`` read the units from the type, so such a
    state is never taken for Mpc/h; ``sim.to_physical(*state[:3], state.ids)`` converts."""

    __slots__ = ()


def _parameters_repr(cosmology: Cosmology) -> str:
    """A cosmology's parameter values as text, for the ranks of a grid to compare."""
    return repr({key: float(value.detach()) for key, value in cosmology.parameters().items()})


def _resolve_groups(grid, mesh, shapes=(), reach=0, argument_error=None):
    """The ``(group_axis0, group_axis1)`` of a ``grid`` or ``mesh`` argument (``"auto"``:
    the most square grid that can split the meshes ``shapes``, see ``balanced_grid``).

    ``argument_error``: this rank's error in the Simulation's other arguments (``shapes``
    are then unknown). On a process grid the ranks exchange their errors first, before
    any group is made, so that one rank's bad argument raises on every rank together
    rather than on that rank alone while the others wait in the first collective; with
    ``grid`` they then agree on the grid itself over the world, as ``new_group`` needs.
    """
    if grid is not None and mesh is not None:
        raise ValueError("pass at most one of `grid` and `mesh`")
    if mesh is not None:
        groups = _mesh_groups(mesh)
        GridGroups(groups).raise_together(argument_error, operation="Simulation's arguments")
        return groups
    world = _world_size()
    if grid is None or world == 1:
        if argument_error is not None:
            raise argument_error
        if grid is not None:
            _grid_shape(grid, world, shapes, reach)  # (1, 1), or an error saying why not
        return (None, None)
    # Several processes: each checks the grid, then the world exchanges the errors and
    # agrees on the grid before the collective new_group calls.
    shape, grid_error = None, None
    if argument_error is None:
        try:
            shape = _grid_shape(grid, world, shapes, reach)
        except ValueError as error:
            grid_error = error
    # (one all-reduce: a failing rank's values are placeholders, compared with no other)
    WorldGroup().agree("Simulation", [("`grid` as (P0, P1)", shape), ("`n_particles`", shapes[0] if shapes else None),
                                      ("the force mesh", shapes[1] if shapes else None)], argument_error or grid_error)
    from .distributed.groups import process_grid_groups

    return process_grid_groups(shape)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _mesh_groups(mesh):
    """The ``(group_axis0, group_axis1)`` of a ``mesh`` argument (no collective)."""
    if isinstance(mesh, PencilDecomposition):
        return tuple(mesh.groups)
    if isinstance(mesh, (tuple, list)):
        import torch.distributed as dist

        if len(mesh) != 2 or not all(g is None or isinstance(g, dist.ProcessGroup) for g in mesh):
            raise ValueError(
                f"`mesh` as process groups must be a pair (group_axis0, group_axis1) of ProcessGroups or None, "
                f"got {mesh!r}"
            )
        return tuple(mesh)
    if hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):
        if mesh.ndim not in (1, 2):
            raise ValueError(f"`mesh` must be a 1-D or 2-D DeviceMesh, got {mesh.ndim}-D")
        groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        groups = [g if mesh.size(i) > 1 else None for i, g in enumerate(groups)]
        return (groups[0], groups[1] if len(groups) > 1 else None)
    raise ValueError(
        "`mesh` must be a DeviceMesh, a PencilDecomposition or a pair of process groups, "
        f"got {type(mesh).__name__}"
    )


def _grid_shape(grid, world, shapes, reach) -> tuple[int, int]:
    """``(P0, P1)`` of a ``grid`` argument on a world of ``world`` processes (no collective)."""
    if isinstance(grid, str):
        if grid != "auto":
            raise ValueError(f"`grid` must be (P0, P1) or 'auto', got {grid!r}")
        grid = balanced_grid(world, shapes, reach)
    try:
        items = list(grid)
    except TypeError:
        raise ValueError(f"`grid` must be 2 positive integers (P0, P1), got {grid!r}") from None
    if len(items) != 2 or any(isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 1 for p in items):
        raise ValueError(f"`grid` must be 2 positive integers (P0, P1), got {grid!r}")
    p0, p1 = (int(p) for p in items)
    if p0 * p1 != world:
        raise ValueError(
            f"`grid` {(p0, p1)} needs {p0 * p1} ranks but the world size is {world}"
            + ("" if world > 1 else " (torch.distributed is not initialised: launch with torchrun and call "
               "torch.distributed.init_process_group first)")
            + ("; for a grid on a part of the world (e.g. one per data-parallel replica) pass `mesh=` instead: "
               "a DeviceMesh dimension (init_device_mesh(..., mesh_dim_names=('dp', 'sp'))['sp']) or a pair of "
               "process groups" if world > p0 * p1 else "")
        )
    return p0, p1


def _field_checksum(field: torch.Tensor) -> str:
    """Three float64 sums of ``field`` (all values, their 2-norm, every third along z) to 9
    digits: equal for one field on any device of a kind, and different for two draws;
    computed where the field lives, without a copy (one small transfer)."""
    detached = field.detach()
    sums = torch.stack([detached.sum(dtype=torch.float64),
                        torch.linalg.vector_norm(detached, dtype=torch.float64),
                        detached[..., ::3].sum(dtype=torch.float64)])
    return " ".join(f"{value:.9g}" for value in sums.tolist())


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
        lpt_normalisation: 2LPT growth normalisation: ``"fastpm"`` (default, FastPM and
            JaxPM: ``x = q + D1 Psi1 + 3/7 D2(a)/D2(1) Psi2``, exact only for
            Omega_m = 1) or ``"exact"`` (pmwd, PM++: ``-D2(a)/D1(1)^2`` with
            ``D2 -> -3/7 D1^2`` early; 0.85% larger 2LPT term for Planck15). See
            :mod:`torchpm.ic`.
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
            intermediate meshes (the state at every step boundary is still kept).
        adjoint: compute gradients by the adjoint method (:mod:`torchpm.adjoint`): the
            backward pass integrates backwards in time, so memory does not grow with
            the number of steps. Gradients reach the white noise, the cosmology's
            tensors and an ``nn.Module`` force correction's parameters. Works on a
            process grid too: particles migrate in the backward pass as well, and the
            gradients return to the ranks and slots the particles started from.
        memory_check: ``"error"`` (default) refuses a run whose estimated peak memory per
            rank (:func:`torchpm.resources.estimate_memory`) exceeds what the device has
            available — at construction (CPU, batch 1) and before each run on the
            module's device with the actual batch; ``"warn"`` warns; ``"off"`` skips.
        grid: ``(P0, P1)`` process grid to run on, over the default
            ``torch.distributed`` process group (``P0 * P1`` must equal its world
            size); ``"auto"`` for :func:`torchpm.distributed.balanced_grid` of the
            world size and the meshes (the most square grid that can split the particle
            grid and the force mesh for ``paint_order``). Default: one device.
        mesh: instead of ``grid``, a ``DeviceMesh`` (1-D or 2-D), a
            :class:`~torchpm.distributed.PencilDecomposition` (its groups are used) or a
            pair of process groups ``(group_axis0, group_axis1)``.
        particle_capacity: most particle slots per batch member one rank may hold
            (None, the default: buffers grow as needed). Exceeding it raises on
            every rank; on one device (or a 1 x 1 grid), which holds every
            particle, a bound below their number is refused here.
        sort_every: sort the particles into spatial order (:mod:`torchpm.ordering`)
            at the start of each integration and after the migration of every step
            whose number is a multiple of ``sort_every`` (0: never), so paint and
            readout find each particle's mesh lines in cache. Results change only by
            the order of the paint's sums; on one device the particles are returned
            in grid order whatever this is. A resumed run is bit-identical to the
            uninterrupted one when it resumes at a step the latter sorted at (every
            step for ``sort_every=1``). Default 0: on one device the particles stay
            in Lagrangian order, which is spatially coherent enough that on the
            2-core CPU a sort costs about what it saves at 128^3
            (benchmarks/RESULTS.md, issue 13). On a process grid arrivals fill
            the slots of the particles that left, and a 10-step 128^3 run on 2 and
            4 ranks stayed coherent enough that sorting did not pay either (on 4
            ranks sorting every step saved a fifth of paint and readout, ~12 ms,
            and the sort cost ~37 ms; RESULTS section 7). Sorting pays where the
            order is scrambled (particles given in random order: 1.5-1.8x per step
            at 128^3).
        primordial_kmax: zero the Gaussian potential of the initial conditions, so
            every Gaussian mode, at and above this fraction of the particle grid's
            (smallest) Nyquist wavenumber ``pi n / L``, before the ``f_nl`` square
            (FastPM's ``kmax_primordial_over_knyquist``: at 2/3 the square's aliases
            fall above 2/3 of the Nyquist wavenumber). Default 0: no cut. Applies
            whatever ``f_nl``, so runs that differ in ``f_nl`` alone share their modes.

    ``forward(white_noise)`` returns a :class:`SimulationState` in Mpc/h. Shapes on
    one device: white noise ``(B, nx, ny, nz)`` (or without the batch axis),
    positions and momenta ``(B, N, 3)`` with ``N = nx ny nz`` in C order of the grid.

    On a process grid (``torchrun``, one rank per device), every rank calls the same
    methods in the same order. The white noise and linear field are this rank's
    block of the particle grid (``particle_mesh.local_real_shape``; the global
    field is accepted too and cut), and a state holds the particles this rank owns:
    ``(B, n, 3)`` with ``n`` the largest count of any batch member on the rank,
    the other members padded with empty slots whose ``ids`` are ``-1`` (zero mass,
    zero momentum, in the cell of a neighbouring particle; a resume reads neither their
    positions nor their momenta). :meth:`gather` returns the whole state on every rank and
    :meth:`density` the local block of the density. Results equal the single-device
    run from the same seed up to rounding.
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
        lpt_normalisation: str = "fastpm",
        integrator: str = "fastpm",
        gradient: str = "fd4",
        laplacian: str = "exact",
        cic_compensation: bool = False,
        force_correction: Callable | None = None,
        paint_order: str = "cic",
        window_compensation: bool = False,
        dtype: torch.dtype = torch.float32,
        checkpoint: bool = False,
        adjoint: bool = False,
        grid=None,
        mesh=None,
        particle_capacity: int | None = None,
        memory_check: str = "error",
        sort_every: int = 0,
        primordial_kmax: float = 0.0,
    ):
        super().__init__()
        # On a process grid, one rank's invalid argument raises on every rank together (the
        # others would otherwise wait in the first collective): the error travels with the
        # exchange that comes before the grid's groups are made.
        argument_error = None
        try:
            self._take_arguments(
                n_particles=n_particles, box_size=box_size, mesh_factor=mesh_factor, a_start=a_start, steps=steps,
                a_end=a_end, cosmology=cosmology, power_spectrum=power_spectrum, lpt_order=lpt_order,
                lpt_normalisation=lpt_normalisation, integrator=integrator, gradient=gradient, laplacian=laplacian,
                cic_compensation=cic_compensation, force_correction=force_correction, paint_order=paint_order,
                window_compensation=window_compensation, dtype=dtype, checkpoint=checkpoint, adjoint=adjoint,
                particle_capacity=particle_capacity, memory_check=memory_check, sort_every=sort_every,
                primordial_kmax=primordial_kmax,
            )
        except (ValueError, TypeError) as error:
            if grid is None and mesh is None:
                raise
            argument_error = error
        cosmology = self.cosmology if argument_error is None else cosmology
        # ("auto": the particle grid needs a plane per rank, the force mesh the paint's reach)
        shapes, reach = ((), 0) if argument_error else (
            (self.particle_shape, self.mesh_shape), (1, max(halo_widths(self.paint_order))))
        groups = _resolve_groups(grid, mesh, shapes, reach, argument_error)
        if groups == (None, None):
            self.particle_mesh = LocalMesh(self.particle_shape)
            self.force_mesh = LocalMesh(self.mesh_shape)
        else:
            for name, shape in (("particle_mesh", self.particle_shape), ("force_mesh", self.mesh_shape)):
                try:
                    setattr(self, name, PencilDecomposition(shape, groups))
                except ValueError as error:
                    if "is too small" not in str(error):
                        raise
                    what = ("the particle grid `n_particles`" if name == "particle_mesh" else
                            "the force mesh (`n_particles` x `mesh_factor`)")
                    raise ValueError(f"Simulation: {what} {shape}: {error}") from None
            # The decompositions agreed on the shapes; the ranks must also run the same
            # physics (one rank's other box, cosmology or integrator would mix two runs).
            self.force_mesh.grid.agree("Simulation", [
                ("`box_size`", repr(self.box_size)),
                ("the scale factors (`a_start`, `steps`, `a_end`)", repr(tuple(self.scale_factors))),
                ("`cosmology`", repr({key: float(value.detach()) for key, value in cosmology.parameters().items()})),
                ("`power_spectrum`", _power_setting(power_spectrum, self.power)),
                ("`lpt_order`", self.lpt_order),
                ("`lpt_normalisation`", self.lpt_normalisation),
                ("`integrator`", self.integrator),
                ("`gradient`", self.kernel_options["gradient"]),
                ("`laplacian`", self.kernel_options["laplacian"]),
                ("`paint_order`", self.paint_order),
                ("`window_compensation`", self.window_compensation),
                ("`cic_compensation`", self.cic_compensation),
                ("`dtype`", str(dtype)),
                ("`checkpoint`", self.checkpoint),
                ("`adjoint`", self.adjoint),
                ("`particle_capacity`", repr(self.particle_capacity)),
                ("`sort_every`", self.sort_every),
                ("`primordial_kmax`", repr(self.primordial_kmax)),
                ("`force_correction`", "None" if force_correction is None else _callable_setting(force_correction)),
            ])
            self._check_blocks()  # the same answer on every rank: they agree on its inputs
        n_total = math.prod(self.particle_shape)
        if self.force_mesh.is_local and particle_capacity is not None and particle_capacity < n_total:
            # one device (or a 1x1 grid) holds every particle: a bound below that is exceeded at once
            raise ValueError(
                f"`particle_capacity` {particle_capacity} is below the {n_total} particles "
                f"(n_particles {self.particle_shape}) that one device holds; raise it or set it to None"
            )
        # Before any particle or mesh is allocated: refuse a run that cannot fit (the
        # module starts on the CPU; forward checks again on its device with its batch).
        self._memory_checked: set = set()
        self._check_memory(torch.device("cpu"), 1)
        self.particle_cell = tuple(b / n for b, n in zip(self.box_size, self.particle_shape))
        self.cell_size = tuple(b / n for b, n in zip(self.box_size, self.mesh_shape))
        self.n_total = math.prod(self.particle_shape)
        # Mesh cells per particle: the painted density then has mean 1.
        self.particle_mass = math.prod(self.mesh_shape) / self.n_total
        if isinstance(self.power, PowerTable):
            self.power.check_covers(*self._k_range())
        self._kernels: dict = {}
        self._constant_cache: dict = {}

    def _take_arguments(self, *, n_particles, box_size, mesh_factor, a_start, steps, a_end, cosmology,
                        power_spectrum, lpt_order, lpt_normalisation, integrator, gradient, laplacian,
                        cic_compensation, force_correction, paint_order, window_compensation, dtype, checkpoint,
                        adjoint, particle_capacity, memory_check, sort_every, primordial_kmax):
        """Check the constructor's arguments (all but ``grid`` and ``mesh``) and set what they give."""
        # Plain arguments: checked by the declaration shared with the CLI (torchpm.config).
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
        self.lpt_normalisation = check_lpt_normalisation(lpt_normalisation)
        self.integrator = checked["integrator"]
        if memory_check not in ("error", "warn", "off"):
            raise ValueError(f"`memory_check` must be 'error', 'warn' or 'off', got {memory_check!r}")
        self.memory_check = memory_check
        self.sort_every = BY_NAME["sort_every"].validate(sort_every)
        self.primordial_kmax = BY_NAME["primordial_kmax"].validate(primordial_kmax)
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"`dtype` must be torch.float32 or torch.float64, got {dtype}")
        # A buffer so that .to(device) tells us where to run, and .double() / .float() /
        # .to(dtype) in what precision (the `dtype` property).
        self.register_buffer("_anchor", torch.zeros((), dtype=dtype), persistent=False)
        if cosmology is None:
            cosmology = Planck15()
        if not isinstance(cosmology, Cosmology):
            raise ValueError(f"`cosmology` must be a torchpm.Cosmology, got {type(cosmology).__name__}")
        self.cosmology = cosmology
        try:
            self.power = resolve_power(power_spectrum)
        except UnicodeDecodeError:
            raise ValueError(f"`power_spectrum`: {power_spectrum!r} is not a UTF-8 text table (a binary file?)") from None
        except ValueError as error:
            if "`power_spectrum`" in str(error):
                raise
            # A table's own errors (missing file, malformed rows) name the argument too.
            raise ValueError(f"`power_spectrum`: {error}") from None
        # A spectrum of the cosmology alone (a name or a table; not a callable, which may
        # hold tensors of a torch.func transform) is a constant of the run: cached.
        self._pure_power = not callable(power_spectrum) or isinstance(power_spectrum, PowerTable)
        if isinstance(power_spectrum, str) and power_spectrum in _BUILTIN_POWER:
            # A built-in fit the cosmology does not suit (e.g. the BAO fit without baryons)
            # is refused here, naming both settings, rather than at the first linear field.
            try:
                with torch.no_grad():
                    self.power(torch.tensor([0.1], dtype=torch.float64, device=cosmology.device), cosmology)
            except ValueError as error:
                raise ValueError(f"`power_spectrum` {power_spectrum!r} with this `cosmology`: {error}") from None
        if force_correction is not None and not callable(force_correction):
            raise ValueError("`force_correction` must be a callable (k, a) -> filter, e.g. an nn.Module")
        # An nn.Module correction becomes a submodule: .to() moves it, .parameters() lists it.
        self.force_correction = force_correction
        self.checkpoint = checked["checkpoint"]
        self.adjoint = as_bool("adjoint", adjoint)
        self.kernel_options = dict(gradient=checked["gradient"], laplacian=checked["laplacian"])
        if checked["gradient"] == "exact" and self.mesh_factor > 1:
            warnings.warn(
                f"Simulation: gradient='exact' with mesh_factor={self.mesh_factor} overestimates the force on "
                "the particle lattice: the lattice's own density at the mesh's Nyquist frequency couples to a "
                "perturbation, and the exact (i k) gradient keeps that coupling where the 4-point one damps it "
                "(a plane wave at the box's fundamental mode, 16^3 particles: 1.15x the linear-theory force with "
                "mesh_factor 2, 1.30x with 4; 'fd4': 1.02x), so linear growth comes out too fast. Use "
                "gradient='fd4' (the default) with mesh_factor > 1.",
                stacklevel=3,
            )
        window_compensation = as_bool("window_compensation", window_compensation)
        self.paint_order = ORDER_NAMES[order_number(paint_order, "Simulation", "paint_order")]
        if checked["cic_compensation"] and (window_compensation or self.paint_order != "cic"):
            raise ValueError(
                "`cic_compensation` is the CIC-only older switch; with `paint_order` or "
                "`window_compensation` use `window_compensation=True` alone"
            )
        self.cic_compensation = checked["cic_compensation"]
        self.window_compensation = window_compensation

        if particle_capacity is not None and (
            isinstance(particle_capacity, bool) or not isinstance(particle_capacity, numbers.Integral)
            or particle_capacity < 1
        ):
            raise ValueError(f"`particle_capacity` must be None or a positive integer, got {particle_capacity!r}")
        self.particle_capacity = particle_capacity

        self.mesh_shape = tuple(n * self.mesh_factor for n in self.particle_shape)

    def _check_blocks(self):
        """On a grid, every block of the force mesh along a split axis must hold the reach
        of the paint stencil (its halo comes from one neighbour): said when the Simulation
        is built, naming the settings, not at the first force. (The fd4 gradient of blocks
        thinner than its reach is taken in Fourier space.)"""
        self.force_mesh.check_paint_order(
            self.paint_order, f"the force mesh {self.mesh_shape} (n_particles x mesh_factor)")

    # ------------------------------------------------------------------------------
    def _k_range(self):
        """Smallest and largest |k| (h/Mpc) of the particle grid, where P is evaluated."""
        k_min = min(2 * math.pi / b for b in self.box_size)
        k_max = math.sqrt(sum((math.pi * n / b) ** 2 for n, b in zip(self.particle_shape, self.box_size)))
        return k_min, k_max

    def memory_estimate(self, batch: int = 1, ranks: int | None = None):
        """Estimated peak memory per rank, a :class:`torchpm.resources.MemoryEstimate` (bytes);
        ``ranks`` defaults to the size of the process grid (1 on one device)."""
        if ranks is None:
            ranks = getattr(getattr(getattr(self, "force_mesh", None), "grid", None), "size", 1)
        return estimate_memory(self.particle_shape, self.mesh_factor, self.dtype, batch=batch, ranks=ranks)

    def _check_memory(self, device: torch.device, batch: int) -> None:
        """Refuse (or warn about) a ``batch`` that does not fit ``device`` (``memory_check``).
        Collective on a grid, once per device type, batch, dtype and mode: a rank short of
        memory raises ``MemoryError`` on every rank, not alone with the others waiting in
        the next collective (each rank checks its own device; the key leaves out the
        device index, which differs from rank to rank)."""
        key = (torch.device(device).type, int(batch), self.dtype, self.memory_check)
        if key in self._memory_checked:
            return
        error = None
        if self.memory_check != "off":
            try:
                check_memory(self.memory_estimate(batch), device, self.memory_check,
                             what=f"this Simulation (batch {batch})")
            except MemoryError as exc:
                error = str(exc)
        if not self.force_mesh.is_local:
            self.force_mesh.raise_together(error, MemoryError, operation="Simulation's memory check")
        elif error is not None:
            raise MemoryError(error)
        self._memory_checked.add(key)

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    @property
    def dtype(self) -> torch.dtype:
        """float32 or float64: the ``dtype`` it was built with, or what ``.double()``,
        ``.float()`` or ``.to(dtype)`` made it since (like any module)."""
        dtype = self._anchor.dtype
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"Simulation: runs in float32 or float64, but .to() / .half() made it {dtype}; "
                             "call .float() or .double()")
        return dtype

    @property
    def steps(self) -> int:
        return len(self.scale_factors) - 1

    def kernels(self, which: str) -> FourierKernels:
        """The cached :class:`FourierKernels` of the ``"particle"`` grid or the ``"force"`` mesh."""
        if which not in ("particle", "force"):
            raise ValueError(f"kernels: `which` must be 'particle' or 'force', got {which!r}")
        key = (which, self.device, self.dtype)
        if key not in self._kernels:
            if which == "particle":
                mesh, cell, compensate = self.particle_mesh, self.particle_cell, False
            else:
                mesh, cell, compensate = self.force_mesh, self.cell_size, self.cic_compensation
            window = self.paint_order if which == "force" and self.window_compensation else None
            with outside_transforms():  # geometry only: plain tensors, valid under any transform
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

    def white_noise(self, batch: int = 1, seed: int = 0, *, fixed_amplitude: bool = False,
                    paired: bool = False) -> torch.Tensor:
        """Seeded white noise ``(batch, *local block of the particle grid)`` on this module's
        device and dtype; the global field is the same on every process grid. Collective on
        a grid: the ranks check that they agree on every argument.

        Args:
            batch: number of independent fields (members ``0 .. batch - 1``).
            seed: integer seed (:func:`torchpm.ic.white_noise`).
            fixed_amplitude: set every Fourier amplitude of each member to its expectation,
                phases kept (:func:`torchpm.ic.fixed_amplitude`): the linear field's
                ``|delta(k)|^2`` is then ``P(k) N^2 / V`` (unnormalised DFT) mode by mode, with no cosmic
                variance (Angulo & Pontzen 2016).
            paired: return the partner of the field ``seed`` makes: its negative, every
                Fourier phase shifted by pi (with ``fixed_amplitude``, the negative of
                the fixed field). The two runs ``paired=False`` and ``paired=True`` of one
                seed are a pair, whose average cancels the leading-order effect of the
                phases (Villaescusa-Navarro et al. 2018).
        """
        error = None
        try:
            batch = as_int("batch", batch, 1)
            seed = as_int("seed", seed, 0, 2**63 - 1)
            fixed_amplitude = as_bool("fixed_amplitude", fixed_amplitude)
            paired = as_bool("paired", paired)
        except (TypeError, ValueError) as exc:  # (raised on every rank of a grid together)
            error = exc
        values = [("`seed`", seed), ("`batch`", batch), ("`fixed_amplitude`", fixed_amplitude), ("`paired`", paired)]
        # On a grid each rank makes its block of the field of `seed`: ranks with other
        # seeds would make blocks of other fields (collective there).
        # (and on its dtype and device type: the memory check below is collective once per those)
        values += [("`dtype` (now)", str(self._anchor.dtype)), ("the device type (now)", self.device.type),
                   ("`memory_check` (now)", self.memory_check)]
        self.particle_mesh.agree("Simulation.white_noise", [(name, repr(value)) for name, value in values], error)
        self._check_memory(self.device, batch)
        noise = make_white_noise(
            self.particle_shape, batch=batch, seed=seed, dtype=self.dtype, device=self.device, mesh=self.particle_mesh
        )
        if fixed_amplitude:
            noise = fix_amplitude(noise, self.particle_mesh)
        return -noise if paired else noise

    def _check_field(self, field, name) -> torch.Tensor:
        """This rank's block ``(B, *local shape)`` of a particle-grid field given as the local
        block or the whole field, with or without the batch axis. Every rank raises
        together when one rank's field is bad."""
        mesh = self.particle_mesh
        local = mesh.local_real_shape
        error = None
        if not isinstance(field, torch.Tensor):
            error = f"`{name}` must be a tensor of shape (B, *{local}), got {type(field).__name__}"
        elif field.dim() not in (3, 4) or tuple(field.shape[-3:]) not in (local, self.particle_shape):
            expected = f"(B, {', '.join(map(str, local))}) or {local}"
            if local != self.particle_shape:
                expected += f" (this rank's block of the {self.particle_shape} particle grid), or the whole grid"
            error = f"`{name}` must have shape {expected}, got {tuple(field.shape)}"
        elif field.is_complex() or not field.is_floating_point():
            error = f"`{name}` must be a real floating-point tensor, got {field.dtype}"
        elif field.shape[0] == 0 and field.dim() == 4:
            error = f"`{name}` has an empty batch axis; expected at least one field"
        elif not bool(torch.isfinite(field).all()):
            bad = int((~torch.isfinite(field)).sum())
            error = f"`{name}` contains {bad} NaN or infinite values; expected finite numbers"
        # A whole field given on every rank must be the same field: each rank takes its
        # block of it (a rank with its own unseeded draw would paint a block of another).
        # (On one device the block is the whole: nothing to compare, only the error.)
        whole = error is None and tuple(field.shape[-3:]) != local
        mesh.agree("Simulation.check_field", [(
            f"the whole `{name}` each rank passed (sums of its values; pass the same field, or each rank's block)",
            _field_checksum(field) if whole else "this rank's block")], error)
        if field.dim() == 3:
            field = field.unsqueeze(0)
        if tuple(field.shape[-3:]) != local:
            field = mesh.local_real_part(field)
        return field.to(dtype=self.dtype, device=self.device)

    def _check_transforms(self, operation):
        """Refuses the ``torch.func`` uses a run cannot honour, before it starts. Under
        ``torch.func.grad``/``vjp``/``jacrev`` a run takes the derivatives
        ``torch.autograd.grad`` takes; ``jvp``/``jacfwd`` are refused by the ops."""
        kinds = active_transforms()
        if not kinds:
            return
        if "jvp" in kinds:
            raise NotImplementedError(
                f"{operation}: forward-mode AD (torch.func.jvp, jacfwd, hessian, "
                "torch.autograd.forward_ad) is not supported: the ops have reverse-mode derivatives only. "
                "Use torch.func.jacrev (a Hessian: jacrev(jacrev(f))), or torch.autograd.functional.jvp, "
                "which takes a Jacobian-vector product by double backward."
            )
        if "vmap" in kinds:
            raise NotImplementedError(
                f"{operation}: torch.func.vmap over a simulation is not supported (the run checks its "
                "particles' values as it goes). Run independent simulations as a batch instead: white "
                "noise of shape (B, *n_particles) runs B of them in one call, and a loss of the batch "
                "gives their gradients together. torch.func.jacrev, whose vmap runs only in the backward "
                "pass, works."
            )
        if torch.is_grad_enabled() and self.adjoint:
            raise NotImplementedError(
                f"{operation}: adjoint=True runs its own backward pass with torch.autograd, which cannot "
                "run inside a torch.func transform; use torch.autograd.grad / backward with adjoint=True, "
                "or adjoint=False under torch.func"
            )
        if torch.is_grad_enabled() and self.checkpoint:
            raise NotImplementedError(
                f"{operation}: checkpoint=True saves its steps with saved-tensor hooks, which torch.func "
                "transforms do not support; use torch.autograd.grad / backward with checkpoint=True, or "
                "checkpoint=False under torch.func"
            )

    def _cached(self, name, cosmology, build, pure=True):
        """``build()``, reused while the cosmology's values are unchanged and nothing
        about it needs gradients (then the result is a constant of the run). ``pure``:
        ``build`` depends on nothing but the cosmology (not so for a user's spectrum
        callable, which may hold tensors of a torch.func transform)."""
        parameters = cosmology.parameters().values()
        if any(p.requires_grad or is_transformed(p) for p in parameters):
            return build()
        if not pure and transforms_active():
            return build()
        key = (name, tuple(float(p) for p in parameters), self.device, self.dtype)
        if key in self._constant_cache:
            return self._constant_cache[key]
        # Plain parameters: built outside any torch.func transform (whose wrappers would
        # escape through the cache), as the plain tensors they are without one.
        with outside_transforms():
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
        cosmology = _gaussian(self._replicated(cosmology or self.cosmology))
        a_min = min(1e-3, 0.5 * self.a_start)
        return self._cached("growth", cosmology, lambda: growth_table(cosmology, a_min=a_min))

    def linear_field(self, white_noise: torch.Tensor, cosmology: Cosmology | None = None) -> torch.Tensor:
        """The linear overdensity at ``a = 1`` on the particle grid, ``(B, *n_particles)``."""
        noise = self._check_field(white_noise, "white_noise")
        cosmology = self._replicated(cosmology or self.cosmology)
        f_nl = cosmology.f_nl
        # The spectrum and the transfer do not depend on f_nl: built (and cached) from the
        # cosmology without it, also while f_nl needs a gradient.
        cosmology = _gaussian(cosmology)
        kernels = self.kernels("particle")
        power = self._replicated_callable(self.power)
        build = lambda: power_kernel(kernels, self.box_size, power, cosmology)  # noqa: E731
        # Gaussian unless f_nl is nonzero or differentiated (then its gradient is computed).
        local_png = bool(f_nl.detach() != 0) or f_nl.requires_grad or is_transformed(f_nl)
        # A spectrum module's values follow its weights, not only the cosmology: not cached.
        evaluate = build if isinstance(self.power, nn.Module) else (
            lambda: self._cached("power", cosmology, build, self._pure_power))
        transfer = None

        def evaluate_all():
            nonlocal transfer
            amplitude = self._primordial_cut(evaluate(), kernels)  # (outside the cache: the cut may change)
            if local_png:
                transfer = self._primordial_transfer(kernels, power, cosmology, f_nl)
            return amplitude

        if self.force_mesh.is_local:
            amplitude = evaluate_all()
        else:
            # On a grid each rank evaluates P on its own block: an error there, or a
            # gradient that could not be summed over the ranks, is raised on every rank.
            amplitude, error = None, None
            try:
                amplitude = evaluate_all()
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = f"{type(exc).__name__}: {exc}"
            else:
                error = self._unsummed_error(amplitude, "`power_spectrum`")
                if error is None and transfer is not None:
                    error = self._unsummed_error(transfer, "`power_spectrum`")
            self.force_mesh.raise_together(error, operation="Simulation.linear_field")
        if not local_png:
            return linear_field(noise, amplitude, self.particle_mesh)
        return linear_field(noise, amplitude, self.particle_mesh, f_nl=f_nl, transfer=transfer)

    def _primordial_cut(self, amplitude, kernels):
        """``amplitude`` zeroed at and above ``primordial_kmax`` times the particle grid's
        (smallest) Nyquist wavenumber; unchanged without a cut."""
        kmax = BY_NAME["primordial_kmax"].validate(self.primordial_kmax)
        if not kmax:
            return amplitude
        nyquist = min(math.pi * n / b for n, b in zip(self.particle_shape, self.box_size))
        # On |k|^2 in float64 whatever the field dtype, a mode on the threshold (a whole
        # shell of them when kmax n / 2 is an integer) counts as on it, not on either side
        # by rounding: float32 and float64 runs cut the same modes.
        k_squared = sum((w / c) ** 2 for w, c in zip(kernels.mesh.wavevectors(torch.float64, amplitude.device),
                                                     kernels.cell_size))
        keep = k_squared < (kmax * nyquist) ** 2 * (1.0 - 1e-12)
        return torch.where(keep, amplitude, torch.zeros_like(amplitude))

    def _primordial_transfer(self, kernels, power, cosmology, f_nl):
        """:func:`~torchpm.ic.primordial_transfer` of the particle grid (cached like the power
        kernel), the primordial amplitude read at ``PRIMORDIAL_K`` or at a table's first k."""
        k0 = PRIMORDIAL_K
        if isinstance(self.power, PowerTable):
            low = self.power.k_range[0]
            if low > PRIMORDIAL_K_TABLE * (1 + 1e-9):
                raise ValueError(
                    f"`f_nl` = {float(plain(f_nl).detach()):g} needs the linear power where the transfer function "
                    f"is 1, at k <= {PRIMORDIAL_K_TABLE:g} h/Mpc, but the `power_spectrum` table "
                    f"{self.power.path!r} starts at k = {low:.4g} h/Mpc; extend the table to smaller k"
                )
            k0 = max(k0, low)
        table = self.growth_table(cosmology)

        def build():
            return primordial_transfer(kernels, power, cosmology, table.D1_matter_era, k0)

        if isinstance(self.power, nn.Module):
            return build()
        return self._cached("primordial", cosmology, build, self._pure_power)

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
        until: float | None = None,
        callback: Callable | None = None,
        return_mesh_units: bool = False,
    ) -> SimulationState:
        """Run the simulation from white noise (or from a given linear field).

        Args:
            white_noise: ``(B, *n_particles)`` or ``n_particles``-shaped standard normal
                noise (on a process grid: this rank's block, or the whole grid).
            linear_field: instead of ``white_noise``, the linear overdensity at ``a = 1``
                on the particle grid (same shapes).
            until: stop at this scale factor (one of :attr:`scale_factors`); default the last.
            callback: called as ``callback(step, a)`` after the LPT (step 0) and after
                each step, e.g. to advance a progress bar.
            return_mesh_units: return positions and momenta in force-mesh cells, as the
                integrator holds them (positions wrapped only along split axes), e.g. to
                :meth:`resume` bit for bit.

        Returns:
            :class:`SimulationState` at ``until`` (default: the last scale factor).
        """
        self._check_transforms("Simulation")
        return self._forward(white_noise, linear_field, until, callback, return_mesh_units)

    def _forward(self, white_noise, linear_field, until, callback, return_mesh_units, emit=None, at=None,
                 operation="Simulation.forward", problem=None):
        """:meth:`forward`; with ``emit`` and ``at`` (scale factors, the last one ``until``),
        ``emit(number, positions, momenta, ids)`` at each earlier one (:meth:`_evolve`).
        ``problem``: an argument error found by the caller (raised on every rank)."""
        error, stop, emit_at = None, None, ()
        try:
            if problem:
                raise ValueError(problem)
            if (white_noise is None) == (linear_field is None):
                raise ValueError("pass exactly one of `white_noise` and `linear_field`")
            _check_run_arguments(callback, return_mesh_units=return_mesh_units)
            if at is not None:
                emit_at = self._at_indices(at, 0)
                until = self.scale_factors[emit_at[-1]]
            stop = self._step_index(until, "until")
        except (TypeError, ValueError) as exc:
            if self.force_mesh.is_local:
                raise
            error = exc
        field = white_noise if linear_field is None else linear_field
        if not self.force_mesh.is_local:
            # One rank's bad argument raises on every rank; so do settings changed on one
            # rank since construction, and other gradient needs (other backward collectives).
            batch = (field.shape[0] if field.dim() == 4 else 1) if isinstance(field, torch.Tensor) else None
            given = "white_noise" if linear_field is None else "linear_field"
            self.force_mesh.agree(operation, [(_RUN_INPUT, given), ("the last step (`until`)", stop),
                                              ("the steps of `at`", emit_at), ("the batch size of the input", batch),
                                              *self._run_values(field)],
                                  None if error is None else str(error))
            callback = self._guarded_callback(callback)
        if isinstance(field, torch.Tensor):
            self._check_memory(self.device, field.shape[0] if field.dim() == 4 else 1)
        self._check_correction()
        cosmology = self._replicated(self.cosmology)
        table = self.growth_table(cosmology)
        if linear_field is None:
            delta = self.linear_field(white_noise, cosmology)
        else:
            delta = self._check_field(linear_field, "linear_field")
        positions, momenta, ids = self.lpt(delta, table)
        if callback is not None:
            callback(0, self.a_start)
        if stop:
            if emit is not None and 0 in emit_at:
                emit(0, positions, momenta, ids)
            positions, momenta, ids = self._evolve(
                positions, momenta, table, callback=callback, ids=ids, stop=stop, cosmology=cosmology,
                emit=emit, emit_at=emit_at,
            )
        return self._state(positions, momenta, ids, self.scale_factors[stop], return_mesh_units)

    def _at_indices(self, at, first: int) -> tuple[int, ...]:
        """The step numbers of the scale factors ``at`` (a non-empty increasing sequence
        of :attr:`scale_factors`, none before step ``first``; a 1-D tensor or array too)."""
        if hasattr(at, "tolist") and getattr(at, "ndim", None) == 1:
            at = at.tolist()
        if isinstance(at, (str, bytes)) or not isinstance(at, Sequence) or not len(at):
            raise ValueError(f"`at` must be a non-empty sequence of the simulation's scale factors, got {at!r}")
        indices = []
        for index, a in enumerate(at):
            if isinstance(a, bool) or not isinstance(a, numbers.Real):
                raise ValueError(f"`at[{index}]` must be a scale factor (a number), got {a!r}")
            indices.append(self._step_index(a, f"at[{index}]"))
        if any(b <= a for a, b in zip(indices, indices[1:])):
            raise ValueError(f"`at` must be in increasing order without repeats, got {list(at)}")
        if indices[0] < first:
            raise ValueError(f"`at[0]` = {at[0]} is before the state's scale factor {self.scale_factors[first]}")
        return tuple(indices)

    def trajectory(
        self,
        white_noise: torch.Tensor | None = None,
        *,
        linear_field: torch.Tensor | None = None,
        state: SimulationState | None = None,
        at: Sequence[float],
        observe: Callable | None = None,
        callback: Callable | None = None,
        mesh_units: bool = False,
        return_mesh_units: bool = False,
    ) -> list:
        """The run's states at several scale factors, from one run.

        Runs from ``white_noise`` (or ``linear_field``) as :meth:`forward` does, or goes
        on from ``state`` as :meth:`resume` does, to the last of ``at``, and returns a
        list with the state at each scale factor of ``at``: each the state that
        ``forward(..., until=a)`` (or ``resume(state, until=a)``) returns, bit for bit
        on the CPU. The run does not stop there: stopping with ``until`` and going on
        with :meth:`resume` would evaluate the force at each stop twice.

        With ``observe``, the list holds ``observe(state)`` instead of each state (e.g. a
        lens plane, a power spectrum, a loss term, or a snapshot written to disk), so
        the run keeps no state it does not need.

        Gradients flow from everything returned (and from everything ``observe`` returns)
        to the white noise, the cosmology and the force correction, with autograd,
        ``checkpoint=True`` or ``adjoint=True``. With the adjoint method the run is one
        adjoint integration per stretch between the scale factors, each handing its
        last force, and in the backward pass that force's gradient, to the next: the
        backward pass still costs one force evaluation and pull-back per step, and the
        memory is that of the kept values plus, per scale factor of ``at``, the
        particles' positions, momenta and forces there (nothing on the mesh: a
        stretch's last force is evaluated again when its backward pass starts, in the
        call that pulls it back).

        Args:
            white_noise, linear_field: as in :meth:`forward`; or
            state: as in :meth:`resume` (with ``mesh_units``) instead.
            at: scale factors, each one of :attr:`scale_factors`, in increasing order (none
                before ``state.a``); the run ends at the last.
            observe: ``observe(state) -> anything``, called in the run at each scale factor
                of ``at`` with its :class:`SimulationState` (in force-mesh cells with
                ``return_mesh_units``). On a process grid it runs on every rank, in the
                same order, so it may be collective (:func:`torchpm.lensing.density_plane`,
                :func:`torchpm.io.write_snapshot`, spectra). After each call the ranks
                check together whether it raised (one small all-reduce): an exception on
                one rank raises a RuntimeError naming it on every rank (chained to the
                original on the rank that raised) instead of leaving the others waiting
                in the run's next collective. An observer with collectives of its own
                must still reach them on every rank or on none, as torchpm's do (they
                agree on their arguments first).
            callback: as in :meth:`forward`.

        Returns:
            A list, one entry per scale factor of ``at``: the state there, or what
            ``observe`` returned for it.
        """
        self._check_transforms("Simulation.trajectory")
        kept = []
        problem = None

        def finish(state):
            if observe is None:
                return state
            if self.force_mesh.is_local:
                return observe(state)
            return self._on_every_rank(observe, (state,), f"`observe` raised at a = {state.a:g}",
                                       "Simulation.trajectory (`observe`)")

        if observe is not None and not callable(observe):
            problem = f"`observe` must be callable or None, got {type(observe).__name__}"
        elif state is not None and (white_noise is not None or linear_field is not None):
            problem = "pass `white_noise`, `linear_field` or `state`, not several"

        def emit(number, positions, momenta, ids):
            kept.append(finish(self._state(positions, momenta, ids, self.scale_factors[number], return_mesh_units)))

        if state is None:
            final = self._forward(white_noise, linear_field, None, callback, return_mesh_units, emit=emit, at=at,
                                  operation="Simulation.trajectory", problem=problem)
        else:
            final = self._resume(state, mesh_units, None, callback, return_mesh_units, emit=emit, at=at,
                                 problem=problem)
        kept.append(finish(final))
        return kept

    def resume(
        self,
        state: SimulationState,
        *,
        mesh_units: bool = False,
        until: float | None = None,
        callback: Callable | None = None,
        return_mesh_units: bool = False,
    ) -> SimulationState:
        """Continue a run from ``state`` (at one of :attr:`scale_factors`) to ``until``.

        The force at ``state.a`` is recomputed from the positions, which on the CPU
        gives the same bits as the uninterrupted run when ``state`` holds the
        integrator's own values (``mesh_units=True``, from ``return_mesh_units``; on a
        process grid: on the same grid, each rank's particles in the slots it returned).

        Args:
            state: particles at ``state.a``; in Mpc/h, or in force-mesh cells with
                ``mesh_units=True`` or as a :class:`MeshUnitsState` (what
                ``return_mesh_units=True`` returns). ``ids`` may be None on one device.
            until: final scale factor (one of :attr:`scale_factors`); default the last.
            callback: as in :meth:`forward`, called after each step with the global step number.
        """
        self._check_transforms("Simulation.resume")
        return self._resume(state, mesh_units, until, callback, return_mesh_units)

    def _resume(self, state, mesh_units, until, callback, return_mesh_units, emit=None, at=None, problem=None):
        """:meth:`resume`; ``emit``, ``at`` and ``problem`` as in :meth:`_forward`."""
        error, start, stop, emit_at = None, None, None, ()
        operation = "Simulation.resume" if at is None else "Simulation.trajectory"
        try:
            if problem:
                raise ValueError(problem)
            if not isinstance(state, SimulationState):
                raise ValueError(f"`state` must be a SimulationState, got {type(state).__name__}")
            _check_run_arguments(callback, mesh_units=mesh_units, return_mesh_units=return_mesh_units)
            _check_state_tensors(state)
            if state.a is None:
                raise ValueError(f"`state.a` must be the state's scale factor (one of the simulation's scale "
                                 f"factors {self.scale_factors}), got None")
            start = self._step_index(state.a, "state.a")
            if at is not None:
                emit_at = self._at_indices(at, start)
                until = self.scale_factors[emit_at[-1]]
            stop = self._step_index(until, "until")
            if stop < start:
                raise ValueError(f"`until` ({self.scale_factors[stop]}) is before the state's scale factor ({state.a})")
            if state.ids is None and not self.force_mesh.is_local:
                raise ValueError("`state.ids` is required on a process grid")
        except (TypeError, ValueError, RuntimeError) as exc:  # (float() of a bad scale factor)
            if self.force_mesh.is_local:
                raise
            error = exc
        if not self.force_mesh.is_local:
            # One rank's bad state raises on every rank, and ranks resuming from other
            # steps (they would run other numbers of steps) are named.
            self.force_mesh.agree(operation, [(_RUN_INPUT, "state"), ("the state's step (`state.a`)", start),
                                              ("the last step (`until`)", stop), ("the steps of `at`", emit_at),
                                              *self._run_values(getattr(state, "positions", None))],
                                  None if error is None else str(error))
            callback = self._guarded_callback(callback)
        positions, momenta = state.positions, state.momenta
        if not (mesh_units or isinstance(state, MeshUnitsState)):
            cell = torch.tensor(self.cell_size, dtype=positions.dtype, device=positions.device)
            positions, momenta = positions / cell, momenta / cell
        positions = positions.to(dtype=self.dtype, device=self.device)
        momenta = momenta.to(dtype=self.dtype, device=self.device)
        ids = state.ids
        if ids is None:
            ids = torch.arange(positions.shape[1], device=self.device).expand(positions.shape[0], -1)
        ids = ids.to(device=self.device, dtype=torch.int64)
        _, positions, ids, momenta = self.force_mesh.migrate(
            positions, ids, momenta, capacity=self.particle_capacity
        )
        self._check_particles(ids, "resume")
        # (Here, not in the steps: `until` may be the state's own scale factor, and one
        # device migrates nothing, so nothing else would look at them.)
        empty = (ids < 0).unsqueeze(-1)
        bad = [name for name, values in (("positions", positions), ("momenta", momenta))
               if not bool((torch.isfinite(values.detach()) | empty).all())]
        self.force_mesh.raise_together(bad and f"resume: the state's {' and '.join(bad)} are not finite (NaN or inf)",
                                       operation="Simulation.resume")
        if stop > start:
            self._check_correction()
            cosmology = self._replicated(self.cosmology)
            if emit is not None and start in emit_at:
                emit(start, positions, momenta, ids)
            positions, momenta, ids = self._evolve(
                positions, momenta, self.growth_table(cosmology), callback=callback, ids=ids, start=start,
                stop=stop, cosmology=cosmology, emit=emit, emit_at=emit_at,
            )
        return self._state(positions, momenta, ids, self.scale_factors[stop], return_mesh_units)

    def _guarded_callback(self, callback):
        """``callback`` as a run on a grid calls it: one rank's exception raises on every
        rank together (a RuntimeError naming it; that rank's own error is its cause) instead
        of that rank stopping while the others wait in the next step's collectives. A rank
        may pass a callback where others pass None (a progress bar on rank 0): when any
        rank passes one, every rank checks after each step (one small all-reduce per step;
        one per run to find out). The callback itself on one device."""
        mesh = self.force_mesh
        if mesh.is_local:
            return callback
        if not int(mesh.grid.all_gather_counts([int(callback is not None)]).max()):
            return None

        def guarded(number, a):
            self._on_every_rank(callback or (lambda number, a: None), (number, a),
                                f"`callback` raised at step {number} (a = {a:g})", "Simulation (`callback`)")

        return guarded

    def _on_every_rank(self, function, args, what: str, operation: str):
        """``function(*args)`` (a user's observer or callback) on a grid: its value, or, when
        it raised on any rank, a RuntimeError ``what: <the error>`` on every rank (a rank's
        own exception its cause) instead of that rank stopping while the others wait in the
        next collective. One small all-reduce; none when the error was itself raised on
        every rank together (a torchpm check inside, e.g. ranks whose observers called
        different collectives): the others raised too and would not join it."""
        error, value = None, None
        try:
            value = function(*args)
        except Exception as exc:  # noqa: BLE001 - raised again below, on every rank
            error = exc
        message = error and f"{what}: {type(error).__name__}: {error}"
        if getattr(error, "raised_together", False):
            raise RuntimeError(message) from error
        try:
            self.force_mesh.raise_together(message, exception=RuntimeError, operation=operation)
        except RuntimeError as together:
            if error is None:
                raise
            raise together from error
        return value

    def _run_values(self, inputs) -> list:
        """What the ranks of a grid run must agree on at its start beyond the construction's
        settings: those a user may change afterwards (the cosmology, the precision, the
        correction's and the spectrum's weights) and which tensors need gradients (the
        backward pass runs collectives only where they do)."""
        def learned(module):
            # parameters, the buffers that need gradients and those a module names in its
            # `replicated_buffers` (NeuralSplineCorrection's conditions): the same on every
            # rank; other buffers may be per-rank by design (e.g. a filter on the rank's k block)
            if not isinstance(module, nn.Module):
                return []
            named = {id(getattr(m, name)) for m in module.modules()
                     for name in getattr(m, "replicated_buffers", ()) if isinstance(getattr(m, name, None), torch.Tensor)}
            return [*module.parameters(), *(b for b in module.buffers() if b.requires_grad or id(b) in named)]

        def weights(module):
            if not isinstance(module, nn.Module):
                return "none"
            with outside_transforms():  # (their values: plain tensors under torch.func transforms)
                tensors = [plain(t).detach().reshape(-1).to(device="cpu", dtype=torch.float64)
                           for t in learned(module) if t.is_floating_point()]
                return f"crc {zlib.crc32(torch.cat(tensors).numpy().tobytes()) if tensors else 0:08x}"

        grad = torch.is_grad_enabled()
        needs = (grad,
                 grad and isinstance(inputs, torch.Tensor) and inputs.requires_grad,
                 *(grad and bool(t.requires_grad) for t in self.cosmology.parameters().values()),
                 grad and any(t.requires_grad for t in learned(self.force_correction)),
                 grad and any(t.requires_grad for t in learned(self.power)))
        return [
            ("`cosmology` (its parameters now)", _parameters_repr(self.cosmology)),
            ("`dtype` (now)", str(self._anchor.dtype)),  # (the property raises for float16: agreed first)
            ("the device type (now)", self.device.type),
            ("`memory_check` (now)", self.memory_check),
            ("`force_correction` weights (now)", weights(self.force_correction)),
            ("`power_spectrum` weights (now)", weights(self.power)),
            ("gradients needed (grad mode; the input; each cosmological parameter; the correction; the spectrum)",
             tuple(int(n) for n in needs)),
        ]

    def _check_particles(self, ids, what: str, exact: bool = True) -> None:
        """Particles (their ``(B, n)`` ids after a migration) that this run can hold: per
        batch member, no more than its ``N`` particles over all ranks (``exact``: all of
        them, each id in ``[0, N)`` once; on one device, which gives every slot mass, no
        empty slot). Refuses, on every rank, a whole state given to every rank, which the
        migration would otherwise multiply. Collective on a grid."""
        mesh = self.force_mesh
        n = math.prod(self.particle_shape)
        counts = mesh.all_reduce((ids >= 0).sum(1).to(torch.int64)).tolist()
        slots = ids.shape[1]
        wrong = [(member, count) for member, count in enumerate(counts) if (count != n if exact else count > n)]
        if wrong:  # the same sums on every rank: every rank raises
            member, count = wrong[0]
            where = "" if mesh.is_local else f" over the {mesh.grid.size} ranks"
            hint = ("" if mesh.is_local else
                    ": give each rank its own share of the state (as a grid run returns it, or "
                    "read_snapshot(..., share=...)), not the whole state on every rank")
            if not exact:
                hint += ("; a grid state's positions include its empty slots: pass the state, or its "
                         "positions with `ids=state.ids`")
            raise ValueError(f"{what}: batch member {member} of the state holds {count} particles{where}, the "
                             f"simulation has {n} (n_particles {self.particle_shape}){hint}")
        if not exact:
            return
        if mesh.is_local and any(count != slots for count in counts):
            raise ValueError(f"{what}: the state holds empty slots (id -1), which one device would give mass: "
                             f"pass the {n} particles alone")
        error = None
        seen = torch.zeros(n, dtype=torch.bool, device=ids.device)  # one flag per particle: O(N), no sort
        for member, row in enumerate(ids):
            valid = row[row >= 0]
            if valid.numel() and int(valid.max()) >= n:
                error = f"{what}: batch member {member} holds the id {int(valid.max())}, outside 0 .. {n - 1}"
                break
            seen.zero_()
            seen[valid] = True
            if int(seen.sum()) != valid.numel():
                rank = "" if mesh.is_local else f" (after the migration, on grid coordinates {mesh.grid_coords})"
                error = (f"{what}: the ids of batch member {member} are not each of 0 .. {n - 1} once{rank}: "
                         "a state of another run, or a share given twice")
                break
        mesh.raise_together(error, operation="Simulation.check_particles")
        if mesh.is_local:
            return
        # Each rank's ids are distinct and in range and the ranks hold N of them: ids held
        # on two ranks (and as many missing) remain, found by power sums over the grid
        # (certainly when at most 4 are; more would need a coincidence mod a prime). The
        # same members on every rank: all raise.
        wrong = members_not_each_once(ids, n, mesh.grid)
        if wrong:
            raise ValueError(f"{what}: the ids of batch member {wrong[0]} are not each of 0 .. {n - 1} once "
                             f"over the {mesh.grid.size} ranks (an id is held on two ranks, another on none): "
                             "a state of another run, or a share given twice")

    def _step_index(self, a, name) -> int:
        """Index of scale factor ``a`` in :attr:`scale_factors` (None: the last)."""
        if a is None:
            return len(self.scale_factors) - 1
        try:
            if isinstance(a, (str, bytes)) or _is_boolean(a):  # (float() reads "1" and True)
                raise TypeError
            a = float(a)  # (a number, a numpy scalar or 0-d array, a one-element tensor)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"`{name}` must be a scale factor (a number), got {a!r}") from None
        for index, value in enumerate(self.scale_factors):
            if abs(value - a) <= 1e-12 * max(1.0, abs(value)):
                return index
        raise ValueError(f"`{name}` = {a} is not one of the simulation's scale factors {self.scale_factors}")

    def _state(self, positions, momenta, ids, a, mesh_units) -> SimulationState:
        if mesh_units:
            return MeshUnitsState(positions, momenta, a, ids)
        return self.to_physical(positions, momenta, a, ids)

    def lpt(self, delta: torch.Tensor, table=None):
        """LPT particles at ``a_start``, on the ranks owning their positions.

        Returns ``(positions, momenta, ids)``: ``(B, n, 3)`` in force-mesh cells and
        ``(B, n)`` int64 Lagrangian ids (``-1`` for empty slots on a process grid).
        """
        table = table or self.growth_table()
        psi1, psi2 = lpt_displacements(delta, self.kernels("particle"), self.lpt_order)
        growth = table.at(torch.tensor(self.a_start, dtype=torch.float64))
        block, offset = self.particle_mesh.local_real_shape, self.particle_mesh.local_real_offset
        q = grid_positions(block, self.mesh_factor, dtype=self.dtype, device=self.device, offset=offset)
        positions, momenta = lpt_initial_state(psi1, psi2, growth, q, self.cell_size, self.lpt_normalisation)
        # Before the migration, which would refuse the particles without saying why: not
        # finite, or beyond the ops' reach (+-2^40 cells; float64 overflows later).
        usable = bool(_within_reach(positions.detach()).all() & torch.isfinite(momenta.detach()).all())
        self.force_mesh.raise_together(
            None if usable else
            "the LPT initial conditions are not finite (or beyond +-2^40 cells): the linear power "
            f"(`power_spectrum`, `box_size` = {self.box_size}) is too large; check the power table's units "
            "((Mpc/h)^3), `sigma8` and the box size (Mpc/h)", operation="Simulation.lpt (initial conditions)"
        )
        ids = self._lagrangian_ids(block, offset).expand(positions.shape[0], -1)
        _, positions, ids, momenta = self.force_mesh.migrate(
            positions, ids, momenta, capacity=self.particle_capacity
        )
        return positions, momenta, ids

    def _lagrangian_ids(self, block, offset) -> torch.Tensor:
        """``(1, n)`` global C-order indices of the particle-grid block."""
        ny, nz = self.particle_shape[1], self.particle_shape[2]
        axes = [torch.arange(o, o + n, device=self.device, dtype=torch.int64) for n, o in zip(block, offset)]
        return ((axes[0].view(-1, 1, 1) * ny + axes[1].view(1, -1, 1)) * nz + axes[2].view(1, 1, -1)).reshape(1, -1)

    def _replicated(self, cosmology: Cosmology) -> Cosmology:
        """``cosmology`` whose differentiable parameters sum their gradients over the process
        grid in the backward pass, so every rank gets the gradient of the whole run."""
        grid = self.force_mesh.grid
        parameters = cosmology.parameters()
        if grid.size == 1 or getattr(cosmology, "_replicated_over", None) is grid \
                or not any(p.requires_grad for p in parameters.values()):
            return cosmology  # (replicating twice would sum twice)
        replicated = Cosmology(**{k: grid.replicate(v) for k, v in parameters.items()}, name=cosmology.name)
        replicated._replicated_over = grid
        return replicated

    def _correction(self):
        """The force correction, with its parameters' gradients summed over the process grid."""
        return self._replicated_callable(self.force_correction)

    def _replicated_callable(self, function, stand_ins: dict | None = None):
        """``function`` (a force correction or a power spectrum) whose gradients are summed
        over the process grid: an nn.Module's parameters and its buffers that need
        gradients (e.g. conditions computed from the cosmology) go through
        ``grid.replicate``. Anything else reaches the gradient unsummed, which
        :meth:`_unsummed_error` refuses. ``stand_ins`` (name -> tensor) replace some
        of the module's buffers (the adjoint's detached copies)."""
        if not isinstance(function, nn.Module):
            return function
        grid = self.force_mesh.grid
        named = {}
        if grid.size > 1:
            named.update(function.named_parameters())
            named.update((name, b) for name, b in function.named_buffers() if b.requires_grad)
        named.update(stand_ins or {})
        if not any(t.requires_grad for t in named.values()):
            return function
        if grid.size > 1:
            named = {name: grid.replicate(t) for name, t in named.items()}
        return lambda *args: torch.func.functional_call(function, named, args)

    def _unsummed_error(self, tensor, setting: str) -> str | None:
        """The error for a ``tensor`` computed from ``setting`` whose gradient would reach
        tensors that are not summed over the grid (each rank would hold only its share)."""
        leaves = unsummed_leaves(tensor)
        if not leaves:
            return None
        found = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in leaves[:3])
        return (
            f"{setting} computes with tensors that need gradients ({found}{', ...' if len(leaves) > 3 else ''}) "
            "that are neither the `cosmology`'s parameters nor parameters or buffers of an nn.Module given as "
            f"{setting}: on a process grid each rank evaluates it on its own block, so their gradients would hold "
            "only this rank's share. Make them parameters (or buffers) of an nn.Module passed as "
            f"{setting}, or detach them"
        )

    def _check_correction(self, error: str | None = None, *, operation: str = "Simulation.check_correction",
                          always: bool = False, values=None) -> None:
        """On a grid, before a run: one evaluation of the force correction, refused on every
        rank when a gradient through it would reach tensors not summed over the ranks
        (a plain callable's or a module's unregistered tensors). ``error``: the caller's
        own argument error, raised with it in one all-reduce; ``always`` makes that
        all-reduce even without a correction (the public methods' checks). ``values``: a
        callable giving ``(name, value)`` pairs the ranks must agree on too (called on a
        grid only: values read from the device sync the host), in the same all-reduce."""
        if self.force_mesh.is_local:
            if error:
                raise ValueError(error)
            return
        if self.force_correction is None and not always:
            return
        if error is None and self.force_correction is not None:
            try:
                error = self._unsummed_error(self._probe_correction(), "`force_correction`")
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = f"`force_correction` failed on its first evaluation: {type(exc).__name__}: {exc}"
        if values is None:
            self.force_mesh.raise_together(error, operation=operation)
            return
        try:
            agreed = values()
        except (TypeError, ValueError, RuntimeError) as exc:
            agreed, error = [], error or str(exc)
        self.force_mesh.agree(operation, agreed, error)

    def _probe_correction(self, stand_ins: dict | None = None) -> torch.Tensor:
        """The force correction (as a run calls it: replicated on a grid, with ``stand_ins``)
        evaluated once on the force mesh's |k| at ``a_start``, for the walks of its
        autograd graph that check where its gradients go."""
        a = torch.tensor(self.a_start, dtype=self.dtype, device=self.device)
        return self._replicated_callable(self.force_correction, stand_ins)(self.kernels("force").k_magnitude, a)

    def forces(self, positions: torch.Tensor, a, ids: torch.Tensor | None = None,
               cosmology: Cosmology | None = None) -> torch.Tensor:
        """PM forces ``(B, n, 3)`` in mesh units at positions in force-mesh cells, one per
        input particle (``ids`` marks empty slots, which get no mass). The box is periodic:
        on one device any position is taken; on a grid each rank passes the particles it
        owns, or periodic images of them (shifted by whole boxes), which are wrapped
        along the split axes (:meth:`~torchpm.distributed.PencilDecomposition.wrap`;
        the derivative of the wrap is 1). A particle owned by another rank is refused on
        every rank: forces does not migrate (``sim.force_mesh.migrate`` moves particles
        to their owners). On a grid each call first checks the force correction
        (:meth:`_check_correction`: one evaluation and one small all-reduce); runs use
        the unchecked :meth:`_forces`, checked once per run."""
        error = self._arrays_error("forces", positions, ids=ids)
        if error is None and ids is None and not self.force_mesh.is_local:
            error = "forces: `ids` is required on a process grid (the state's empty slots have id -1 and no mass)"
        if error is None and cosmology is not None and not isinstance(cosmology, Cosmology):
            error = f"forces: `cosmology` must be a torchpm.Cosmology or None, got {type(cosmology).__name__}"
        if error is None and (isinstance(a, (str, bytes)) or _is_boolean(a)):
            error = f"forces: `a` must be a scale factor (a number or a tensor), got {a!r}"
        # (on a grid the ranks agree on `a` and the cosmology: the correction reads `a`)
        self._check_correction(error, operation="Simulation.forces", always=True, values=lambda: [
            ("`a`", _values_key(a)), ("`cosmology` (its parameters)", _parameters_repr(cosmology or self.cosmology)),
            *self._run_values(positions)])
        # (a run's own particles are owned and inside [0, n) already: only here)
        positions = self.force_mesh.wrap(positions)
        weights = False
        if self.force_mesh.is_local and ids is not None:
            # (no host sync, so a compiled loop stays one graph; a run on one device has no
            # empty slot and paints without weights)
            weights = (ids >= 0).to(positions.dtype)
        return self._force(compute_forces, positions, a, ids, cosmology, weights=weights)

    def _arrays_error(self, operation: str, positions, momenta=None, ids=None) -> str | None:
        """What is wrong with the particle arrays a public method was given (None if nothing):
        ``positions`` (and ``momenta``) ``(B, n, 3)`` of this simulation's dtype and device,
        ``ids`` ``(B, n)`` int64."""
        expected = f"a (B, n, 3) {self.dtype} tensor on {self.device.type} (this simulation's dtype and device)"
        for name, tensor in (("positions", positions), ("momenta", momenta)):
            if tensor is None and name == "momenta":
                continue
            if not isinstance(tensor, torch.Tensor):
                return f"{operation}: `{name}` must be {expected}, got {type(tensor).__name__}"
            if (tensor.dim() != 3 or tensor.shape[-1] != 3 or tensor.dtype != self.dtype
                    or tensor.device.type != self.device.type):
                return (f"{operation}: `{name}` must be {expected}, got {tuple(tensor.shape)} {tensor.dtype} "
                        f"on {tensor.device.type}" + (" (use .to(sim.dtype) or sim.to(...))" if
                                                       tensor.dtype != self.dtype else ""))
            if name == "momenta" and tensor.shape != positions.shape:
                return f"{operation}: `momenta` must have the shape of `positions` {tuple(positions.shape)}, got {tuple(tensor.shape)}"
        if ids is not None and (not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64
                                or tuple(ids.shape) != tuple(positions.shape[:2])):
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            return f"{operation}: `ids` must be a (B, n) = {tuple(positions.shape[:2])} int64 tensor, got {got}"
        return None

    def _forces(self, positions, a, ids=None, cosmology=None):
        """:meth:`forces` inside a run (its checks made at the run's start)."""
        return self._force(compute_forces, positions, a, ids, cosmology)

    def _force(self, function, positions, a, ids, cosmology, weights=False):
        """``function`` (:func:`compute_forces` or :func:`force_field`) with this simulation's
        kernels, mass, cosmology, force correction and weights (from ``ids`` unless given:
        ``None`` for unit masses)."""
        cosmology = self._replicated(cosmology or self.cosmology)
        return function(
            positions,
            self.kernels("force"),
            a=a,
            particle_mass=self.particle_mass,
            force_scale=1.5 * cosmology.Omega_m,
            force_correction=self._correction(),
            weights=self._particle_weights(ids, positions.dtype) if weights is False else weights,
            order=self.paint_order,
        )

    def _particle_weights(self, ids, dtype):
        """``(B, n)`` masses (0 for the empty slots ``ids < 0``), or None when every slot is full."""
        # Only migration pads, and one device never migrates: no host sync per step there.
        if ids is not None and not self.force_mesh.is_local and bool((ids < 0).any()):
            return (ids >= 0).to(dtype)
        return None

    def _adjoint_force(self, function, cosmology, ids, stand_ins=None):
        """The PM force for :func:`torchpm.adjoint.adjoint_integrate`: ``function`` forward,
        a hand-written pull-back backward. ``ids()`` gives the current particle ids;
        ``stand_ins`` replace the correction's buffers (see :meth:`_adjoint_parameters`)."""
        cosmology = self._replicated(cosmology or self.cosmology)
        return ParticleMeshForce(
            function,
            self.kernels("force"),
            particle_mass=self.particle_mass,
            force_scale=lambda: 1.5 * cosmology.Omega_m,
            force_correction=self._replicated_callable(self.force_correction, stand_ins),
            weights=lambda: self._particle_weights(ids(), self.dtype),
            order=self.paint_order,
        )

    def _step(self, positions, momenta, forces, ids, factor: StepFactors, cosmology=None, sort=False):
        """One kick-drift-kick step with the migration after the drift (and the sort
        into spatial order after it when ``sort``), every update a new tensor (autograd
        sees every step)."""
        momenta = add_scaled(momenta, forces, factor.first_kick)
        positions = add_scaled(positions, momenta, factor.drift)
        # Both are new tensors of this step: the migration may write into them.
        _, positions, ids, momenta = self.force_mesh.migrate(
            positions, ids, momenta, capacity=self.particle_capacity, overwrite=True
        )
        if sort:
            positions, ids, momenta = sort_particles(self.force_mesh, positions, ids, momenta)
        forces = self._forces(positions, factor.a_end, ids, cosmology)
        momenta = add_scaled(momenta, forces, factor.second_kick)
        return positions, momenta, forces, ids

    def evolve(self, positions, momenta, table, callback=None, *, ids=None, start: int = 0, stop: int | None = None,
               cosmology: Cosmology | None = None):
        """Integrate from ``scale_factors[start]`` to ``scale_factors[stop]`` (mesh units in
        and out). Returns ``(positions, momenta, ids)``. On a grid ``ids`` is required (the
        LPT and the migrations leave empty slots, id -1); on one device, which gives every
        slot mass, it may hold no empty slot. On a grid each rank passes the particles it
        owns or periodic images of them (shifted by whole boxes), which are wrapped along
        the split axes as :meth:`forces` wraps them."""
        self._check_transforms("Simulation.evolve")
        error = self._arrays_error("evolve", positions, momenta, ids)
        if error is None and ids is None and not self.force_mesh.is_local:
            error = "evolve: `ids` is required on a process grid (the state's empty slots have id -1)"
        elif error is None and ids is not None and self.force_mesh.is_local and bool((ids < 0).any()):
            error = "evolve: `ids` holds empty slots (id -1), which one device would give mass: pass the particles alone"
        if error is None:
            first = _step_number(start)
            if first is None or not 0 <= first <= self.steps:
                error = (f"evolve: `start` must be a step number from 0 to {self.steps} (the steps of "
                         f"`scale_factors`), got {start!r}")
            elif stop is not None:
                last = _step_number(stop)
                if last is None or not first <= last <= self.steps:
                    error = (f"evolve: `stop` must be a step number from {first} to {self.steps} (the steps of "
                             f"`scale_factors`), got {stop!r}")
                stop = last
            start = first
        if error is None and cosmology is not None and not isinstance(cosmology, Cosmology):
            error = f"evolve: `cosmology` must be a torchpm.Cosmology or None, got {type(cosmology).__name__}"

        def agreed():
            # the steps, the cosmology and its growth table: mixed, the ranks integrated
            # two runs (or one waited in a migration the others never reached)
            return [("`start`", int(start)), ("`stop`", self.steps if stop is None else int(stop)),
                    ("`cosmology` (its parameters)", _parameters_repr(cosmology or self.cosmology)),
                    ("`table` (its values, to 10 digits)", _table_key(table)), *self._run_values(positions)]

        self._check_correction(error, operation="Simulation.evolve", always=True, values=agreed)
        callback = self._guarded_callback(callback)
        positions = self.force_mesh.wrap(positions)  # (a new tensor where it wraps: the caller's is not written)
        return self._evolve(positions, momenta, table, callback, ids=ids, start=start, stop=stop, cosmology=cosmology)

    def _evolve(self, positions, momenta, table, callback=None, *, ids=None, start: int = 0, stop: int | None = None,
                cosmology: Cosmology | None = None, emit: Callable | None = None, emit_at=()):
        """:meth:`evolve` inside a run (its checks made at the run's start).

        ``emit``: called as ``emit(number, positions, momenta, ids)`` after each step
        whose number is in ``emit_at`` (before ``stop``) with the particles as
        :meth:`evolve` would return them had it stopped there (on one device in id
        order), in tensors the integration does not write afterwards. The run goes on
        with the force it has, so emitting costs no force evaluation: the states are
        those of runs stopped there, bit for bit."""
        stop = self.steps if stop is None else stop
        if ids is None:
            ids = torch.arange(positions.shape[1], device=positions.device).expand(positions.shape[0], -1)
        factors = step_factors(
            table, torch.tensor(self.scale_factors, dtype=torch.float64), self.integrator
        )[start:stop]
        if not factors:
            return positions, momenta, ids
        emit_at = {number for number in emit_at if start < number < stop} if emit is not None else set()
        sort_every = self._sort_cadence(ids)

        def emitted(number, positions, momenta, ids, copy=False):
            state = self._id_order(positions, momenta, ids, sort_every)
            if copy:  # (the arrays the integration writes afterwards: those handed back as they are)
                state = tuple(out.clone() if out is given else out
                              for out, given in zip(state, (positions, momenta, ids)))
            emit(number, *state)

        # On a grid the slot order is the run's own and comes back with a state: sorting
        # there only at the cadence (start 0: after the LPT) lets a resumed run go on in
        # the order the uninterrupted one has (bit-identical). On one device the state
        # comes back in id order and is sorted again here.
        # (the fused path writes in place only into arrays that are this integration's own)
        own = bool(sort_every) and (self.force_mesh.is_local or start % sort_every == 0)
        if own:
            positions, ids, momenta = sort_particles(self.force_mesh, positions, ids, momenta)
        if self.adjoint and torch.is_grad_enabled():
            # One adjoint integration per stretch between emissions, each handing its last
            # force to the next (no force evaluated twice; its gradient comes back).
            forces, begin = None, 0
            for end in sorted(number - start for number in emit_at) + [len(factors)]:
                positions, momenta, ids, forces = self._evolve_adjoint(
                    positions, momenta, ids, factors[begin:end], cosmology, callback, start + begin, forces,
                    keep_last_force=end == len(factors),
                )
                if end < len(factors):
                    emitted(start + end, positions, momenta, ids)
                begin = end
            return self._id_order(positions, momenta, ids, sort_every)
        forces = self._forces(positions, factors[0].a_start, ids, cosmology)
        checkpoint = self.checkpoint and torch.is_grad_enabled()
        if not checkpoint and not (torch.is_grad_enabled() and any(
                tensor.requires_grad for tensor in (positions, momenta, forces))):
            positions, momenta, ids = self._evolve_fused(
                positions, momenta, forces, ids, factors, cosmology, callback, start, sort_every,
                emit=None if not emit_at else (lambda *state: emitted(*state, copy=True)), emit_at=emit_at, own=own,
            )
            return self._id_order(positions, momenta, ids, sort_every)
        # With a graph: each step's updates are new tensors.
        for number, factor in enumerate(factors, start=start + 1):
            sort = bool(sort_every) and number % sort_every == 0
            if checkpoint:
                positions, momenta, forces, ids = torch.utils.checkpoint.checkpoint(
                    self._step, positions, momenta, forces, ids, factor, cosmology, sort, use_reentrant=False
                )
            else:
                positions, momenta, forces, ids = self._step(positions, momenta, forces, ids, factor, cosmology, sort)
            if callback is not None:
                callback(number, float(factor.a_end))
            if number in emit_at:
                emitted(number, positions, momenta, ids)
        return self._id_order(positions, momenta, ids, sort_every)

    def _evolve_fused(self, positions, momenta, forces, ids, factors, cosmology, callback, start, sort_every,
                      emit=None, emit_at=(), own=False):
        """:meth:`evolve` outside a graph: the steps of :meth:`_step`, in the same order
        and with the same bits, but each step's second kick and the next step's first
        kick and drift ride on the readout of its force
        (:func:`torchpm.pm.readout_kick_drift_`), so no force array is written or read
        back. The particle arrays are updated in place once they are this integration's
        own (after the first update, or a sort here): the caller's tensors are never
        written. ``forces``: those at the first step's start. ``emit(number, positions,
        momenta, ids)``: called after each step whose number is in ``emit_at`` with the
        integration's own arrays (the caller copies what it keeps). ``own``: ``positions``
        and ``momenta`` are already this integration's (a sort here made them)."""
        update = add_scaled_ if own else add_scaled
        momenta = update(momenta, forces, factors[0].first_kick)
        positions = update(positions, momenta, factors[0].drift)
        del forces
        for index, factor in enumerate(factors):
            number = start + 1 + index
            following = factors[index + 1] if index + 1 < len(factors) else None
            # From the second step on, the ids are an earlier migration's or sort's.
            emit_here = self._emitter(emit, callback, number, factor) if number in emit_at else None
            positions, momenta, ids = self._fused_step(positions, momenta, ids, factor, following, cosmology,
                                                       sort=bool(sort_every) and number % sort_every == 0,
                                                       own_ids=index > 0, emit=emit_here)
            if callback is not None and emit_here is None:
                callback(number, float(factor.a_end))
        return positions, momenta, ids

    @staticmethod
    def _emitter(emit, callback, number, factor):
        """``emit`` of step ``number`` as :meth:`_fused_step` calls it: the step's callback first."""
        def emit_here(positions, momenta, ids):
            if callback is not None:
                callback(number, float(factor.a_end))
            emit(number, positions, momenta, ids)
        return emit_here

    def _fused_step(self, positions, momenta, ids, factor: StepFactors, following: StepFactors | None,
                    cosmology=None, sort=False, own_ids=False, emit=None):
        """A step of :meth:`_evolve_fused` on arrays it owns, whose first kick and drift are
        done: the migration (and the sort when ``sort``), the force at ``factor.a_end``,
        and in its readout the second kick and, unless this is the last step
        (``following`` None), the first kick and drift of ``following``. ``own_ids``: the
        ids are the integration's own too (the migration writes into them). ``emit``:
        called as ``emit(positions, momenta, ids)`` with the state at ``factor.a_end``:
        the second kick and the next first kick then take a readout each (the same
        bits: the fused readout is that composition)."""
        mesh = self.force_mesh
        plan, positions, ids, momenta = mesh.migrate(
            positions, ids, momenta, capacity=self.particle_capacity, overwrite=True, overwrite_ids=own_ids
        )
        # The masses from the migration's list of empty slots (a sort moves them).
        weights = plan.masses(positions.dtype)
        if sort:
            positions, ids, momenta = sort_particles(mesh, positions, ids, momenta)
            weights = self._particle_weights(ids, positions.dtype)
        field = self._force(force_field, positions, factor.a_end, ids, cosmology, weights)
        if emit is not None:
            positions, momenta = readout_kick_drift_(mesh, field, positions, momenta, [factor.second_kick],
                                                     order=self.paint_order)
            emit(positions, momenta, ids)
            if following is None:
                return positions, momenta, ids
            kicks = [following.first_kick]
        else:
            kicks = [factor.second_kick] if following is None else [factor.second_kick, following.first_kick]
        positions, momenta = readout_kick_drift_(mesh, field, positions, momenta, kicks,
                                                 None if following is None else following.drift,
                                                 order=self.paint_order)
        return positions, momenta, ids

    def _sort_cadence(self, ids) -> int:
        """``sort_every`` for this integration. On one device the particles come back in
        the order they came in, which :func:`restore_id_order` rebuilds from the ids when
        they are the grid's ``0 .. N-1`` in order (always, unless a caller passes its own
        ids: then the particles are left unsorted)."""
        if not self.sort_every or not self.force_mesh.is_local:
            return self.sort_every
        grid_order = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.sort_every if torch.equal(ids, grid_order) else 0

    def _id_order(self, positions, momenta, ids, sort_every):
        """On one device, sorted particles back in grid (id) order; on a grid the
        order is the run's own and ``ids`` say which particle is where, and the empty
        slots get back their zero momentum (the kicks after the last migration, which
        resets them, reached every slot). No result depends on an empty slot's
        momentum or position between migrations (a migration places it anew, and the
        arrivals by the occupied slots alone), so a resume from this state is
        bit-identical to the run going on."""
        if not self.force_mesh.is_local:
            return positions, momenta.masked_fill((ids < 0).unsqueeze(-1), 0), ids
        if not sort_every:
            return positions, momenta, ids
        positions, ids, momenta = restore_id_order(positions, ids, momenta)
        return positions, momenta, ids

    def _evolve_adjoint(self, positions, momenta, ids, factors, cosmology, callback, start, forces=None,
                        keep_last_force=True):
        """:meth:`evolve` with gradients by the adjoint method (:mod:`torchpm.adjoint`).
        Returns ``(positions, momenta, ids, forces)``; ``forces``: those at the start when
        known (an earlier stretch's last), not evaluated again; ``keep_last_force``: as
        :func:`~torchpm.adjoint.adjoint_integrate` takes it."""
        mesh = self.force_mesh
        step_callback = None if callback is None else (lambda number, a: callback(number + start, a))
        # The cosmology the forces read (an explicit one, or the simulation's; replicated on
        # a grid, so the adjoint's gradients are this rank's share until they pass back
        # through the replication once).
        cosmology = self._replicated(cosmology or self.cosmology)
        parameters, sources, stand_ins = self._adjoint_parameters(cosmology)
        if mesh.is_local:
            def local_forces(x, a):
                return self._forces(x, a, ids, cosmology)

            force = self._adjoint_force(local_forces, cosmology, lambda: ids, stand_ins)
            positions, momenta, forces = adjoint_integrate(
                positions, momenta, factors, force, parameters, callback=step_callback, sources=sources, forces=forces,
                keep_last_force=keep_last_force,
            )
            return positions, momenta, ids, forces
        # On a grid the particles migrate after every drift, in the forward pass and
        # again in the backward pass (by the reconstructed positions). Their layout
        # (ids, and the rank and slot each started from) travels with them, and the
        # gradients of the initial state are sent home by destination at the end:
        # exact whatever the rounding of the reconstruction.
        start_shape = positions.shape
        layout = {
            "ids": ids,
            "home": torch.full_like(ids, mesh.grid.rank).unsqueeze(-1),
            "slot": torch.arange(ids.shape[1], device=ids.device).expand_as(ids).unsqueeze(-1),
        }

        def migrate(x, *payload):
            _, x, moved_ids, home, slot, *payload = mesh.migrate(
                x, layout["ids"], layout["home"], layout["slot"], *payload, capacity=self.particle_capacity
            )
            layout.update(ids=moved_ids, home=home, slot=slot)
            return (x, *payload)

        def grid_forces(x, a):
            return self._forces(x, a, layout["ids"], cosmology)

        def restore(x0, adjoint_x, adjoint_p):
            _, _, home_ids, slot, adjoint_x, adjoint_p = mesh.migrate(
                x0, layout["ids"], layout["slot"], adjoint_x, adjoint_p, destination=layout["home"].squeeze(-1)
            )
            valid = home_ids >= 0
            member = torch.arange(valid.shape[0], device=valid.device).unsqueeze(1).expand_as(valid)[valid]
            index = slot.squeeze(-1)[valid]
            out_x = adjoint_x.new_zeros(start_shape)
            out_p = adjoint_p.new_zeros(start_shape)
            out_x[member, index] = adjoint_x[valid]
            out_p[member, index] = adjoint_p[valid]
            # The backward pass migrated the layout back to the start: the forward pass's
            # last again, for another backward pass through a retained graph.
            layout.update(ended)
            return out_x, out_p

        positions, momenta, forces = adjoint_integrate(
            positions, momenta, factors, self._adjoint_force(grid_forces, cosmology, lambda: layout["ids"], stand_ins),
            parameters, migrate=migrate, restore=restore, callback=step_callback, sources=sources, forces=forces,
            keep_last_force=keep_last_force,
        )
        ended = dict(layout)
        return positions, momenta, layout["ids"], forces

    def _adjoint_parameters(self, cosmology: Cosmology | None = None) -> tuple[list, list, dict]:
        """The tensors the forces depend on that need gradients (for :mod:`torchpm.adjoint`):
        ``(parameters, sources, stand_ins)``, as :func:`~torchpm.adjoint.adjoint_integrate`
        takes its ``parameters`` and ``sources``; ``stand_ins`` (buffer name -> detached
        copy) replace the correction's buffers that need gradients in the forces."""
        parameters = [t for t in (cosmology or self.cosmology).parameters().values() if t.requires_grad]
        sources = list(parameters)
        stand_ins: dict = {}
        correction = self.force_correction
        if correction is None:
            return parameters, sources, stand_ins
        if isinstance(correction, nn.Module):
            own = [p for p in correction.parameters() if p.requires_grad]
            parameters += own
            sources += own
            # Buffers that need gradients (conditions computed from other tensors): the
            # forces read detached copies (stand-ins), and the buffers receive their
            # gradients once, at the end (adjoint_integrate's `sources`): the pull-back of
            # every step then stops at the copies instead of walking the buffers' history
            # (freed after one walk; through the cosmology's parameters too, which would
            # count those paths twice).
            for name, buffer in correction.named_buffers():
                if buffer.requires_grad:
                    stand_ins[name] = buffer.detach().requires_grad_(True)
                    parameters.append(stand_ins[name])
                    sources.append(buffer)
        # Anything else the correction computes with that needs a gradient (a plain
        # callable's tensors, a module's unregistered ones) is invisible to the adjoint:
        # refuse rather than silently drop its gradient. (On a grid the replicated
        # tensors stop the walk; _check_correction refuses the rest on every rank.)
        if unsummed_leaves(self._probe_correction(stand_ins), stop=parameters):
            raise ValueError(
                "Simulation(adjoint=True): the `force_correction` computes with tensors that need gradients but "
                "are not parameters or buffers of an nn.Module (a plain callable's, or a module's unregistered "
                "tensors), which the adjoint cannot see; make them parameters or buffers of an nn.Module "
                "passed as `force_correction`"
            )
        return parameters, sources, stand_ins

    # ------------------------------------------------------------------------------
    def to_physical(self, positions, momenta, a, ids=None) -> SimulationState:
        """Mesh-unit particles to a :class:`SimulationState` in Mpc/h (positions wrapped
        into the box; empty slots get zero momentum)."""
        cell = torch.tensor(self.cell_size, dtype=positions.dtype, device=positions.device)
        box = torch.tensor(self.box_size, dtype=positions.dtype, device=positions.device)
        physical = torch.remainder(positions * cell, box)
        # remainder can round up to exactly the box size in float32; fold it back.
        physical = torch.where(physical >= box, physical - box, physical)
        momenta = momenta * cell
        if ids is not None and bool((ids < 0).any()):
            momenta = torch.where((ids >= 0).unsqueeze(-1), momenta, torch.zeros_like(momenta))
        return SimulationState(physical, momenta, a, ids)

    def density(self, state: SimulationState | torch.Tensor, *, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The CIC-painted density ``1 + delta`` (mean 1) on this rank's block of the force
        mesh, ``(B, *force_mesh.local_real_shape)`` (the whole mesh on one device).

        Accepts a :class:`SimulationState` (in force-mesh cells when it is a
        :class:`MeshUnitsState`) or positions ``(B, N, 3)`` in Mpc/h. On a
        process grid the particles are first moved to the ranks owning them, so any
        distribution of particles over the ranks is accepted, up to the run's ``N`` per
        batch member (more is refused: a whole state given to every rank). A grid state
        holds empty slots (id ``-1``), which carry no mass: pass the state, or its
        positions with ``ids=state.ids`` (positions alone count every slot as a particle).
        """
        positions = state.positions if isinstance(state, SimulationState) else state
        error = None
        if not isinstance(positions, torch.Tensor) or positions.dim() != 3 or positions.shape[-1] != 3:
            error = f"density: expected positions of shape (B, N, 3), got {getattr(positions, 'shape', positions)!r}"
        elif isinstance(state, SimulationState):
            if ids is not None:
                error = "density: pass `ids` with positions only (a SimulationState carries its own)"
            ids = state.ids
        elif ids is not None and (not isinstance(ids, torch.Tensor) or ids.is_floating_point()
                                  or tuple(ids.shape) != tuple(positions.shape[:2])):
            error = (f"density: expected integer `ids` of shape {tuple(positions.shape[:2])} like the positions, "
                     f"got {getattr(ids, 'shape', ids)!r}")
        if not self.force_mesh.is_local:
            self.force_mesh.raise_together(error, operation="Simulation.density")  # every rank raises, none waits in the migration
        elif error:
            raise ValueError(error)
        if ids is None:
            ids = torch.zeros(positions.shape[:2], dtype=torch.int64, device=positions.device)
        ids = ids.to(device=positions.device, dtype=torch.int64)
        if not isinstance(state, MeshUnitsState):  # (a MeshUnitsState is in cells already)
            positions = positions / torch.tensor(self.cell_size, dtype=positions.dtype, device=positions.device)
        _, cells, ids = self.force_mesh.migrate(positions, ids, capacity=self.particle_capacity)
        self._check_particles(ids, "density", exact=False)
        weights = (ids >= 0).to(cells.dtype) if bool((ids < 0).any()) else None
        return self.force_mesh.paint(cells, weights) * self.particle_mass

    def redshift_space(self, state: SimulationState, axis: int | str = 2,
                       cosmology: Cosmology | None = None) -> SimulationState:
        """The state with its positions moved to redshift space along ``axis`` (0, 1, 2 or
        ``"x"``, ``"y"``, ``"z"``, plane-parallel): ``s = x + p_axis / (a^2 E(a))``, wrapped
        into the box (:func:`torchpm.analysis.redshift_space`); momenta, ``a``, ids and the
        state's type (Mpc/h or force-mesh cells) unchanged. ``density`` of the result is the
        redshift-space density; :func:`~torchpm.analysis.power_multipoles` measures its
        multipoles. Differentiable like the state (and in the cosmology's parameters).
        Collective on a grid: the ranks check that they pass the same ``axis``, cosmology
        and scale factor."""
        from .analysis import line_of_sight_axis, redshift_space

        error = None
        valid_state = isinstance(state, SimulationState)
        if not valid_state:
            error = TypeError(f"redshift_space: `state` must be a SimulationState (as the simulation returns), got "
                              f"{type(state).__name__}")
        cosmology = self.cosmology if cosmology is None else cosmology
        valid_cosmology = isinstance(cosmology, Cosmology)
        if not valid_cosmology:
            error = error or TypeError(f"redshift_space: `cosmology` must be a torchpm.Cosmology or None, got "
                                       f"{type(cosmology).__name__}")
        try:
            axis_index = line_of_sight_axis(axis, "redshift_space")
        except ValueError as exc:
            axis_index, error = -1, error or exc
        if not self.force_mesh.is_local:
            # Every rank moves its own particles: a rank with another line of sight, cosmology
            # or state would make the density painted next mix two redshift spaces, which no
            # collective notices, and one whose tensors need other gradients would run other
            # collectives in the backward pass (the cosmology's gradient is summed over the
            # grid). The ranks agree first (one rank's bad argument raises on all).
            grad = torch.is_grad_enabled()
            self.force_mesh.agree("Simulation.redshift_space", [
                ("`axis` (the line of sight)", axis_index),
                ("the cosmology's parameters", _parameters_repr(cosmology) if valid_cosmology else None),
                ("which of the cosmology's parameters need gradients",
                 tuple(grad and bool(t.requires_grad) for t in cosmology.parameters().values())
                 if valid_cosmology else None),
                ("the state's scale factor `a`", repr(state.a) if valid_state else None),
                ("which of the state's positions and momenta need gradients",
                 tuple(grad and isinstance(t, torch.Tensor) and t.requires_grad
                       for t in (state.positions, state.momenta)) if valid_state else None),
                ("the state's type (Mpc/h or force-mesh cells)", type(state).__name__),
            ], error)
        elif error is not None:
            raise error
        cosmology = self._replicated(cosmology)
        box = self.mesh_shape if isinstance(state, MeshUnitsState) else self.box_size
        positions = redshift_space(state.positions, state.momenta, state.a, cosmology, box, axis=axis_index)
        return type(state)(positions, state.momenta, state.a, state.ids)

    def gather(self, state: SimulationState) -> SimulationState:
        """The whole state on every rank: ``(B, N, 3)`` positions and momenta sorted by id,
        ids ``arange(N)``. For small runs and tests (every rank holds every particle); not
        differentiable. Collective on a process grid; the identity order on one device."""
        mesh = self.force_mesh
        error = _gather_error(state)
        if not mesh.is_local:
            # Every rank's call alike before the collectives, whose sizes follow from
            # these (a mismatch there is a gloo abort, not an error): errors raised together.
            positions = state.positions if error is None else None
            mesh.grid.agree("Simulation.gather", [
                ("batch size of the state", -1 if positions is None else positions.shape[0]),
                ("dtype of the state's positions", None if positions is None else positions.dtype),
                ("the state's scale factor `a`", repr(float(state.a)) if error is None else None),
                # (the gathered state has one type: force-mesh cells or Mpc/h on every rank)
                ("the state's units (its type)", "force-mesh cells (MeshUnitsState)" if isinstance(
                    state, MeshUnitsState) else "Mpc/h (SimulationState)"),
            ], error)
        elif error is not None:
            raise ValueError(error)
        ids = state.ids.to(torch.int64)
        values = torch.cat([state.positions, state.momenta], dim=-1).detach()
        if not mesh.is_local:
            counts = mesh.grid.all_gather_counts([ids.shape[1]], device=ids.device).reshape(-1)
            width = int(counts.max())
            padded_ids = torch.full((ids.shape[0], width), -1, dtype=torch.int64, device=ids.device)
            padded_ids[:, : ids.shape[1]] = ids
            padded = values.new_zeros(values.shape[0], width, values.shape[2])
            padded[:, : ids.shape[1]] = values
            ids = _all_gather_rows(padded_ids, mesh)
            values = _all_gather_rows(padded, mesh)
        batch = ids.shape[0]
        order = torch.argsort(torch.where(ids >= 0, ids, torch.iinfo(torch.int64).max), dim=1)
        ids = torch.gather(ids, 1, order)[:, : self.n_total]
        values = torch.gather(values, 1, order.unsqueeze(-1).expand(-1, -1, values.shape[2]))[:, : self.n_total]
        expected = torch.arange(self.n_total, device=ids.device).expand(batch, -1)
        if ids.shape[1] != self.n_total or not torch.equal(ids, expected):
            raise RuntimeError(
                f"gather: the ranks do not hold every particle exactly once (expected ids 0..{self.n_total - 1})"
            )
        return type(state)(values[..., :3], values[..., 3:], state.a, ids)

    def extra_repr(self) -> str:
        grid = self.force_mesh.grid_shape
        return (
            f"n_particles={self.particle_shape}, box_size={self.box_size}, mesh_factor={self.mesh_factor}, "
            f"steps={self.steps}, a={self.scale_factors[0]:.4g}->{self.scale_factors[-1]:.4g}, "
            f"integrator={self.integrator!r}, lpt_order={self.lpt_order}, dtype={self._anchor.dtype}"
            + (f", f_nl={float(self.cosmology.f_nl.detach()):g}" if bool(self.cosmology.f_nl.detach() != 0) else "")
            + (f", primordial_kmax={self.primordial_kmax:g}" if self.primordial_kmax else "")
            + (f", grid={grid}" if grid != (1, 1) else "")
        )


def _gaussian(cosmology: Cosmology) -> Cosmology:
    """``cosmology`` with ``f_nl = 0`` (the same parameter tensors otherwise), for what does
    not depend on ``f_nl`` (growth, power, transfer): cached while ``f_nl`` alone needs a
    gradient or changes. ``cosmology`` itself when its ``f_nl`` is a plain 0."""
    f_nl = cosmology.f_nl
    if not (f_nl.requires_grad or is_transformed(f_nl)) and not bool(f_nl.detach() != 0):
        return cosmology
    parameters = {key: value for key, value in cosmology.parameters().items() if key != "f_nl"}
    gaussian = Cosmology(**parameters, name=cosmology.name)
    if hasattr(cosmology, "_replicated_over"):
        gaussian._replicated_over = cosmology._replicated_over
    return gaussian


def _power_setting(argument, power) -> str:
    """``power_spectrum`` as the ranks compare it: a table by its values (its path may
    differ between machines), a callable by its qualified name, a built-in by name."""
    if isinstance(power, PowerTable):
        values = torch.cat([power._log_k.reshape(-1), power._log_p.reshape(-1)]).to(torch.float64)
        return f"table {zlib.crc32(values.numpy().tobytes()):08x}"
    if callable(argument):
        return _callable_setting(argument)
    name = str(argument)
    return builtin_power_name(name)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_DEVICE_INDEX = re.compile(r"\b(cuda|xpu|mps|hpu|npu):\d+")  # (each rank's own device)


def _callable_setting(function) -> str:
    """A callable argument (``force_correction``, ``power_spectrum``) as the ranks compare
    it: a module by its type and ``repr`` (its hyperparameters: ``k_max``, ``knots``,
    layer sizes; its weights are compared at each run), a function by its name, a CRC of
    its code and constants, and its defaults' and closure's floats (two lambdas of one
    line but other constants differ). Object addresses, which differ between processes,
    and the closure's other values (a rank's device index) are left out."""
    if isinstance(function, nn.Module):
        text = _DEVICE_INDEX.sub(r"\1", _ADDRESS.sub("", repr(function)))
        return f"module {type(function).__qualname__} {zlib.crc32(text.encode()):08x}"

    def plain_value(value):
        if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
            return repr(value)
        if isinstance(value, (tuple, list)):
            return "(" + ", ".join(plain_value(v) for v in value) + ")"
        return type(value).__qualname__

    def code_key(code):
        consts = [code_key(c) if hasattr(c, "co_code") else plain_value(c) for c in code.co_consts]
        return f"{code.co_code.hex()} {consts} {code.co_names}"

    target = function
    while isinstance(target, functools.partial):
        target = target.func
    name = f"{getattr(function, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__qualname__)}"
    code = getattr(target, "__code__", None) or getattr(getattr(type(target), "__call__", None), "__code__", None)
    if code is None:
        return f"callable {name}"
    def number(value):  # (floats only: an int or a string may be a rank's device index)
        return repr(value) if isinstance(value, (float, complex)) else "-"

    parts = [code_key(code), *(number(v) for v in getattr(target, "__defaults__", None) or ())]
    parts += [number(_cell_value(cell)) for cell in getattr(target, "__closure__", None) or ()]
    if isinstance(function, functools.partial):
        parts += [number(v) for v in (*function.args, *function.keywords.values())]
    return f"callable {name} {zlib.crc32(' '.join(parts).encode()):08x}"


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _gather_error(state) -> str | None:
    """What is wrong with a state passed to :meth:`Simulation.gather`, or None."""
    if not isinstance(state, SimulationState):
        return f"gather: expected a SimulationState, got {type(state).__name__}"
    positions, momenta, ids = state.positions, state.momenta, state.ids
    if ids is None:
        return "gather: `state.ids` is required"
    try:
        float(state.a)
    except (TypeError, ValueError, RuntimeError):
        return f"gather: expected a number `state.a`, got {state.a!r:.80}"
    if not isinstance(positions, torch.Tensor) or positions.dim() != 3 or positions.shape[-1] != 3:
        return f"gather: expected `state.positions` of shape (B, N, 3), got {getattr(positions, 'shape', positions)!r}"
    if not isinstance(momenta, torch.Tensor) or momenta.shape != positions.shape or momenta.dtype != positions.dtype:
        return (f"gather: expected `state.momenta` of the positions' shape {tuple(positions.shape)} and dtype "
                f"{positions.dtype}, got {getattr(momenta, 'shape', momenta)!r}")
    if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != tuple(positions.shape[:2]) or ids.is_floating_point():
        return f"gather: expected integer `state.ids` of shape {tuple(positions.shape[:2])}, got {ids!r:.80}"
    return None


@eager
def _all_gather_rows(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """Concatenate every rank's ``(B, n, ...)`` along dim 1 (same ``n`` everywhere), on every rank."""
    with outside_transforms():  # (gathered values carry no derivative)
        return all_gather_grid(plain(tensor), mesh.groups, dim=1)
