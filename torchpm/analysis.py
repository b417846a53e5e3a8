"""Power spectra, cross spectra, cross-correlation coefficient and transfer function.

Estimator (DESIGN.md): for a real field on ``N`` cells in a box of volume ``V``::

    P(k) = V / N^2 < |DFT delta|^2 >_shell

averaged over the modes of each spherical shell in ``|k|``, excluding ``k = 0``.
The rfft half-spectrum is used with each entry weighted by the number of full-DFT
modes it stands for (1 on the ``k_z = 0`` and Nyquist planes, 2 elsewhere), so
``modes`` counts modes of the full DFT and ``k`` is their mean ``|k|``.
Units: k in h/Mpc, P in (Mpc/h)^3 when the box is in Mpc/h.

Distributed fields: pass the field's ``mesh`` (a
:class:`~torchpm.distributed.PencilDecomposition`, e.g. ``sim.force_mesh``) and this
rank's block of the field; the shell sums are all-reduced over the process grid,
so every rank gets the global result, equal to the serial one. The sums are
differentiable (every rank then holds the same result and computes the same loss).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from .mesh import LocalMesh, as_box_size

__all__ = ["PowerSpectrum", "power_spectrum", "cross_power", "correlation_coefficient", "transfer_function"]


class PowerSpectrum(NamedTuple):
    """Binned spectrum. ``k``: ``(n_bins,)`` mean |k| (h/Mpc) of the modes in each bin;
    ``power``: ``(B, n_bins)`` or ``(n_bins,)`` in (Mpc/h)^3; ``modes``: ``(n_bins,)``
    number of modes. Empty bins are dropped."""

    k: torch.Tensor
    power: torch.Tensor
    modes: torch.Tensor


def _field_error(field, name, mesh):
    """What is wrong with ``field`` (None if nothing)."""
    if not isinstance(field, torch.Tensor) or field.dim() not in (3, 4) or not field.is_floating_point() \
            or field.is_complex():
        return (
            f"`{name}` must be a real tensor of shape (nx, ny, nz) or (B, nx, ny, nz), got "
            f"{getattr(field, 'shape', type(field).__name__)}"
        )
    if mesh is not None and tuple(field.shape[-3:]) != tuple(mesh.local_real_shape):
        return (
            f"`{name}` of shape {tuple(field.shape)} does not match this rank's block "
            f"{tuple(mesh.local_real_shape)} of the mesh {tuple(mesh.global_shape)}"
        )
    if not bool(torch.isfinite(field).all()):
        return f"`{name}` contains NaN or infinite values"
    return None


def _fields(field, name):
    return field.unsqueeze(0) if field.dim() == 3 else field, field.dim() == 3


def _binned(
    spectrum_k: torch.Tensor,
    mesh: LocalMesh,
    box: Sequence[float],
    bins,
    compensate_cic: bool,
):
    """Shell averages of ``spectrum_k`` (B, *fourier block, real) -> (k, mean, modes)."""
    device = spectrum_k.device
    w = mesh.wavevectors(dtype=torch.float64, device=device)
    k_axes = [wi * n / b for wi, n, b in zip(w, mesh.global_shape, box)]
    k = torch.sqrt(sum(ki**2 for ki in k_axes)).expand(*mesh.local_fourier_shape)
    weight = mesh.hermitian_weights(dtype=torch.float64, device=device).expand(*mesh.local_fourier_shape)
    values = spectrum_k.to(torch.float64)
    if compensate_cic:
        window = 1.0
        for wi in w:
            window = window * torch.sinc(wi / (2 * math.pi)) ** 2
        values = values / window**2
    k_fundamental = min(2 * math.pi / b for b in box)
    if bins is None:
        k_nyquist = min(math.pi * n / b for n, b in zip(mesh.global_shape, box))
        count = max(1, int(math.floor(k_nyquist / k_fundamental - 0.5)))
        edges = k_fundamental * (torch.arange(count + 1, dtype=torch.float64, device=device) + 0.5)
    elif isinstance(bins, int) and not isinstance(bins, bool):
        if bins < 1:
            raise ValueError(f"`bins` must be a positive number of bins or increasing bin edges, got {bins}")
        local_max = k.max() if k.numel() else torch.zeros((), dtype=k.dtype, device=device)
        k_max = float(mesh.all_reduce(local_max.reshape(1), "max")[0])
        edges = torch.linspace(0.5 * k_fundamental, k_max * (1 + 1e-12), bins + 1, dtype=torch.float64, device=device)
    else:
        edges = torch.as_tensor(bins, dtype=torch.float64, device=device)
        if edges.dim() != 1 or edges.numel() < 2 or bool((edges[1:] <= edges[:-1]).any()):
            raise ValueError("`bins` must be an int or increasing bin edges in h/Mpc")
    n_bins = edges.numel() - 1
    index = torch.bucketize(k.reshape(-1), edges, right=True) - 1
    valid = (index >= 0) & (index < n_bins) & (k.reshape(-1) > 0)
    index = torch.where(valid, index, torch.full_like(index, n_bins))  # overflow bin, dropped
    flat_weight = weight.reshape(-1) * valid
    modes = torch.zeros(n_bins + 1, dtype=torch.float64, device=device).index_add_(0, index, flat_weight)
    k_sum = torch.zeros(n_bins + 1, dtype=torch.float64, device=device).index_add_(0, index, flat_weight * k.reshape(-1))
    batch = values.shape[0]
    flat_values = values.reshape(batch, -1) * flat_weight
    sums = torch.zeros(batch, n_bins + 1, dtype=torch.float64, device=device).index_add_(1, index, flat_values)
    # One all-reduce of every shell sum: the global spectrum on every rank.
    totals = mesh.all_reduce(torch.cat([modes[:n_bins].unsqueeze(0), k_sum[:n_bins].unsqueeze(0), sums[:, :n_bins]]))
    modes, k_sum, sums = totals[0], totals[1], totals[2:]
    keep = modes > 0
    modes = modes[keep]
    return k_sum[keep] / modes, sums[:, keep] / modes, modes


def cross_power(
    field_a: torch.Tensor,
    field_b: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    bins=None,
    compensate_cic: bool = False,
    mesh=None,
) -> PowerSpectrum:
    """Cross power ``V/N^2 <Re(DFT a conj(DFT b))>`` of two fields in shells of |k|.

    Args:
        field_a, field_b: ``(nx, ny, nz)`` or ``(B, nx, ny, nz)`` real fields (overdensity
            or density; the k = 0 mode is excluded).
        box_size: box side(s) in Mpc/h.
        bins: None (width ``2 pi / L`` shells centred on multiples of it, up to the
            Nyquist frequency), a number of equal-width bins, or bin edges in h/Mpc.
        compensate_cic: divide each field by the CIC window ``prod sinc^2(w/2pi)``.
        mesh: the mesh the fields live on (default: a :class:`LocalMesh` of the field
            shape); on a process grid, the fields are this rank's blocks and every
            rank gets the global result.

    Returns:
        :class:`PowerSpectrum`; ``power`` is ``(B, n_bins)`` for batched input.
    """
    error = _field_error(field_a, "field_a", mesh) or _field_error(field_b, "field_b", mesh)
    if error is None and field_a.shape != field_b.shape:
        error = (f"`field_a` and `field_b` must have the same shape, got {tuple(field_a.shape)} and "
                 f"{tuple(field_b.shape)}")
    if mesh is not None:
        mesh.raise_together(error)
    elif error:
        raise ValueError(error)
    a, single = _fields(field_a, "field_a")
    b, _ = _fields(field_b, "field_b")
    box = as_box_size(box_size)
    mesh = mesh or LocalMesh(a.shape[-3:])
    a_k = mesh.rfftn(a.to(torch.float64))
    b_k = a_k if field_b is field_a else mesh.rfftn(b.to(torch.float64))
    product = (a_k * b_k.conj()).real * (math.prod(box) / mesh.size**2)
    k, power, modes = _binned(product, mesh, box, bins, compensate_cic)
    return PowerSpectrum(k, power[0] if single else power, modes)


def power_spectrum(
    field: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    bins=None,
    compensate_cic: bool = False,
    shot_noise: float | None = None,
    n_particles: int | None = None,
    mesh=None,
) -> PowerSpectrum:
    """Power spectrum of a field in shells of |k| (see :func:`cross_power` for the arguments).

    Args:
        shot_noise: a constant (Mpc/h)^3 to subtract, or
        n_particles: subtract the Poisson shot noise ``V / n_particles``.
    """
    if shot_noise is not None and n_particles is not None:
        raise ValueError("pass at most one of `shot_noise` and `n_particles`")
    result = cross_power(field, field, box_size, bins=bins, compensate_cic=compensate_cic, mesh=mesh)
    noise = 0.0
    if n_particles is not None:
        if int(n_particles) <= 0:
            raise ValueError(f"`n_particles` must be positive, got {n_particles}")
        noise = math.prod(as_box_size(box_size)) / int(n_particles)
    elif shot_noise is not None:
        noise = float(shot_noise)
    return PowerSpectrum(result.k, result.power - noise, result.modes)


def correlation_coefficient(field_a, field_b, box_size, **options) -> PowerSpectrum:
    """``r(k) = P_ab / sqrt(P_aa P_bb)`` (returned in the ``power`` slot)."""
    cross = cross_power(field_a, field_b, box_size, **options)
    auto_a = power_spectrum(field_a, box_size, **options)
    auto_b = power_spectrum(field_b, box_size, **options)
    return PowerSpectrum(cross.k, cross.power / torch.sqrt(auto_a.power * auto_b.power), cross.modes)


def transfer_function(field, reference, box_size, **options) -> PowerSpectrum:
    """``T(k) = sqrt(P_field / P_reference)`` (returned in the ``power`` slot)."""
    auto = power_spectrum(field, box_size, **options)
    auto_ref = power_spectrum(reference, box_size, **options)
    return PowerSpectrum(auto.k, torch.sqrt(auto.power / auto_ref.power), auto.modes)
