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
CIC compensation ``prod_i sinc(w_i / 2 pi)^-2`` and ``C`` the optional
force-correction filter of (|k| in h/Mpc, a).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch

from .cosmology import GrowthTable

__all__ = [
    "FourierKernels",
    "gradient_inverse_laplacian",
    "multiply_real",
    "stack_products",
    "compute_forces",
    "StepFactors",
    "step_factors",
    "kick_drift_kick",
]

GRADIENTS = ("fd4", "exact")
LAPLACIANS = ("exact", "fd")


class FourierKernels:
    """Fourier-space kernels of one mesh, built once and reused every step.

    Args:
        mesh: a :class:`torchpm.mesh.LocalMesh` (or the distributed equivalent).
        cell_size: 3 cell sizes in Mpc/h.
        gradient: ``"fd4"`` (4-point finite difference, the FastPM default) or
            ``"exact"`` (``i k``, Nyquist zeroed).
        laplacian: ``"exact"`` (``-1/k^2``) or ``"fd"`` (3-point finite difference).
        cic_compensation: divide by the CIC window ``prod_i sinc(w_i/2pi)^2``.
        dtype, device: of the kernels (real dtype of the fields).

    Attributes:
        gradient: ``(g_x, g_y, g_z)``, complex, ``i g_i / c_i`` in h/Mpc, each
            broadcasting against the complex block like :meth:`mesh.wavevectors`.
        inverse_laplacian: real, ``1/k_eff^2`` in (Mpc/h)^2 (0 at k = 0), times the
            CIC compensation when asked for; ``-gradient * inverse_laplacian``
            is ``-G L``, i.e. ``-grad (grad^2)^-1``.
        k_magnitude: ``|k|`` in h/Mpc (exact), real, broadcastable like the block.
    """

    def __init__(
        self,
        mesh,
        cell_size: Sequence[float],
        *,
        gradient: str = "fd4",
        laplacian: str = "exact",
        cic_compensation: bool = False,
        dtype=torch.float32,
        device=None,
    ):
        if gradient not in GRADIENTS:
            raise ValueError(f"`gradient` must be one of {GRADIENTS}, got {gradient!r}")
        if laplacian not in LAPLACIANS:
            raise ValueError(f"`laplacian` must be one of {LAPLACIANS}, got {laplacian!r}")
        self.mesh = mesh
        self.cell_size = tuple(float(c) for c in cell_size)
        self.options = dict(gradient=gradient, laplacian=laplacian, cic_compensation=bool(cic_compensation))
        # Built in float64, stored in the field dtype.
        w = mesh.wavevectors(dtype=torch.float64, device=device)
        complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        gradients = []
        k_squared = 0.0
        k_squared_fd = 0.0
        for axis, (wi, ci) in enumerate(zip(w, self.cell_size)):
            if gradient == "exact":
                n = mesh.global_shape[axis]
                # The Nyquist mode of an even axis has no sign: its derivative is zeroed.
                g = torch.where((wi.abs() - math.pi).abs() < 1e-9, torch.zeros_like(wi), wi) if n % 2 == 0 else wi
            else:
                g = (8.0 * torch.sin(wi) - torch.sin(2.0 * wi)) / 6.0
            gradients.append((1j * g / ci).to(complex_dtype))
            k_squared = k_squared + (wi / ci) ** 2
            k_squared_fd = k_squared_fd + (2.0 * torch.sin(wi / 2.0) / ci) ** 2
        self.gradient = tuple(gradients)
        self.k_magnitude = torch.sqrt(k_squared).to(dtype)
        k_eff = k_squared if laplacian == "exact" else k_squared_fd
        inverse = torch.where(k_eff > 0, 1.0 / torch.where(k_eff > 0, k_eff, 1.0), 0.0)
        if cic_compensation:
            window = 1.0
            for wi in w:
                window = window * torch.sinc(wi / (2.0 * math.pi)) ** 2
            inverse = inverse / window
        # Stored repeated on a last axis of 2, to multiply the real view of a complex
        # block contiguously (faster than a stride-0 broadcast); the plain kernel is
        # a view of it, not a second copy of a mesh-sized tensor.
        self.inverse_laplacian_pair = inverse.to(dtype).unsqueeze(-1).expand(*inverse.shape, 2).contiguous()
        self.inverse_laplacian = self.inverse_laplacian_pair[..., 0]
        self.dtype = dtype

    def to(self, device) -> "FourierKernels":
        """The same kernels on ``device`` (rebuilt there)."""
        return FourierKernels(self.mesh, self.cell_size, dtype=self.dtype, device=device, **self.options)

    @property
    def device(self):
        return self.inverse_laplacian.device


def multiply_real(field_k: torch.Tensor, kernel, paired: bool = False) -> torch.Tensor:
    """``field_k * kernel`` for a complex field and a real kernel, without promoting the
    kernel to a complex copy (the product runs on the real view). ``paired``: the kernel
    already has a trailing axis of 2 (real and imaginary parts get the same factor)."""
    kernel = torch.as_tensor(kernel, device=field_k.device)
    if not paired:
        kernel = kernel.unsqueeze(-1)
    return torch.view_as_complex(torch.view_as_real(field_k) * kernel)


def stack_products(field_k: torch.Tensor, factors) -> torch.Tensor:
    """``torch.stack([field_k * f for f in factors], dim=1)``.

    Without autograd the products are written straight into one buffer (no stack copy).
    """
    needs_graph = torch.is_grad_enabled() and (
        field_k.requires_grad or any(isinstance(f, torch.Tensor) and f.requires_grad for f in factors)
    )
    if needs_graph:
        return torch.stack([field_k * f for f in factors], dim=1)
    out = field_k.new_empty(field_k.shape[0], len(factors), *field_k.shape[1:])
    for index, factor in enumerate(factors):
        torch.mul(field_k, factor, out=out[:, index])
    return out


def gradient_inverse_laplacian(field_k: torch.Tensor, kernels: FourierKernels, scale=None, gradient=None) -> torch.Tensor:
    """``-grad grad^-2`` of a field given in Fourier space, in real space.

    Args:
        field_k: ``(B, *local_fourier_shape)`` complex (the DFT of a dimensionless field).
        kernels: the :class:`FourierKernels` of the mesh.
        scale: optional real factor (tensor broadcastable against ``field_k``, or
            a number) applied to the potential, e.g. a force-correction filter.
        gradient: optional replacement for ``kernels.gradient`` (e.g. the same
            kernels times per-axis constants; they are 1-d, so this is free).

    Returns:
        ``(B, 3, *local_real_shape)``: component ``i`` is ``-d_i (grad^2)^-1 field``
        in Mpc/h (divide by the cell size for mesh units).
    """
    potential = multiply_real(field_k, kernels.inverse_laplacian_pair, paired=True)
    if scale is not None:
        potential = multiply_real(potential, scale)
    # -d_i grad^-2 = -(i g_i)(-1/k^2) = +(i g_i) / k^2
    return kernels.mesh.irfftn(stack_products(potential, gradient or kernels.gradient))


def compute_forces(
    positions: torch.Tensor,
    kernels: FourierKernels,
    *,
    a,
    particle_mass: float,
    force_scale,
    force_correction: Callable | None = None,
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

    Returns:
        ``(B, N, 3)``: ``F_i = 1.5 Omega_m (-d_i grad^-2 delta)(x) / c_i``.
    """
    mesh = kernels.mesh
    density_k = mesh.rfftn(mesh.paint(positions))
    filter_ = None
    if force_correction is not None:
        a_tensor = torch.as_tensor(a, dtype=kernels.dtype, device=positions.device)
        filter_ = force_correction(kernels.k_magnitude, a_tensor)
    # Mesh units (1/c_i), the mean-1 normalisation and 1.5 Omega_m go into the 1-d
    # gradient kernels: no extra pass over the mesh or the particles.
    if isinstance(force_scale, torch.Tensor):
        force_scale = force_scale.to(device=positions.device)
    gradient = [g * (force_scale * (particle_mass / c)) for g, c in zip(kernels.gradient, kernels.cell_size)]
    gradient = [g.to(kernels.gradient[0].dtype) for g in gradient]
    field = gradient_inverse_laplacian(density_k, kernels, filter_, gradient)
    return mesh.readout(field, positions)  # (B, N, 3), the 3 components in one pass


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


def kick_drift_kick(positions, momenta, forces, factors: StepFactors, force_function):
    """One step: returns ``(positions, momenta, forces)`` at ``factors.a_end``.

    ``forces`` are those at ``factors.a_start`` (the last force of the previous
    step is reused); ``force_function(positions, a)`` computes the new ones.
    Nothing is modified in place, so autograd sees every step.
    """
    dtype = positions.dtype
    momenta = momenta + forces * factors.first_kick.to(dtype)
    positions = positions + momenta * factors.drift.to(dtype)
    forces = force_function(positions, factors.a_end)
    momenta = momenta + forces * factors.second_kick.to(dtype)
    return positions, momenta, forces
