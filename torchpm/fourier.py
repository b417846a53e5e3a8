"""Fourier-space kernels of a mesh: gradient, inverse Laplacian, compensation, and the
products that apply them to a complex field without copies.

Used by the initial conditions (:mod:`torchpm.ic`), the forces (:mod:`torchpm.pm`) and
anything else that works in Fourier space. Wavenumbers ``w = 2 pi fftfreq(n)`` are in
radians per cell; with cell sizes ``c_i`` (Mpc/h) the physical wavevector is
``k_i = w_i / c_i`` (h/Mpc). Kernels are built in physical units, so a mesh whose
cells are not cubes is handled correctly. Everything is written in terms of the
mesh's :meth:`wavevectors`, never the axis order of the complex block, so it runs
unchanged on a distributed (transposed) Fourier layout.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

__all__ = [
    "FourierKernels",
    "window",
    "gradient_inverse_laplacian",
    "multiply_real",
    "stack_products",
    "gradient_transpose_k",
    "GRADIENTS",
    "LAPLACIANS",
]

GRADIENTS = ("fd4", "exact")
LAPLACIANS = ("exact", "fd")


def window(mesh, order, dtype=torch.float64, device=None) -> torch.Tensor:
    """Fourier transform of the mass-assignment window of ``order`` on ``mesh``'s
    local Fourier block: ``W(w) = prod_i sinc(w_i / 2 pi)^p`` with ``p`` = 1 (NGP),
    2 (CIC), 3 (TSC), 4 (PCS) (``order`` a name or 1..4), ``sinc(x) = sin(pi x)/(pi x)``.
    Real, broadcastable against the complex block like :meth:`mesh.wavevectors`."""
    return torch.as_tensor(window_of(mesh.wavevectors(dtype=torch.float64, device=device), order),
                           device=device).to(dtype)


def window_of(wavevectors, order) -> torch.Tensor:
    """:func:`window` of given wavevectors ``(w_x, w_y, w_z)`` (radians per cell, each
    broadcastable, e.g. a few planes of a block)."""
    from .ops._arguments import order_number

    p = order_number(order, "window")
    result = 1.0
    for wi in wavevectors:
        result = result * torch.sinc(wi / (2.0 * math.pi)) ** p
    return result


class FourierKernels:
    """Fourier-space kernels of one mesh, built once and reused every step.

    Args:
        mesh: a :class:`torchpm.mesh.LocalMesh` (or the distributed equivalent).
        cell_size: 3 cell sizes in Mpc/h.
        gradient: ``"fd4"`` (4-point finite difference, the FastPM default) or
            ``"exact"`` (``i k``, Nyquist zeroed).
        laplacian: ``"exact"`` (``-1/k^2``) or ``"fd"`` (3-point finite difference).
        window_compensation: ``None`` (none) or the mass-assignment order used to
            paint and read out (``"ngp"``, ``"cic"``, ``"tsc"``, ``"pcs"``): divide
            by ``W^2`` with ``W = prod_i sinc(w_i/2pi)^p`` (:func:`window`), once
            for the paint and once for the readout.
        cic_compensation: the older switch, kept with its meaning: divide by the CIC
            window once, ``prod_i sinc(w_i/2pi)^-2`` (FastPM's and JaxPM's
            convention: the paint is deconvolved, the readout is not). Not
            together with ``window_compensation``.
        dtype, device: of the kernels (real dtype of the fields).

    Attributes:
        gradient: ``(g_x, g_y, g_z)``, complex, ``i g_i / c_i`` in h/Mpc, each
            broadcasting against the complex block like :meth:`mesh.wavevectors`.
        inverse_laplacian: real, ``1/k_eff^2`` in (Mpc/h)^2 (0 at k = 0), times the
            window compensation ``1/W^2`` when asked for; ``-gradient * inverse_laplacian``
            is ``-G L``, i.e. ``-grad (grad^2)^-1``.
        k_magnitude: ``|k|`` in h/Mpc (exact), real, broadcastable like the block.
        real_space_gradient: True when ``gradient="fd4"`` is applied in real space
            (:func:`gradient_inverse_laplacian`: one inverse FFT and the 4-point
            stencil, :func:`torchpm.ops.fd4_gradient`, instead of three inverse
            FFTs; equal up to rounding). False for ``"exact"``, or on a process grid
            whose blocks are too thin for the stencil's halo.
    """

    def __init__(
        self,
        mesh,
        cell_size: Sequence[float],
        *,
        gradient: str = "fd4",
        laplacian: str = "exact",
        cic_compensation: bool = False,
        window_compensation: str | int | None = None,
        dtype=torch.float32,
        device=None,
    ):
        from .ops._arguments import ORDER_NAMES, order_number

        if not isinstance(cic_compensation, bool):
            raise TypeError(f"`cic_compensation` must be a bool, got {cic_compensation!r}")
        if window_compensation is not None:
            window_compensation = ORDER_NAMES[order_number(window_compensation, "FourierKernels", "window_compensation")]
            if cic_compensation:
                raise ValueError("pass at most one of `cic_compensation` and `window_compensation`")
        if gradient not in GRADIENTS:
            raise ValueError(f"`gradient` must be one of {GRADIENTS}, got {gradient!r}")
        if laplacian not in LAPLACIANS:
            raise ValueError(f"`laplacian` must be one of {LAPLACIANS}, got {laplacian!r}")
        self.mesh = mesh
        self.cell_size = tuple(float(c) for c in cell_size)
        self.options = dict(
            gradient=gradient,
            laplacian=laplacian,
            cic_compensation=cic_compensation,
            window_compensation=window_compensation,
        )
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
        halo = getattr(mesh, "fd4_halo", lambda: None)()
        self.real_space_gradient = gradient == "fd4" and halo is not None
        # d_i^2 with "exact" is -k_i^2 on the whole axis, Nyquist plane included: unlike
        # the first derivative (odd in k, so sin(pi x) vanishes on the grid), it is even,
        # and cos(pi x) has the well-defined second derivative -k_N^2 cos(pi x). The
        # product of two Nyquist-zeroed gradients would lose that plane. "fd4" keeps
        # FastPM's (and JaxPM's) gradient applied twice.
        if gradient == "exact":
            self._second_diagonal = tuple((-((wi / ci) ** 2)).to(complex_dtype) for wi, ci in zip(w, self.cell_size))
        else:
            self._second_diagonal = tuple(g * g for g in self.gradient)
        self.k_magnitude = torch.sqrt(k_squared).to(dtype)
        k_eff = k_squared if laplacian == "exact" else k_squared_fd
        inverse = torch.where(k_eff > 0, 1.0 / torch.where(k_eff > 0, k_eff, 1.0), 0.0)
        if window_compensation is not None:
            # 1/W^2: the paint and the readout each smooth by W.
            inverse = inverse / window(mesh, window_compensation, device=device) ** 2
        elif cic_compensation:
            inverse = inverse / window(mesh, "cic", device=device)
        # Stored repeated on a last axis of 2, to multiply the real view of a complex
        # block contiguously (faster than a stride-0 broadcast); the plain kernel is
        # a view of it, not a second copy of a mesh-sized tensor.
        self.inverse_laplacian_pair = inverse.to(dtype).unsqueeze(-1).expand(*inverse.shape, 2).contiguous()
        self.inverse_laplacian = self.inverse_laplacian_pair[..., 0]
        self.dtype = dtype

    def radial(self, function, dtype=None) -> torch.Tensor:
        """``function(k)`` of ``|k|`` on the Fourier block (broadcast to its shape; with
        ``dtype``, cast to it), with ``function`` called once on a 1-D float64 tensor of
        the block's distinct ``|k|`` instead of on every entry (:meth:`radial_table`): a
        block of ``n^3 / 2`` entries has about ``n^3 / 8`` distinct ``|k|`` in a box with
        unequal sides and about ``3 n^2 / 4`` in a cube. ``function`` may return trailing
        axes (``(len(k), ...)``). Differentiable in what ``function`` depends on."""
        table = self.radial_table()
        values = function(table.k.clone())  # (a copy: the function may write into its argument)
        if dtype is not None:
            values = values.to(dtype)  # (cast on the table, before spreading it over the block)
        folded = values[table.keys] if table.keys is not None else values.reshape(*table.shape, *values.shape[1:])
        axes = table.axes
        return folded[axes[0].view(-1, 1, 1), axes[1].view(1, -1, 1), axes[2].view(1, 1, -1)]

    def radial_table(self):
        """A :class:`RadialTable` of the block: ``k`` the distinct ``|k|`` (float64, 1-D, the
        values of :attr:`k_magnitude`; in a cubic box ``2 pi sqrt(m) / L`` for every integer
        ``m = i^2 + j^2 + l^2`` up to the block's largest, within an ulp of them); ``axes``
        the per-axis index of each block plane into the folded table of distinct
        ``(|i|, |j|, l)`` (of shape ``shape``); ``keys`` that table's index into ``k``, or
        None when ``k`` is the folded table itself, flattened. Built once per kernels."""
        if getattr(self, "_radial", None) is None:
            self._radial = _radial_table(self.mesh, self.cell_size, self.dtype, self.device)
        return self._radial

    def to(self, device) -> "FourierKernels":
        """The same kernels on ``device`` (rebuilt there)."""
        return FourierKernels(self.mesh, self.cell_size, dtype=self.dtype, device=device, **self.options)

    @property
    def device(self):
        return self.inverse_laplacian.device

    def second_derivative(self, i: int, j: int) -> torch.Tensor:
        """Fourier multiplier of ``d_i d_j`` in (h/Mpc)^2, complex (zero imaginary part),
        broadcasting like :attr:`gradient`.

        ``"exact"``: ``-k_i k_j``; for ``i = j`` the Nyquist plane is kept (``-k_N^2``);
        for ``i != j`` a Nyquist factor gives 0 (``k_N k_j`` would be odd in ``k_j`` on
        the Nyquist plane, which maps onto itself, so it has no real-field meaning;
        and ``d_i cos(pi x) = 0`` on the grid). ``"fd4"``: ``G_i G_j``, the 4-point
        gradient applied twice (FastPM, JaxPM).
        """
        if i == j:
            return self._second_diagonal[i]
        return self.gradient[i] * self.gradient[j]


class RadialTable(NamedTuple):
    """The distinct ``|k|`` of a Fourier block and how to spread values of them over it
    (:meth:`FourierKernels.radial_table`)."""

    k: torch.Tensor
    keys: torch.Tensor | None
    shape: tuple
    axes: tuple


def _radial_table(mesh, cell_size, dtype, device):
    """:meth:`FourierKernels.radial_table` of a block: the wavevectors folded to ``|w|`` per
    axis (``(-w)^2 = w^2`` exactly, so the folded ``|k|`` are the block's own), and in a
    cubic box an integer key ``m = i^2 + j^2 + l^2`` when that table is the smaller."""
    w = mesh.wavevectors(dtype=torch.float64, device=device)
    folded, axes = [], []
    for wi in w:
        values, inverse = torch.unique(wi.reshape(-1).abs(), return_inverse=True)
        folded.append(values)
        axes.append(inverse)
    shape = tuple(v.numel() for v in folded)
    sides = [n * c for n, c in zip(mesh.global_shape, cell_size)]
    if max(sides) - min(sides) <= 1e-12 * max(sides) and math.prod(shape) > 0:
        # |k| = 2 pi sqrt(m) / L with the integer m = i^2 + j^2 + l^2: one value per m
        # (int32 keys: m <= 3 (n/2)^2 fits for any mesh a device holds).
        integers = [torch.round(v * n / (2 * math.pi)).to(torch.int64) for v, n in zip(folded, mesh.global_shape)]
        largest = sum(int(i.max()) ** 2 for i in integers)
        if largest + 1 < math.prod(shape) and largest < 2**31:
            keys = (integers[0].view(-1, 1, 1) ** 2 + integers[1].view(1, -1, 1) ** 2
                    + integers[2].view(1, 1, -1) ** 2).to(torch.int32)
            m = torch.arange(largest + 1, dtype=torch.float64, device=keys.device)
            k = (2 * math.pi / max(sides) * torch.sqrt(m)).to(dtype).to(torch.float64)
            return RadialTable(k, keys, shape, tuple(axes))
    k_squared = 0.0
    for axis, (values, ci) in enumerate(zip(folded, cell_size)):
        view = [1, 1, 1]
        view[axis] = -1
        k_squared = k_squared + (values.view(view) / ci) ** 2
    k = torch.sqrt(k_squared).to(dtype).to(torch.float64)  # (as k_magnitude: rounded to the field dtype)
    return RadialTable(k.reshape(-1), None, shape, tuple(axes))


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


def _gradient_factors(gradient_scale):
    """The 3 per-axis factors (1 each when None)."""
    factors = (1.0, 1.0, 1.0) if gradient_scale is None else tuple(gradient_scale)
    if len(factors) != 3:
        raise ValueError(f"`gradient_scale` must have 3 entries, got {len(factors)}")
    return factors


def _real_space_scale(kernels: FourierKernels, gradient_scale):
    """The 3 per-axis factors of the real-space stencil, ``gradient_scale[i] / c_i`` (the
    Fourier kernel ``G_i`` carries ``1/c_i``), numbers or 0-d tensors keeping any graph.

    Times the reciprocal, not divided: torch on CUDA divides a tensor by a number as a
    product with its reciprocal, so a quotient would differ in the last bit between a
    number and a CUDA tensor ``f`` (the adjoint's evaluation and the plain force, seen on
    an H200); a product is the same for numbers and float64 tensors on every device."""
    return [f * (1.0 / c) for f, c in zip(_gradient_factors(gradient_scale), kernels.cell_size)]


def _fourier_gradient(kernels: FourierKernels, gradient_scale):
    """The Fourier gradient kernels times ``gradient_scale`` (1-d, so this is free)."""
    if gradient_scale is None:
        return kernels.gradient
    factors = _gradient_factors(gradient_scale)
    return [(g * f).to(kernels.gradient[0].dtype) for g, f in zip(kernels.gradient, factors)]


def gradient_inverse_laplacian(field_k: torch.Tensor, kernels: FourierKernels, scale=None, gradient_scale=None,
                               halo_for: str | None = None) -> torch.Tensor:
    """``-grad grad^-2`` of a field given in Fourier space, in real space.

    With ``kernels.real_space_gradient`` (``"fd4"``) the potential is transformed
    once and the 4-point stencil applied to it in real space
    (:meth:`mesh.fd4_gradient`); otherwise the three components are formed in
    Fourier space and transformed together. The two agree up to rounding.

    Args:
        field_k: ``(B, *local_fourier_shape)`` complex (the DFT of a dimensionless field).
        kernels: the :class:`FourierKernels` of the mesh.
        scale: optional real factor (tensor broadcastable against ``field_k``, or
            a number) applied to the potential, e.g. a force-correction filter.
        gradient_scale: optional 3 per-axis factors (numbers or 0-d tensors,
            differentiable) of the components, e.g. mesh units and ``1.5 Omega_m``.
        halo_for: optional mass-assignment order: return the components with the
            halo a readout of that order needs on a process grid, filled, for
            ``mesh.readout(..., haloed=True)``. With the real-space gradient that
            halo comes with the potential's (one exchange of one channel, see
            :meth:`mesh.fd4_gradient`).

    Returns:
        ``(B, 3, *local_real_shape)`` (with ``halo_for``: ``(B, 3,
        *mesh.halo_shape(mesh.stencil_halo(halo_for)))``): component ``i`` is
        ``-d_i (grad^2)^-1 field`` in Mpc/h (divide by the cell size for mesh units),
        times ``gradient_scale[i]``.
    """
    potential = multiply_real(field_k, kernels.inverse_laplacian_pair, paired=True)
    if scale is not None:
        potential = multiply_real(potential, scale)
    mesh = kernels.mesh
    # -d_i grad^-2 = -(i g_i)(-1/k^2) = +(i g_i) / k^2
    if kernels.real_space_gradient:
        return mesh.fd4_gradient(mesh.irfftn(potential), _real_space_scale(kernels, gradient_scale), halo_for=halo_for)
    field = mesh.irfftn(stack_products(potential, _fourier_gradient(kernels, gradient_scale)))
    return field if halo_for is None else mesh.with_stencil_halo(field, halo_for)


def gradient_transpose_k(field: torch.Tensor, kernels: FourierKernels, gradient_scale=None) -> torch.Tensor:
    """The spectrum of the transpose of the gradient part of
    :func:`gradient_inverse_laplacian`: ``sum_i conj(f_i G_i) DFT(field[:, i])`` for a
    real ``(B, 3, *local_real_shape)`` field (``f = gradient_scale``), complex
    ``(B, *local_fourier_shape)``. With ``kernels.real_space_gradient`` it is the DFT
    of :meth:`mesh.fd4_gradient_transpose` (one forward FFT instead of three). Not
    differentiable with respect to ``gradient_scale`` (adjoint code takes care of it)."""
    mesh = kernels.mesh
    if kernels.real_space_gradient:
        factors = [f.detach() if isinstance(f, torch.Tensor) else f for f in _real_space_scale(kernels, gradient_scale)]
        return mesh.rfftn(mesh.fd4_gradient_transpose(field, factors))
    gradient = _fourier_gradient(kernels, gradient_scale)
    field_k = mesh.rfftn(field)
    combined = field_k[:, 0] * gradient[0].conj()
    for axis in (1, 2):
        combined.add_(field_k[:, axis] * gradient[axis].conj())
    return combined
