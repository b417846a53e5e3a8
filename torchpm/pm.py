"""Particle-mesh forces and the FastPM kick-drift-kick integrator.

Conventions (DESIGN.md): particle positions ``x`` are in cells of the force mesh,
momenta ``p = a^3 E(a) dx/da`` in the same units; ``H0 = 1``. Wavenumbers
``w = 2 pi fftfreq(n)`` are in radians per cell; with cell sizes ``c_i`` (Mpc/h)
the physical wavevector is ``k_i = w_i / c_i`` (h/Mpc). Kernels are built in
physical units, so a mesh whose cells are not cubes is still handled correctly;
for cubic cells everything reduces to the usual mesh-unit kernels.

Force on the particles (mesh units)::

    rho   = paint(x) * (cells / particles)                     (mean 1)
    F_i   = 1.5 Omega_m readout( IDFT[ -G_i(k) L(k) S(k) C(k, a) DFT(rho) ] ) / c_i

with ``G_i = i g_i / c_i`` the gradient (``g = w``, Nyquist zeroed, or the 4-point
finite difference ``(8 sin w - sin 2w) / 6``), ``L = -1/k^2`` (0 at k = 0) or its
finite-difference form ``-1 / sum_i (2 sin(w_i/2) / c_i)^2``, ``S`` the optional
window compensation ``W^-2``, ``W = prod_i sinc(w_i / 2 pi)^p`` for the order p of
the mass assignment (or the older CIC switch ``prod_i sinc(w_i / 2 pi)^-2``) and ``C`` the optional
force-correction filter of (|k| in h/Mpc, a).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .cosmology import GrowthTable
from .fourier import FourierKernels, gradient_inverse_laplacian

__all__ = [
    "compute_forces",
    "force_field",
    "StepFactors",
    "step_factors",
    "kick_drift_kick",
    "readout_kick_drift_",
]


def compute_forces(
    positions: torch.Tensor,
    kernels: FourierKernels,
    *,
    a,
    particle_mass: float,
    force_scale,
    force_correction: Callable | None = None,
    weights: torch.Tensor | None = None,
    order: str = "cic",
) -> torch.Tensor:
    """PM accelerations ``dp/da * a^2 E`` on the particles, in mesh units.

    Args:
        positions: ``(B, N, 3)`` in mesh-cell units.
        kernels: :class:`FourierKernels` of the force mesh.
        a: scale factor (0-d tensor or float), passed to ``force_correction``.
        particle_mass: mesh cells per particle, so that the painted density has mean 1.
        force_scale: ``1.5 Omega_m`` (0-d tensor: gradients flow into Omega_m).
        force_correction: optional callable ``(k, a) -> filter`` with ``k`` the
            ``|k|`` mesh in h/Mpc and ``a`` a 0-d tensor; the filter multiplies
            the potential.
        weights: optional ``(B, N)`` mass of each particle in units of one particle
            (0 for the empty slots of a padded distributed batch); None: all 1.
        order: mass-assignment window of the paint and the readout (``"ngp"``,
            ``"cic"``, ``"tsc"``, ``"pcs"``); the kernels' window compensation, if
            any, should be for the same order.

    Returns:
        ``(B, N, 3)``: ``F_i = 1.5 Omega_m (-d_i grad^-2 delta)(x) / c_i``.
    """
    field = force_field(positions, kernels, a=a, particle_mass=particle_mass, force_scale=force_scale,
                        force_correction=force_correction, weights=weights, order=order)
    # (B, N, 3), the 3 components in one pass
    return kernels.mesh.readout(field, positions, order=order, haloed=True)


def force_field(positions: torch.Tensor, kernels: FourierKernels, *, a, particle_mass: float, force_scale,
                force_correction: Callable | None = None, weights: torch.Tensor | None = None,
                order: str = "cic") -> torch.Tensor:
    """The PM force field on the mesh, ready for the readout: ``(B, 3, ...)`` with the
    halo a readout of ``order`` needs on a process grid, filled
    (``mesh.readout(field, positions, order=order, haloed=True)`` gives
    :func:`compute_forces`). Arguments as for :func:`compute_forces`.
    """
    mesh = kernels.mesh
    density_k = mesh.rfftn(mesh.paint(positions, weights, order=order))
    filter_ = None
    if force_correction is not None:
        if isinstance(a, torch.Tensor) and not _plain_cpu_number(a):
            a_tensor = a.to(dtype=kernels.dtype, device=positions.device)
        else:  # a fill, not a host-to-device copy (a CUDA graph can capture the step)
            a_tensor = torch.full((), float(a), dtype=kernels.dtype, device=positions.device)
        filter_ = force_correction(kernels.k_magnitude, a_tensor)
    # Mesh units (1/c_i), the mean-1 normalisation and 1.5 Omega_m go into the 1-d
    # gradient's per-axis factors: no extra pass over the mesh or the particles.
    if isinstance(force_scale, torch.Tensor):
        if _plain_cpu_number(force_scale):
            # A number: no host-to-device copy per call (a CUDA graph can capture the step).
            force_scale = float(force_scale)
        else:
            force_scale = force_scale.to(device=positions.device)
    gradient_scale = [force_scale * (particle_mass / c) for c in kernels.cell_size]
    # On a grid the readout's halo comes with the field (with the real-space gradient,
    # from the potential's one halo exchange).
    return gradient_inverse_laplacian(density_k, kernels, filter_, gradient_scale, halo_for=order)


def _plain_cpu_number(value: torch.Tensor) -> bool:
    """A CPU tensor that may be read as a Python number: no gradient is recorded
    through it, and no graph is being traced (reading it there would break the graph)."""
    return (value.device.type == "cpu" and not (value.requires_grad and torch.is_grad_enabled())
            and not torch.compiler.is_compiling())


class StepFactors(NamedTuple):
    """Scalar factors of one kick-drift-kick step (0-d float64 tensors)."""

    a_start: torch.Tensor
    a_end: torch.Tensor
    first_kick: torch.Tensor  # p += first_kick * F(a_start)
    drift: torch.Tensor  # x += drift * p
    second_kick: torch.Tensor  # p += second_kick * F(a_end)


def step_factors(table: GrowthTable, scale_factors: torch.Tensor, scheme: str = "fastpm") -> list[StepFactors]:
    """Kick and drift factors of every step, from one evaluation of the growth table.

    Steps go ``a_i -> a_{i+1}`` with ``a_h = sqrt(a_i a_{i+1})``: kick
    ``a_i -> a_h`` with the force at ``a_i``, drift ``a_i -> a_{i+1}`` with the
    momentum at ``a_h``, kick ``a_h -> a_{i+1}`` with the force at ``a_{i+1}``.

    * ``"fastpm"`` (growth-corrected, exact for linear growth):
      kick ``[Gf(a_f) - Gf(a_i)] / (a_c^2 E(a_c) gf(a_c))``,
      drift ``[D1(a_f) - D1(a_i)] / (a_c^3 E(a_c) gp(a_c))``;
    * ``"leapfrog"``: kick ``(a_f - a_i) / (a_c^2 E(a_c))``, drift ``(a_f - a_i) / (a_c^3 E(a_c))``.
    """
    if scheme not in ("fastpm", "leapfrog"):
        raise ValueError(f"`integrator` must be 'fastpm' or 'leapfrog', got {scheme!r}")
    a = scale_factors.to(torch.float64)
    a_half = torch.sqrt(a[:-1] * a[1:])
    nodes = table.at(a)
    half = table.at(a_half)
    factors = []
    for i in range(a.numel() - 1):
        a_i, a_h, a_f = nodes.a[i], half.a[i], nodes.a[i + 1]
        E_i, E_h, E_f = nodes.E[i], half.E[i], nodes.E[i + 1]
        if scheme == "fastpm":
            first = (half.Gf[i] - nodes.Gf[i]) / (a_i**2 * E_i * nodes.gf[i])
            drift = (nodes.D1[i + 1] - nodes.D1[i]) / (a_h**3 * E_h * half.gp[i])
            second = (nodes.Gf[i + 1] - half.Gf[i]) / (a_f**2 * E_f * nodes.gf[i + 1])
        else:
            first = (a_h - a_i) / (a_i**2 * E_i)
            drift = (a_f - a_i) / (a_h**3 * E_h)
            second = (a_f - a_h) / (a_f**2 * E_f)
        factors.append(StepFactors(a_i, a_f, first, drift, second))
    return factors


def add_scaled(x: torch.Tensor, y: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``x + y * factor`` (``factor`` a 0-d tensor, cast to ``x``'s dtype) with exactly
    the rounding of those two ops (no fused multiply-add: the adjoint undoes the
    updates step by step, and a run with gradients must take the same steps as one
    without).

    Without a graph to record (contiguous tensors, and a factor on the CPU, read
    without a device sync) it is one pass over memory,
    ``torch.ops.torchpm._add_scaled``; otherwise
    torch's product, with the sum landing on it (one new buffer instead of two;
    addition commutes bit for bit). Both round alike.
    """
    needs_graph = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
    if not needs_graph and _one_pass_update(x, y, factor):
        return torch.ops.torchpm._add_scaled(x, y, factor.item())
    return torch.mul(y, factor.to(x.dtype)).add_(x)


def _one_pass_update(x: torch.Tensor, y: torch.Tensor, factor) -> bool:
    """Whether ``_add_scaled`` / ``_add_scaled_`` take ``(x, y, factor)``: contiguous
    float tensors of one shape, dtype and device, and a 0-d factor on the CPU (read
    without a device sync)."""
    return (
        isinstance(factor, torch.Tensor)
        and _plain_cpu_number(factor)
        and factor.dim() == 0
        and x.shape == y.shape
        and x.dtype == y.dtype
        and x.dtype in (torch.float32, torch.float64)
        and x.device == y.device
        and x.is_contiguous()
        and y.is_contiguous()
    )


def add_scaled_(x: torch.Tensor, y: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """:func:`add_scaled` written into ``x`` (returned): the same bits, without a new
    buffer. For arrays the caller owns, outside any graph (``x`` must not need one).

    One pass, ``torch.ops.torchpm._add_scaled_``, under :func:`add_scaled`'s conditions
    for its one-pass op; otherwise ``x.copy_(add_scaled(x, y, factor))``.
    """
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        raise ValueError("torchpm.pm.add_scaled_: expected `x` and `y` outside a graph (they require grad); "
                         "use add_scaled.")
    if _one_pass_update(x, y, factor):
        torch.ops.torchpm._add_scaled_(x, y, factor.item())
        return x
    return x.copy_(add_scaled(x, y, factor))


def kick_drift_kick(positions, momenta, forces, factors: StepFactors, force_function):
    """One step: returns ``(positions, momenta, forces)`` at ``factors.a_end``.

    ``forces`` are those at ``factors.a_start`` (the last force of the previous
    step is reused); ``force_function(positions, a)`` computes the new ones.
    Nothing is modified in place, so autograd sees every step. (Outside a graph,
    :meth:`torchpm.Simulation.evolve` takes the same steps in place, its updates
    in the force's readout: :func:`readout_kick_drift_`.)
    """
    momenta = add_scaled(momenta, forces, factors.first_kick)
    positions = add_scaled(positions, momenta, factors.drift)
    forces = force_function(positions, factors.a_end)
    momenta = add_scaled(momenta, forces, factors.second_kick)
    return positions, momenta, forces


def readout_kick_drift_(mesh, field, positions, momenta, kicks, drift=None, *, order: str = "cic"):
    """The integrator's updates in the readout of its force, in place: with ``F =
    mesh.readout(field, positions, order=order, haloed=True)`` (``field`` from
    :func:`force_field`), ``momenta = add_scaled_(momenta, F, k)`` for each of the one or
    two ``kicks`` (0-d tensors), then, with ``drift``, ``positions =
    add_scaled_(positions, momenta, drift)``. Returns ``(positions, momenta)``.

    The same bits as that composition. Under :func:`add_scaled_`'s one-pass conditions
    (and a 3-channel field) it is one pass over the particles,
    :meth:`mesh.readout_kick_drift_ <torchpm.distributed.PencilDecomposition.readout_kick_drift_>`,
    which never writes ``F``: the second kick of a step and the first kick and drift of
    the next cost about what the readout alone costs. For arrays the caller owns,
    outside any graph.
    """
    factors = [*kicks] + ([] if drift is None else [drift])
    if torch.is_grad_enabled() and any(t.requires_grad for t in (positions, momenta, field)):
        raise ValueError("torchpm.pm.readout_kick_drift_: expected `positions`, `momenta` and `field` outside a graph "
                         "(they require grad); use compute_forces and add_scaled.")
    if (field.dim() == 5 and field.shape[1] == 3 and field.dtype == positions.dtype
            and all(_one_pass_update(momenta, positions, f) for f in factors)):
        mesh.readout_kick_drift_(field, positions, momenta, [k.item() for k in kicks],
                                 None if drift is None else drift.item(), order=order)
        return positions, momenta
    forces = mesh.readout(field, positions, order=order, haloed=True)
    for k in kicks:
        momenta = add_scaled_(momenta, forces, k)
    if drift is not None:
        positions = add_scaled_(positions, momenta, drift)
    return positions, momenta
