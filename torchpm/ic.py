"""Initial conditions: white noise, the linear density field, and 1LPT/2LPT.

Linear field (DESIGN.md normalisation): with ``N`` cells, box volume ``V``
((Mpc/h)^3) and white noise ``omega ~ N(0, 1)`` on the particle grid::

    delta(k) = DFT(omega)(k) * sqrt(P(|k|) N / V),   delta(k = 0) = 0,
    delta_L(x) = IDFT(delta)(x) / N                      (the linear field at a = 1)

so that ``<|DFT delta_L|^2> = P N^2 / V`` (the estimator of :mod:`torchpm.analysis`
returns ``P``).

Paired and fixed initial conditions (Angulo & Pontzen 2016; Villaescusa-Navarro et al.
2018). :func:`fixed_amplitude` sets every Fourier amplitude of the noise to its
expectation, ``|DFT(omega)(k)| = sqrt(N)`` (``<|DFT omega|^2> = N`` for unit white
noise), keeping the phases, so ``|DFT delta_L|^2 = P N^2 / V`` holds mode by mode: the
linear field has no cosmic variance in its amplitudes. The second member of a pair is
made from ``-omega``: every phase shifted by pi.

Local primordial non-Gaussianity (``Cosmology.f_nl``; Salopek & Bond 1990, Komatsu &
Spergel 2001; as FastPM makes it). The Gaussian linear field is the primordial potential
``phi`` times the transfer ``M(k) = delta_L(k) / phi(k)``; the potential is made
non-Gaussian in real space and transferred back::

    phi = IDFT(DFT(delta_L) / M),   Phi = phi + f_nl (phi^2 - <phi^2>),
    delta_L' = IDFT(M DFT(Phi)) = delta_L + f_nl IDFT(M DFT(phi^2))

with ``M(k) = 2/3 (k c/H0)^2 T(k) D_md(1) / Omega_m`` (:func:`primordial_transfer`):
``D_md`` the growth normalised to ``a`` deep in matter domination and ``T(k)`` the
transfer function read from the linear power itself, ``T^2 = P(k) k0^n_s / (P(k0) k^n_s)``
at ``k0 = 1e-5`` h/Mpc (where Eisenstein & Hu's T is 1 to 1e-6). The mean ``<phi^2>``
only shifts the k = 0 mode, which ``M(0) = 0`` removes. The square is taken on the
particle grid: its modes beyond the grid's Nyquist frequency alias (as in FastPM). FastPM
sets the amplitude of ``phi`` from ``A_s`` (``scalar_amp``); here it follows from the
linear power (``sigma8``) through ``M``, which for Planck15 implies an ``A_s`` 4.4% below
Planck's: the same nominal f_nl then gives a term 2% smaller than FastPM's with Planck's
``A_s`` (each consistent with its own ``M`` in, e.g., the scale-dependent bias).
Paired initial conditions negate ``phi``, so the pair shares the f_nl term.

LPT (positions in force-mesh cells ``c``; ``phi_ij = d_i d_j grad^-2 delta``)::

    Psi1 = -grad grad^-2 delta,   S = sum_{i<j} (phi_ii phi_jj - phi_ij^2),   Psi2 = -grad grad^-2 S
    x0 = q + D1 Psi1 + C2 D2 Psi2,   p0 = a0^2 E(a0) [f1 D1 Psi1 + f2 C2 D2 Psi2]

computed on the particle grid (as FastPM does) with the simulation's gradient and
Laplacian kernels; D1, D2 are 1 at a = 1. The 2LPT normalisation ``C2``:

* ``"fastpm"`` (default; FastPM and JaxPM): ``C2 = 3/7``, i.e. the second-order
  growth ``3/7 D2(a) / D2(1)``. Exact only for Omega_m = 1.
* ``"exact"`` (pmwd, PM++): ``C2 = -D2(1) / D1(1)^2`` of the solutions that start as
  ``D1 = a``, ``D2 = -3/7 a^2``, so the term is ``-D2(a) / D1(1)^2`` and tends to
  ``3/7 D1(a)^2`` at early times, as second-order perturbation theory requires
  (``GrowthValues.D2_norm``; 0.85% larger than 3/7 for Planck15).
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Sequence

import torch

from .cosmology import Cosmology, GrowthValues
from .distributed.decomposition import PencilDecomposition
from .mesh import LocalMesh, as_shape
from .fourier import FourierKernels, _real_space_scale, gradient_inverse_laplacian, multiply_real, stack_products

__all__ = ["white_noise", "fixed_amplitude", "plane_seed", "linear_field", "lpt_displacements", "lpt_initial_state",
           "check_finite", "primordial_transfer", "PRIMORDIAL_K"]

# Where the linear power gives the primordial amplitude ``P(k0) / k0^n_s`` (T(k0) = 1 to
# 1e-6 for Eisenstein & Hu); a power table must reach at least PRIMORDIAL_K_TABLE.
PRIMORDIAL_K = 1e-5
PRIMORDIAL_K_TABLE = 1e-4

LPT_NORMALISATIONS = ("fastpm", "exact")


def check_lpt_normalisation(value) -> str:
    """ValueError unless ``value`` is one of :data:`LPT_NORMALISATIONS`."""
    if not isinstance(value, str) or value not in LPT_NORMALISATIONS:
        raise ValueError(f"`lpt_normalisation` must be one of {LPT_NORMALISATIONS}, got {value!r}")
    return value


def check_finite(tensor: torch.Tensor, name: str) -> None:
    """ValueError naming ``name`` when ``tensor`` holds NaN or infinity."""
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"`{name}` contains {bad} NaN or infinite values; expected finite numbers")


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """The splitmix64 finaliser: a bijective scramble of a 64-bit integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def plane_seed(seed: int, member: int, plane: int) -> int:
    """Seed of the stream of x-plane ``plane`` of batch member ``member`` (63 bits).

    Hash-chained, so distinct ``(seed, member, plane)`` give unrelated streams
    (``seed + plane`` would make seed 1 plane 0 equal seed 0 plane 1).
    """
    value = _mix64(int(seed) & _MASK64)
    value = _mix64(value ^ (int(member) & _MASK64))
    value = _mix64(value ^ (int(plane) & _MASK64))
    return value >> 1


def white_noise(
    shape: int | Sequence[int],
    *,
    batch: int = 1,
    seed: int = 0,
    dtype=torch.float32,
    device=None,
    mesh=None,
) -> torch.Tensor:
    """Seeded standard normal white noise on the particle grid, the same on any process grid.

    Every x-plane ``i`` of batch member ``b`` is drawn (in float64, C order over
    ``(y, z)``) from its own CPU stream seeded by :func:`plane_seed` ``(seed, b, i)``.
    A rank draws only the planes of its block and keeps its y range, so the global
    field does not depend on the process grid or the device, and member ``b`` does
    not depend on how many members are drawn.

    Args:
        shape: the global particle grid ``(nx, ny, nz)``.
        batch: number of independent fields (members ``0 .. batch - 1``).
        seed: integer seed.
        mesh: the particle-grid mesh whose local block to return (default: the whole grid).

    Returns:
        ``(batch, *local_real_shape)`` of ``mesh`` (the whole grid by default).
    """
    shape = as_shape(shape, "shape")
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or int(batch) < 1:
        raise ValueError(f"`batch` must be a positive integer, got {batch!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"`seed` must be an integer, got {seed!r}")
    nx, ny, nz = shape
    (lx, ly, lz), (ox, oy, oz) = ((nx, ny, nz), (0, 0, 0)) if mesh is None else (
        mesh.local_real_shape, mesh.local_real_offset)
    if mesh is not None and tuple(mesh.global_shape) != shape:
        raise ValueError(f"white_noise: `mesh` has global shape {mesh.global_shape}, expected {shape}")
    noise = torch.empty((int(batch), lx, ly, lz), dtype=torch.float64)
    generator = torch.Generator()
    for member in range(int(batch)):
        for i in range(lx):
            generator.manual_seed(plane_seed(seed, member, ox + i))
            plane = torch.randn((ny, nz), generator=generator, dtype=torch.float64)
            noise[member, i] = plane[oy : oy + ly, oz : oz + lz]
    return noise.to(dtype=dtype, device=device)


def fixed_amplitude(noise: torch.Tensor, mesh=None) -> torch.Tensor:
    """White noise with every Fourier amplitude set to its expectation, phases kept.

    ``IDFT( sqrt(N) DFT(noise) / |DFT(noise)| )`` with ``N`` the cells of the global
    grid: ``<|DFT(omega)|^2> = N`` for standard normal white noise ``omega``, so the
    result has the unfixed noise's power in every mode and none of its scatter, and
    :func:`linear_field` of it has ``|delta(k)|^2 = P(k) N^2 / V`` (unnormalised DFT) exactly. Every mode is
    fixed, ``k = 0`` included. A self-conjugate mode (``k = -k``: each component 0 or,
    on an even axis, the Nyquist frequency) is real and becomes ``+-sqrt(N)`` with its
    sign kept. A mode whose amplitude is exactly zero has no phase and becomes
    ``+sqrt(N)`` (its gradient is 0, never NaN). Otherwise the map is odd,
    ``fixed_amplitude(-noise) = -fixed_amplitude(noise)``: a pair stays a pair.

    Uses the mesh's transforms, so on a process grid each rank passes its block and
    gets its block of the same field as on one device. Differentiable (collective
    backward on a grid).

    Args:
        noise: real ``(..., *local_real_shape)`` of ``mesh`` (float32 or float64).
        mesh: the particle-grid mesh (a :class:`~torchpm.mesh.LocalMesh` or a
            :class:`~torchpm.distributed.PencilDecomposition`); default: the whole
            grid ``noise.shape[-3:]`` on one device.

    Returns:
        The fixed noise, shaped and typed like ``noise``.
    """
    if mesh is not None and not isinstance(mesh, PencilDecomposition):
        raise ValueError(
            f"fixed_amplitude: `mesh` must be a LocalMesh or a PencilDecomposition, got {type(mesh).__name__}")
    error = None
    if not isinstance(noise, torch.Tensor):
        error = f"fixed_amplitude: `noise` must be a tensor, got {type(noise).__name__}"
    elif noise.is_complex() or noise.dtype not in (torch.float32, torch.float64):
        error = f"fixed_amplitude: `noise` must be a real float32 or float64 tensor, got {noise.dtype}"
    elif mesh is None and noise.dim() < 3:
        error = f"fixed_amplitude: `noise` must have at least 3 dimensions (..., nx, ny, nz), got {tuple(noise.shape)}"
    elif mesh is not None and tuple(noise.shape[-3:]) != tuple(mesh.local_real_shape):
        error = (f"fixed_amplitude: `noise` must have shape (..., {', '.join(map(str, mesh.local_real_shape))}), "
                 f"the local block of `mesh` (global shape {tuple(mesh.global_shape)}), got {tuple(noise.shape)}")
    elif noise.numel() and not bool(torch.isfinite(noise).all()):
        error = f"fixed_amplitude: `noise` contains {int((~torch.isfinite(noise)).sum())} NaN or infinite values"
    if mesh is None:
        if error is not None:
            raise ValueError(error)
        mesh = LocalMesh(noise.shape[-3:])
    else:
        # On a grid one rank's bad block raises on every rank (none waits in the transform).
        mesh.raise_together(error, operation="fixed_amplitude")
    noise_k = mesh.rfftn(noise)
    modulus = noise_k.abs()
    nonzero = modulus > 0
    # Both wheres: no 0/0 in the value, and none in the gradient (the masked branch
    # divides by 1; abs's own gradient at 0 is 0).
    phase = torch.where(nonzero, noise_k / torch.where(nonzero, modulus, torch.ones_like(modulus)),
                        torch.ones_like(noise_k))
    return mesh.irfftn(phase * math.sqrt(mesh.size))


def _nonzero_k(k: torch.Tensor):
    """``(k > 0, k with 0 replaced by the smallest nonzero k)``: a spectrum at k = 0 is never
    used (the mode is zeroed), so it is evaluated at the smallest k instead."""
    nonzero = k > 0
    k_floor = k[nonzero].min() if bool(nonzero.any()) else torch.ones((), dtype=k.dtype, device=k.device)
    return nonzero, torch.where(nonzero, k, k_floor)


def power_kernel(
    kernels: FourierKernels, box_size: Sequence[float], power: Callable, cosmology: Cosmology
) -> torch.Tensor:
    """``sqrt(P(|k|) N / V)`` on the Fourier block (0 at k = 0), in the field dtype.

    P is evaluated in float64 on the block's device, once per distinct ``|k|``
    (:meth:`~torchpm.fourier.FourierKernels.radial`), once per simulation.
    """
    mesh = kernels.mesh
    volume = math.prod(float(b) for b in box_size)
    cosmology = cosmology.to(kernels.device)

    def amplitude(k):
        nonzero, safe = _nonzero_k(k)
        p = power(safe, cosmology)
        if isinstance(p, torch.Tensor):
            p = p.to(device=k.device, dtype=torch.float64)
        else:
            p = torch.as_tensor(p, dtype=torch.float64, device=k.device)
        check_finite(p, "power spectrum values")
        if bool((p < 0).any()):
            raise ValueError("the power spectrum must not be negative")
        values = torch.sqrt(p * (mesh.size / volume))
        return torch.where(nonzero, values, torch.zeros_like(values))

    return kernels.radial(amplitude, dtype=kernels.dtype)


def primordial_transfer(
    kernels: FourierKernels, power: Callable, cosmology: Cosmology, D1_matter_era, k0: float = PRIMORDIAL_K
) -> torch.Tensor:
    """``(2, *local_fourier_shape)``: the transfer ``M(k) = delta_L(k, a=1) / Phi(k)`` from
    the primordial potential to the linear density, and ``1 / M`` (both 0 at k = 0), in
    the field dtype (see the module docstring)::

        M(k) = 2/3 (k c/H0)^2 T(k) D_md(1) / Omega_m,   T(k)^2 = P(k) k0^n_s / (P(k0) k^n_s)

    Args:
        kernels: :class:`FourierKernels` of the particle grid.
        power: the linear power ``power(k, cosmology)`` at ``a = 1``.
        cosmology: the :class:`Cosmology` (``n_s``, ``Omega_m``).
        D1_matter_era: ``D1(1)`` normalised to ``a`` deep in matter domination
            (:attr:`~torchpm.cosmology.GrowthTable.D1_matter_era`).
        k0: wavenumber (h/Mpc) at which ``T = 1`` is taken.

    Differentiable in the cosmology (and in a spectrum's own parameters).
    """
    from .cosmology import HUBBLE_DISTANCE

    if D1_matter_era is None:
        raise ValueError("primordial_transfer: `D1_matter_era` is None; take it from growth_table(cosmology)")
    cosmology = cosmology.to(kernels.device)
    growth = torch.as_tensor(D1_matter_era, dtype=torch.float64).to(kernels.device)
    scale = 2.0 / 3.0 * HUBBLE_DISTANCE**2 * growth / cosmology.Omega_m
    n_s = cosmology.n_s

    def transfer(k):
        nonzero, safe = _nonzero_k(k)
        points = torch.cat([safe, torch.tensor([k0], dtype=torch.float64, device=k.device)])
        values = torch.as_tensor(power(points, cosmology)).to(device=k.device, dtype=torch.float64)
        values = torch.broadcast_to(values, points.shape)  # (a constant spectrum may be a number)
        check_finite(values, "power spectrum values")
        if bool((values < 0).any()):
            raise ValueError("the power spectrum must not be negative")
        p, p0 = values[:-1], values[-1]
        if not bool(p0 > 0):
            raise ValueError(f"`f_nl` needs a positive power spectrum at k = {k0:g} h/Mpc (where T = 1), got {float(p0)}")
        transfer_function = torch.sqrt(p / p0 * torch.exp(n_s * torch.log(k0 / safe)))
        forward = scale * safe * safe * transfer_function
        # A mode without power (P = 0) has M = 0: no potential, no f_nl term there.
        present = nonzero & (forward > 0)
        zero = torch.zeros_like(forward)
        inverse = torch.where(present, 1.0 / torch.where(present, forward, torch.ones_like(forward)), zero)
        return torch.stack([torch.where(nonzero, forward, zero), inverse], -1)

    return kernels.radial(transfer, dtype=kernels.dtype).movedim(-1, 0).contiguous()


def linear_field(noise: torch.Tensor, amplitude: torch.Tensor, mesh, f_nl=None, transfer=None) -> torch.Tensor:
    """The linear density field at ``a = 1`` from white noise.

    Args:
        noise: ``(B, *local_real_shape)`` white noise (unit variance).
        amplitude: :func:`power_kernel` of the grid.
        mesh: the particle-grid mesh.
        f_nl: local primordial non-Gaussianity (a number or 0-d tensor), or None for
            a Gaussian field.
        transfer: with ``f_nl``, :func:`primordial_transfer` of the grid.

    Returns:
        ``(B, *local_real_shape)`` dimensionless overdensity ``delta_L``.
    """
    delta_k = multiply_real(mesh.rfftn(noise), amplitude)
    if f_nl is None:
        return mesh.irfftn(delta_k)
    if transfer is None:
        raise ValueError("linear_field: `f_nl` needs `transfer` (primordial_transfer of the grid)")
    potential = mesh.irfftn(multiply_real(delta_k, transfer[1]))
    square_k = multiply_real(mesh.rfftn(potential * potential), transfer[0])
    f_nl = torch.as_tensor(f_nl, device=noise.device).to(noise.dtype)
    return mesh.irfftn(delta_k + square_k * f_nl)


def lpt_displacements(delta: torch.Tensor, kernels: FourierKernels, order: int = 2):
    """First- and second-order LPT displacements of the linear field, in Mpc/h.

    Args:
        delta: ``(B, *local_real_shape)`` linear field on the particle grid.
        kernels: :class:`FourierKernels` of the particle grid.
        order: 1 or 2.

    Returns:
        ``(psi1, psi2)``, each ``(B, 3, *local_real_shape)`` (``psi2`` is None for order 1).
    """
    if order not in (1, 2):
        raise ValueError(f"`lpt_order` must be 1 or 2, got {order!r}")
    mesh = kernels.mesh
    delta_k = mesh.rfftn(delta)
    psi1 = gradient_inverse_laplacian(delta_k, kernels)
    if order == 1:
        return psi1, None
    # phi_ij = d_i d_j grad^-2 delta = H_ij (-1/k^2) delta with H_ij the second-derivative
    # multiplier (-k_i k_j, the Nyquist plane kept for i = j, with "exact"; G_i G_j with "fd4").
    if kernels.real_space_gradient:
        # "fd4": G_i G_j is the 4-point stencil applied twice, and psi1_i = -d_i phi is
        # the first application (gradient_inverse_laplacian), so phi_ij = -d_j psi1_i:
        # three real-space stencils (one call on the three components) instead of six
        # inverse transforms. The same operator; the sums round differently.
        batch = psi1.shape[0]
        components = psi1.reshape(batch * 3, *psi1.shape[2:])
        second = mesh.fd4_gradient(components, _real_space_scale(kernels, (-1.0, -1.0, -1.0)))
        second = second.reshape(batch, 3, 3, *psi1.shape[2:])  # [:, i, j] = phi_ij
        xx, yy, zz = second[:, 0, 0], second[:, 1, 1], second[:, 2, 2]
        xy, xz, yz = second[:, 0, 1], second[:, 0, 2], second[:, 1, 2]
    else:
        potential = multiply_real(delta_k, kernels.inverse_laplacian_pair, paired=True)
        pairs = [(0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2)]
        # All six second derivatives in one inverse transform call; the sign goes on
        # the small (at most 2-d) kernels, not on the mesh.
        hessian = mesh.irfftn(stack_products(potential, [-kernels.second_derivative(i, j) for i, j in pairs]))
        xx, yy, zz, xy, xz, yz = hessian.unbind(1)
    source = xx * yy + xx * zz + yy * zz - xy * xy - xz * xz - yz * yz
    psi2 = gradient_inverse_laplacian(mesh.rfftn(source), kernels)
    return psi1, psi2


def grid_positions(particle_shape: Sequence[int], mesh_factor: int, *, dtype, device, offset=(0, 0, 0)):
    """``(N, 3)`` unperturbed positions ``q`` in force-mesh cells, C order over the grid block."""
    axes = [
        (torch.arange(n, dtype=dtype, device=device) + o) * mesh_factor for n, o in zip(particle_shape, offset)
    ]
    grid = torch.meshgrid(*axes, indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)


def lpt_initial_state(
    psi1: torch.Tensor,
    psi2: torch.Tensor | None,
    growth: GrowthValues,
    q: torch.Tensor,
    cell_size: Sequence[float],
    lpt_normalisation: str = "fastpm",
):
    """Positions and momenta at ``a0`` in force-mesh cells from LPT displacements.

    Args:
        psi1, psi2: ``(B, 3, *grid)`` displacements in Mpc/h (``psi2`` may be None).
        growth: :class:`GrowthValues` at ``a0`` (0-d entries).
        q: ``(N, 3)`` grid positions in force-mesh cells.
        cell_size: force-mesh cell sizes (Mpc/h).
        lpt_normalisation: ``"fastpm"`` (second-order term ``3/7 D2(a0) Psi2``) or
            ``"exact"`` (``D2_norm D2(a0) Psi2 = -D2(a0)/D1(1)^2 Psi2``); see the module
            docstring.

    Returns:
        ``(x0, p0)``, each ``(B, N, 3)``.
    """
    check_lpt_normalisation(lpt_normalisation)
    batch = psi1.shape[0]
    dtype = psi1.dtype
    inverse_cell = torch.tensor([1.0 / c for c in cell_size], dtype=dtype, device=psi1.device)

    def coefficient(factor):  # Mpc/h -> cells, per component, broadcast over (B, 3, N)
        return (factor * inverse_cell).view(1, 3, 1)

    # Summed on the grid layout (B, 3, N) and turned into the particle layout (B, N, 3)
    # once: the state the integrator updates stays contiguous (one-pass updates).
    D1, f1 = growth.D1.to(dtype), growth.f1.to(dtype)
    momentum_factor = (growth.a**2 * growth.E).to(dtype)
    first = psi1.reshape(batch, 3, -1)
    displacement = first * coefficient(D1)
    velocity = first * coefficient(momentum_factor * f1 * D1)
    if psi2 is not None:
        if lpt_normalisation == "fastpm":
            D2 = (3.0 / 7.0 * growth.D2).to(dtype)
        else:
            if growth.D2_norm is None:
                raise ValueError(
                    "lpt_normalisation='exact' needs GrowthValues.D2_norm; take the growth "
                    "values from a GrowthTable (growth_table(cosmology).at(a))"
                )
            D2 = (growth.D2_norm * growth.D2).to(dtype)
        second = psi2.reshape(batch, 3, -1)
        displacement = torch.addcmul(displacement, second, coefficient(D2))
        velocity = torch.addcmul(velocity, second, coefficient(momentum_factor * growth.f2.to(dtype) * D2))
    # q first: the sum takes q's contiguous (N, 3) layout (contiguous() then costs nothing).
    return (q + displacement.transpose(1, 2)).contiguous(), velocity.transpose(1, 2).contiguous()
