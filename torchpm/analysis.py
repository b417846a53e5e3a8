"""Power spectra, cross spectra, cross-correlation coefficient and transfer function.

Estimator (DESIGN.md): for a real field on ``N`` cells in a box of volume ``V``::

    P(k) = V / N^2 < |DFT delta|^2 >_shell

averaged over the modes of each spherical shell in ``|k|``, excluding ``k = 0``.
The rfft half-spectrum is used with each entry weighted by the number of full-DFT
modes it stands for (1 on the ``k_z = 0`` and Nyquist planes, 2 elsewhere), so
``modes`` counts modes of the full DFT and ``k`` is their mean ``|k|``.
Units: k in h/Mpc, P in (Mpc/h)^3 when the box is in Mpc/h.

Fields painted from particles are smoothed by the mass-assignment window
``W(w) = prod_i sinc(w_i / 2 pi)^p`` (p = 1 NGP, 2 CIC, 3 TSC, 4 PCS) and carry
aliased images of the power beyond the Nyquist frequency. ``window=`` divides
the measured power by ``W^2``; :func:`paint_density` paints with a chosen window
and, with ``interlacing=True``, paints a second time with the particles shifted
by half a cell along each axis and averages the two in Fourier space with the
phase factor ``exp(i w . (1/2, 1/2, 1/2))``, which cancels the odd aliasing images.

Distributed fields: pass the field's ``mesh`` (a
:class:`~torchpm.distributed.PencilDecomposition`, e.g. ``sim.force_mesh``) and this
rank's block of the field; the shell sums are all-reduced over the process grid,
so every rank gets the global result, equal to the serial one. The sums are
differentiable (every rank then holds the same result and computes the same loss).
"""

from __future__ import annotations

import math
import os
import warnings
import numbers
from typing import NamedTuple, Sequence

import torch

from .fourier import window as window_transform
from .mesh import LocalMesh, as_box_size
from .ops._arguments import ORDER_NAMES, order_number, tensor_argument

__all__ = [
    "PowerSpectrum",
    "power_spectrum",
    "cross_power",
    "correlation_coefficient",
    "transfer_function",
    "paint_density",
]


class PowerSpectrum(NamedTuple):
    """Binned spectrum. ``k``: ``(n_bins,)`` mean |k| (h/Mpc) of the modes in each bin;
    ``power``: ``(B, n_bins)`` or ``(n_bins,)`` in (Mpc/h)^3; ``modes``: ``(n_bins,)``
    number of modes. Empty bins are dropped."""

    k: torch.Tensor
    power: torch.Tensor
    modes: torch.Tensor


def _window_argument(window, compensate_cic):
    if not isinstance(compensate_cic, bool):
        raise TypeError(f"`compensate_cic` must be a bool, got {compensate_cic!r}")
    if window is None:
        return "cic" if compensate_cic else None
    name = ORDER_NAMES[order_number(window, "power_spectrum", "window")]
    if compensate_cic and name != "cic":
        raise ValueError(f"`compensate_cic=True` contradicts `window={window!r}`; pass only `window`")
    return name


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
    window: str | None,
):
    """Shell averages of ``spectrum_k`` (B, *fourier block, real) -> (k, mean, modes)."""
    device = spectrum_k.device
    w = mesh.wavevectors(dtype=torch.float64, device=device)
    k_axes = [wi * n / b for wi, n, b in zip(w, mesh.global_shape, box)]
    k = torch.sqrt(sum(ki**2 for ki in k_axes)).expand(*mesh.local_fourier_shape)
    weight = mesh.hermitian_weights(dtype=torch.float64, device=device).expand(*mesh.local_fourier_shape)
    values = spectrum_k.to(torch.float64)
    if window is not None:
        values = values / window_transform(mesh, window, device=device) ** 2
    k_fundamental = min(2 * math.pi / b for b in box)
    if bins is None:
        k_nyquist = min(math.pi * n / b for n, b in zip(mesh.global_shape, box))
        count = max(1, int(math.floor(k_nyquist / k_fundamental - 0.5)))
        edges = k_fundamental * (torch.arange(count + 1, dtype=torch.float64, device=device) + 0.5)
    elif isinstance(bins, numbers.Integral) and not isinstance(bins, bool):
        bins = int(bins)
        if bins < 1:
            raise ValueError(f"`bins` must be a positive number of bins or increasing bin edges, got {bins}")
        local_max = k.max() if k.numel() else torch.zeros((), dtype=k.dtype, device=device)
        k_max = float(mesh.all_reduce(local_max.reshape(1), "max")[0])
        edges = torch.linspace(0.5 * k_fundamental, k_max * (1 + 1e-12), bins + 1, dtype=torch.float64, device=device)
    else:
        message = f"`bins` must be None, a positive int or at least 2 finite increasing bin edges in h/Mpc, got {bins!r}"
        if isinstance(bins, (str, bytes, bool, numbers.Real)):
            raise ValueError(message)
        try:
            edges = torch.as_tensor(bins, dtype=torch.float64, device=device)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(message) from None
        if edges.dim() != 1 or edges.numel() < 2 or not bool(torch.isfinite(edges).all()) \
                or bool((edges[1:] <= edges[:-1]).any()):
            raise ValueError(message)
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


def _check_mesh_argument(mesh, function):
    if mesh is not None and not all(hasattr(mesh, name) for name in
                                    ("paint", "rfftn", "global_shape", "local_real_shape", "all_reduce")):
        hint = ""
        if isinstance(mesh, (tuple, list)) and all(isinstance(n, numbers.Integral) for n in mesh):
            hint = f"; for the whole mesh of that shape pass shape={tuple(int(n) for n in mesh)}"
        raise TypeError(
            f"{function}: `mesh` must be None or a mesh object such as torchpm.mesh.LocalMesh or a "
            f"PencilDecomposition (e.g. sim.force_mesh), got {type(mesh).__name__}{hint}"
        )


def _bins_key(bins):
    """``bins`` in a form equal on every rank that passes the same bins (ints, edges)."""
    if bins is None or isinstance(bins, (bool, str, bytes)):
        return repr(bins)
    if isinstance(bins, numbers.Integral):
        return int(bins)
    try:
        return repr(tuple(float(edge) for edge in torch.as_tensor(bins, dtype=torch.float64).reshape(-1)))
    except (TypeError, ValueError, RuntimeError):
        return repr(bins)


def cross_power(
    field_a: torch.Tensor,
    field_b: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    bins=None,
    compensate_cic: bool = False,
    window: str | None = None,
    mesh=None,
    _names: tuple[str, str] = ("field_a", "field_b"),
) -> PowerSpectrum:
    """Cross power ``V/N^2 <Re(DFT a conj(DFT b))>`` of two fields in shells of |k|.

    Args:
        field_a, field_b: ``(nx, ny, nz)`` or ``(B, nx, ny, nz)`` real fields (overdensity
            or density; the k = 0 mode is excluded).
        box_size: box side(s) in Mpc/h.
        bins: None (width ``2 pi / L`` shells centred on multiples of it, up to the
            Nyquist frequency), a number of equal-width bins, or bin edges in h/Mpc.
        window: the mass-assignment window the fields were painted with (``"ngp"``,
            ``"cic"``, ``"tsc"``, ``"pcs"``): divide each field by
            ``W = prod sinc^p(w/2pi)``, i.e. the power by ``W^2``. ``None``: no compensation.
        compensate_cic: the older switch, the same as ``window="cic"``.
        mesh: the mesh the fields live on (default: a :class:`LocalMesh` of the field
            shape); on a process grid, the fields are this rank's blocks and every
            rank gets the global result.

    Returns:
        :class:`PowerSpectrum`; ``power`` is ``(B, n_bins)`` for batched input.
    """
    window = _window_argument(window, compensate_cic)
    _check_mesh_argument(mesh, "cross_power")
    name_a, name_b = _names  # (the caller's argument names, e.g. power_spectrum's `field`)
    error = _field_error(field_a, name_a, mesh) or _field_error(field_b, name_b, mesh)
    if error is None and field_a.shape != field_b.shape:
        error = (f"`{name_a}` and `{name_b}` must have the same shape, got {tuple(field_a.shape)} and "
                 f"{tuple(field_b.shape)}")
    try:
        box = as_box_size(box_size)
    except ValueError as exc:
        box, error = None, error or str(exc)
    if hasattr(mesh, "agree"):
        # The shell sums are all-reduced: their number depends on the bins and the box,
        # so the ranks must agree on those before any collective.
        mesh.agree("cross_power", [("`box_size`", box), ("`bins`", _bins_key(bins)), ("`window`", window)], error)
    elif mesh is not None:
        mesh.raise_together(error, operation="cross_power")
    elif error:
        raise ValueError(error)
    a, single = _fields(field_a, name_a)
    b, _ = _fields(field_b, name_b)
    if mesh is None:
        _warn_if_block(a.shape[-3:], box_size, "torchpm.analysis")
    mesh = mesh or LocalMesh(a.shape[-3:])
    a_k = mesh.rfftn(a.to(torch.float64))
    b_k = a_k if field_b is field_a else mesh.rfftn(b.to(torch.float64))
    product = (a_k * b_k.conj()).real * (math.prod(box) / mesh.size**2)
    k, power, modes = _binned(product, mesh, box, bins, window)
    return PowerSpectrum(k, power[0] if single else power, modes)


def _warn_if_block(shape, box_size, function: str) -> None:
    """Warn when a field without ``mesh`` looks like a rank's block of a process grid: several
    ranks, one box side for all axes, but cells of different sizes along the axes (a block
    split along x or y), where the spectrum would be of the block alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    if not isinstance(box_size, numbers.Real):
        return
    cells = tuple(float(box_size) / n for n in shape)
    # (a block keeps z whole and splits x, y or both)
    if shape[0] < shape[2] or shape[1] < shape[2]:
        warnings.warn(
            f"{function}: a {tuple(shape)} field in a cubic {box_size} Mpc/h box has cells of sizes {cells} Mpc/h "
            f"under torch.distributed with {dist.get_world_size()} ranks: if it is this rank's block of a process "
            "grid, pass mesh=sim.force_mesh (without it the result is of the block alone)",
            stacklevel=_outside_torchpm(),
        )


def _outside_torchpm() -> int:
    """The ``stacklevel`` of the first caller outside the torchpm package (the user's line)."""
    import inspect

    package = os.path.dirname(os.path.abspath(__file__))
    level, frame = 1, inspect.currentframe().f_back
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        level, frame = level + 1, frame.f_back
    return level


def power_spectrum(
    field: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    bins=None,
    compensate_cic: bool = False,
    window: str | None = None,
    shot_noise: float | None = None,
    n_particles: int | None = None,
    mesh=None,
    _name: str = "field",
) -> PowerSpectrum:
    """Power spectrum of a field in shells of |k| (see :func:`cross_power` for the arguments).

    Args:
        shot_noise: a constant (Mpc/h)^3 to subtract, or
        n_particles: subtract the Poisson shot noise ``V / n_particles``.
    """
    if shot_noise is not None and n_particles is not None:
        raise ValueError("pass at most one of `shot_noise` and `n_particles`")
    if n_particles is not None and (isinstance(n_particles, bool) or not isinstance(n_particles, numbers.Integral)
                                    or n_particles <= 0):
        raise ValueError(f"`n_particles` must be a positive integer, got {n_particles!r}")
    if shot_noise is not None and (isinstance(shot_noise, bool) or not isinstance(shot_noise, numbers.Real)
                                   or not math.isfinite(shot_noise)):
        raise ValueError(f"`shot_noise` must be a finite number in (Mpc/h)^3, got {shot_noise!r}")
    result = cross_power(field, field, box_size, bins=bins, compensate_cic=compensate_cic, window=window, mesh=mesh,
                         _names=(_name, _name))
    noise = 0.0
    if n_particles is not None:
        noise = math.prod(as_box_size(box_size)) / int(n_particles)
    elif shot_noise is not None:
        noise = float(shot_noise)
    return PowerSpectrum(result.k, result.power - noise, result.modes)


def _require_power(function: str, name: str, spectrum: PowerSpectrum) -> None:
    """Raises when ``spectrum`` (the auto power of ``name``) is zero in a bin, where a ratio
    to it is undefined (0/0 or x/0: a NaN or Inf passed on)."""
    empty = spectrum.power.detach() <= 0
    if bool(empty.any()):
        k = spectrum.k.detach().expand_as(spectrum.power)[empty]
        raise ValueError(
            f"{function}: `{name}` has no power in {int(empty.sum())} of {empty.numel()} bins (k = "
            f"{', '.join(f'{float(v):.4g}' for v in k[:5])}{', ...' if k.numel() > 5 else ''} h/Mpc; a constant "
            "field?), where the ratio is undefined; pass a field with power in every bin, or bins that leave "
            "those k out"
        )


def correlation_coefficient(field_a, field_b, box_size, **options) -> PowerSpectrum:
    """``r(k) = P_ab / sqrt(P_aa P_bb)`` (returned in the ``power`` slot). Raises where
    an auto power is zero (r is undefined there)."""
    cross = cross_power(field_a, field_b, box_size, **options)
    auto_a = power_spectrum(field_a, box_size, **options, _name="field_a")
    auto_b = power_spectrum(field_b, box_size, **options, _name="field_b")
    _require_power("correlation_coefficient", "field_a", auto_a)
    _require_power("correlation_coefficient", "field_b", auto_b)
    return PowerSpectrum(cross.k, cross.power / torch.sqrt(auto_a.power * auto_b.power), cross.modes)


def transfer_function(field, reference, box_size, **options) -> PowerSpectrum:
    """``T(k) = sqrt(P_field / P_reference)`` (returned in the ``power`` slot). Raises
    where the reference has no power."""
    auto = power_spectrum(field, box_size, **options)
    auto_ref = power_spectrum(reference, box_size, **options, _name="reference")
    _require_power("transfer_function", "reference", auto_ref)
    return PowerSpectrum(auto.k, torch.sqrt(auto.power / auto_ref.power), auto.modes)


def _owned(mesh, positions, weights):
    """On a process grid, the particles (and weights) moved to the ranks owning their
    positions, as painting needs; empty slots of the padded result get zero weight.
    Unchanged on one device."""
    if getattr(mesh, "is_local", True):
        return positions, weights
    ids = torch.zeros(positions.shape[:2], dtype=torch.int64, device=positions.device)
    attributes = () if weights is None else (weights.reshape(*weights.shape[:2], -1),)
    _, positions, ids, *moved = mesh.migrate(positions, ids, *attributes)
    if weights is not None:
        weights = moved[0].reshape(*moved[0].shape[:2], *weights.shape[2:])
    if bool((ids < 0).any()):
        mask = (ids >= 0).to(positions.dtype)
        weights = mask if weights is None else weights * mask.reshape(*mask.shape, *([1] * (weights.dim() - 2)))
    return positions, weights


def paint_density(
    positions: torch.Tensor,
    mesh=None,
    *,
    weights: torch.Tensor | None = None,
    order: str = "cic",
    interlacing: bool = False,
    shape=None,
) -> torch.Tensor:
    """Overdensity of a particle set painted with a chosen window, ready for P(k).

    Args:
        positions: ``(B, N, 3)`` in mesh-cell units of ``mesh`` (node ``j`` at ``x = j``,
            periodic).
        mesh: a mesh object with the interface of :class:`~torchpm.mesh.LocalMesh`
            (``paint(positions, weights, order=)``, ``rfftn``, ``irfftn``,
            ``wavevectors``, ``global_shape``), or ``None`` for a ``LocalMesh`` of ``shape``.
        weights: ``(B, N)`` particle masses, or ``None`` for equal masses.
        order: ``"ngp"``, ``"cic"``, ``"tsc"`` or ``"pcs"``.
        interlacing: paint a second time with the particles shifted by half a cell
            along every axis and average the two in Fourier space with the phase
            ``exp(i w . (1/2, 1/2, 1/2))``, cancelling the odd aliasing images.
        shape: ``(nx, ny, nz)`` when ``mesh`` is None.

    Returns:
        ``(B, *local_real_shape)``: ``rho / mean(rho) - 1``, with the mean taken
        over the global mesh from the total mass of the particles (summed over
        the process grid when the mesh has ``all_reduce``). Measure its spectrum with
        ``power_spectrum(delta, box, window=order, mesh=mesh)``; the result still
        contains shot noise ``V / N``.
    """
    positions = tensor_argument(positions, "positions", "paint_density")
    weights = tensor_argument(weights, "weights", "paint_density", optional=True)
    if positions.dim() != 3 or positions.shape[-1] != 3:
        raise ValueError(f"paint_density: expected `positions` of shape (B, N, 3), got {tuple(positions.shape)}")
    if weights is not None and (weights.dim() < 2 or tuple(weights.shape[:2]) != tuple(positions.shape[:2])):
        raise ValueError(
            f"paint_density: expected `weights` of shape {tuple(positions.shape[:2])} (B, N) like `positions`, "
            f"got {tuple(weights.shape)}"
        )
    _check_mesh_argument(mesh, "paint_density")
    if not isinstance(interlacing, bool):
        raise TypeError(f"`interlacing` must be a bool, got {interlacing!r}")
    name = ORDER_NAMES[order_number(order, "paint_density")]
    if mesh is None:
        if shape is None:
            raise ValueError("paint_density: pass `mesh` or `shape`")
        mesh = LocalMesh(shape)
    cells = math.prod(mesh.global_shape)
    if weights is None:
        total = torch.full((positions.shape[0],), float(positions.shape[1]), dtype=torch.float64, device=positions.device)
    else:
        total = weights.detach().to(torch.float64).sum(1)
    if hasattr(mesh, "agree"):  # the all-reduce below and the paint's halo exchange depend on these
        mesh.agree("paint_density", [("batch size (dim 0 of `positions`)", int(positions.shape[0])),
                                     ("`order`", name), ("`interlacing`", interlacing),
                                     ("`weights` given", weights is not None)])
    if hasattr(mesh, "all_reduce"):  # a process grid: every rank's particles count
        total = mesh.all_reduce(total)
    if not bool((total > 0).all()):
        raise ValueError(
            f"paint_density: the total mass per batch member is {total.tolist()}: `positions` holds no particles "
            "or `weights` sum to zero (or less) for a batch member; the overdensity is undefined"
        )
    # mean-1 normalisation (a constant: gradients flow through the painted field)
    scale = (cells / total).to(positions.dtype).view(-1, 1, 1, 1)
    rho = mesh.paint(*_owned(mesh, positions, weights), order=name)
    if not interlacing:
        return rho * scale - 1.0
    shifted = mesh.paint(*_owned(mesh, positions + 0.5, weights), order=name)
    rho_k = mesh.rfftn(rho)
    shifted_k = mesh.rfftn(shifted)
    w = mesh.wavevectors(dtype=torch.float64, device=positions.device)
    phase = torch.exp(1j * 0.5 * (w[0] + w[1] + w[2])).to(rho_k.dtype)
    combined = 0.5 * (rho_k + shifted_k * phase)
    return mesh.irfftn(combined) * scale - 1.0
