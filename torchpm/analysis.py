"""Power spectra, cross spectra, cross-correlation coefficient, transfer function, and the
two-point correlation function in configuration space.

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

from .fourier import window_of
from .mesh import LocalMesh, as_box_size
from .ops._arguments import ORDER_NAMES, order_number, tensor_argument

__all__ = [
    "PowerSpectrum",
    "power_spectrum",
    "cross_power",
    "correlation_coefficient",
    "transfer_function",
    "paint_density",
    "Multipoles",
    "power_multipoles",
    "cross_multipoles",
    "redshift_space",
    "legendre",
    "CorrelationFunction",
    "correlation_function",
    "cross_correlation",
    "aliased_window_power",
    "correlation_from_power",
]


class PowerSpectrum(NamedTuple):
    """Binned spectrum. ``k``: ``(n_bins,)`` mean |k| (h/Mpc) of the modes in each bin;
    ``power``: ``(B, n_bins)`` or ``(n_bins,)`` in (Mpc/h)^3; ``modes``: ``(n_bins,)``
    number of modes. Empty bins are dropped."""

    k: torch.Tensor
    power: torch.Tensor
    modes: torch.Tensor


def _window_argument(window, compensate_cic, function="power_spectrum"):
    if not isinstance(compensate_cic, bool):
        raise TypeError(f"`compensate_cic` must be a bool, got {compensate_cic!r}")
    if window is None:
        return "cic" if compensate_cic else None
    name = ORDER_NAMES[order_number(window, function, "window")]
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
    if (field.dim() == 4 and field.shape[0] == 0) or (mesh is None and 0 in field.shape[-3:]):
        return f"`{name}` must hold at least one batch member and one cell per axis, got shape {tuple(field.shape)}"
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


# Fourier entries binned per pass: the shell sums go plane by plane (along x of the local
# Fourier block) so no temporary holds more than about this many entries, whatever the mesh.
_BIN_CHUNK = 1 << 21


_MAX_BINS = 2**24


def _bin_edges(k_axes, mesh, box, bins, device):
    """The shells' edges (h/Mpc) for ``bins`` (see :func:`cross_power`)."""
    k_fundamental = min(2 * math.pi / b for b in box)
    if bins is None:
        k_nyquist = min(math.pi * n / b for n, b in zip(mesh.global_shape, box))
        count = max(1, int(math.floor(k_nyquist / k_fundamental - 0.5)))
        return k_fundamental * (torch.arange(count + 1, dtype=torch.float64, device=device) + 0.5)
    if isinstance(bins, numbers.Integral) and not isinstance(bins, bool):
        bins = int(bins)
        if bins < 1:
            raise ValueError(f"`bins` must be a positive number of bins or increasing bin edges, got {bins}")
        if bins > _MAX_BINS:  # (edges of 8 bytes each; more than any mesh has distinct |k|)
            raise ValueError(f"`bins` must be at most {_MAX_BINS} (2**24), got {bins}")
        # |k|^2 is a sum over the axes and the block a product of ranges: its largest |k|
        # is the root of the sum of each axis's largest k_i^2.
        if math.prod(mesh.local_fourier_shape):
            local_max = torch.sqrt(sum((ki**2).max() for ki in k_axes)).to(torch.float64)
        else:
            local_max = torch.zeros((), dtype=torch.float64, device=device)
        k_max = float(mesh.all_reduce(local_max.reshape(1), "max")[0])
        return torch.linspace(0.5 * k_fundamental, k_max * (1 + 1e-12), bins + 1, dtype=torch.float64, device=device)
    return _edges_argument(bins, "h/Mpc", device)


def _edges_argument(bins, unit: str, device, least: float | None = None) -> torch.Tensor:
    """``bins`` given as edges: at least 2, finite and increasing (and ``>= least``), float64."""
    message = f"`bins` must be None, a positive int or at least 2 finite increasing bin edges in {unit}, got {bins!r}"
    if isinstance(bins, (str, bytes, bool, numbers.Real)):
        raise ValueError(message)
    try:
        edges = torch.as_tensor(bins, dtype=torch.float64, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(message) from None
    if edges.dim() != 1 or edges.numel() < 2 or not bool(torch.isfinite(edges).all()) \
            or bool((edges[1:] <= edges[:-1]).any()) or (least is not None and bool(edges[0] < least)):
        raise ValueError(message)
    return edges


def _binned(values_of, count: int, mesh: LocalMesh, box: Sequence[float], bins, window: str | None, device,
            ells: tuple[int, ...] | None = None, axis: int = 2):
    """Shell averages over the modes of the local Fourier block, all-reduced over the grid.

    ``values_of(start, end)``: ``(count, end - start, ly, lz)`` float64 values of the x
    planes ``start:end`` of the block (a product of transforms), asked for a few planes
    at a time so that no temporary of the size of the mesh is made. With ``ells``, each
    value is weighted by ``(2 ell + 1) L_ell(mu)``, ``mu = k_axis / |k|``.

    Returns ``(k, means, modes)``: ``means`` is ``(count, n_bins)``, or ``(count,
    len(ells), n_bins)`` with ``ells``; empty bins dropped."""
    w = mesh.wavevectors(dtype=torch.float64, device=device)
    k_axes = [wi * n / b for wi, n, b in zip(w, mesh.global_shape, box)]
    weight = mesh.hermitian_weights(dtype=torch.float64, device=device)
    edges = _bin_edges(k_axes, mesh, box, bins, device)
    n_bins = edges.numel() - 1
    lx, ly, lz = mesh.local_fourier_shape
    extra = () if ells is None else (len(ells),)
    modes = torch.zeros(n_bins + 1, dtype=torch.float64, device=device)
    k_sum = torch.zeros(n_bins + 1, dtype=torch.float64, device=device)
    sums = torch.zeros(count, *extra, n_bins + 1, dtype=torch.float64, device=device)
    planes = max(1, _BIN_CHUNK // max(1, ly * lz))
    for start in range(0, lx, planes):
        end = min(lx, start + planes)
        kx = k_axes[0][start:end]
        k = torch.sqrt(kx**2 + k_axes[1] ** 2 + k_axes[2] ** 2)  # (end - start, ly, lz)
        flat_k = k.reshape(-1)
        index, valid = _shell_index(flat_k, edges)
        flat_weight = weight.expand_as(k).reshape(-1) * valid
        modes = modes.index_add(0, index, flat_weight)
        k_sum = k_sum.index_add(0, index, flat_weight * flat_k)
        values = values_of(start, end)
        if window is not None:
            values = values / window_of((w[0][start:end], w[1], w[2]), window) ** 2
        if ells is not None:
            values = values.unsqueeze(1) * _multipole_weights(ells, (kx, k_axes[1], k_axes[2])[axis], k)
        flat_values = values.reshape(*values.shape[:-3], -1) * flat_weight
        sums = sums + torch.zeros_like(sums).index_add(-1, index, flat_values)
    return _global_shells(modes, k_sum, sums, mesh)


def _shell_index(x, edges):
    """``(index, valid)``: the shell of each ``x`` in ``[edges[i], edges[i+1])``, the number of
    shells (an overflow slot, dropped) for one outside every shell or at ``x = 0``."""
    n_bins = edges.numel() - 1
    index = torch.bucketize(x, edges, right=True) - 1
    valid = (index >= 0) & (index < n_bins) & (x > 0)
    return torch.where(valid, index, torch.full_like(index, n_bins)), valid


def _global_shells(counts, x_sums, sums, mesh):
    """The shells' counts, sums of their coordinate and sums of the values (the last axis
    ``n_bins + 1`` long: an overflow slot) all-reduced over the grid in one call, the empty
    shells dropped: ``(mean coordinate, means, counts)`` on every rank. The coordinate and the
    counts do not depend on the fields: they carry no gradient."""
    n_bins = counts.numel() - 1
    totals = mesh.all_reduce(torch.cat([counts[:n_bins].unsqueeze(0), x_sums[:n_bins].unsqueeze(0),
                                        sums.reshape(-1, n_bins + 1)[:, :n_bins]]))
    counts, x_sums, sums = totals[0].detach(), totals[1].detach(), totals[2:].reshape(*sums.shape[:-1], n_bins)
    keep = counts > 0
    counts = counts[keep]
    return x_sums[keep] / counts, sums[..., keep] / counts, counts


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


def _measure(function, fields, box_size, bins, compensate_cic, window, mesh, options=(), error=None):
    """Checks ``fields`` (``{argument name: tensor}``, the same shape) and the options (on a
    grid: on every rank together, before any collective), then transforms each field once.
    ``options``: more ``(name, value)`` pairs the ranks must agree on; ``error``: the
    caller's own argument error, raised with the others (on every rank of a grid).
    Returns ``(mesh, box, window, transforms, single)`` with ``transforms`` the float64 rfft
    of each field in the order given, batched ``(B, ...)``."""
    try:
        window = _window_argument(window, compensate_cic, function)
    except (TypeError, ValueError) as exc:
        window, error = None, error or exc
    _check_mesh_argument(mesh, function)
    names = list(fields)
    for i, name in enumerate(names):
        if not any(fields[earlier] is fields[name] for earlier in names[:i]):  # (one check per tensor)
            error = error or _field_error(fields[name], name, mesh)
    if error is None:
        for name in names[1:]:
            if fields[name].shape != fields[names[0]].shape:
                error = (f"`{names[0]}` and `{name}` must have the same shape, got "
                         f"{tuple(fields[names[0]].shape)} and {tuple(fields[name].shape)}")
                break
    try:
        box = as_box_size(box_size)
    except ValueError as exc:
        box, error = None, error or str(exc)
    if hasattr(mesh, "agree"):
        # The shell sums are all-reduced: their number depends on the bins and the box,
        # so the ranks must agree on those before any collective.
        mesh.agree(function, [("`box_size`", box), ("`bins`", _bins_key(bins)), ("`window`", window),
                              *options], error)
    elif mesh is not None:
        mesh.raise_together(error, operation=function)
    elif isinstance(error, BaseException):
        raise error
    elif error:
        raise ValueError(error)
    batched = [_fields(fields[name], name)[0] for name in names]
    single = fields[names[0]].dim() == 3
    if mesh is None:
        _warn_if_block(batched[0].shape[-3:], box_size, "torchpm.analysis")
    mesh = mesh or LocalMesh(batched[0].shape[-3:])
    transforms = []
    # One transform per tensor on one device. On a grid every field is transformed: a
    # collective, so it cannot depend on which ranks passed the same tensor twice.
    shared = getattr(mesh, "is_local", True)
    for name, field in zip(names, batched):
        same = next((t for n, t in zip(names, transforms) if shared and fields[n] is fields[name]), None)
        transforms.append(same if same is not None else mesh.rfftn(field.to(torch.float64)))
    return mesh, box, window, transforms, single


def _product(a_k, b_k, mesh, box):
    """``V/N^2 Re(a conj b)`` per mode."""
    return (a_k.real * b_k.real + a_k.imag * b_k.imag) * (math.prod(box) / mesh.size**2)


def cross_power(
    field_a: torch.Tensor,
    field_b: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    bins=None,
    compensate_cic: bool = False,
    window: str | None = None,
    mesh=None,
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
    return _spectra("cross_power", {"field_a": field_a, "field_b": field_b}, [(0, 1)], box_size, bins,
                    compensate_cic, window, mesh)[0]


def _spectra(function, fields, pairs, box_size, bins, compensate_cic, window, mesh, options=(), error=None):
    """The binned spectra of ``pairs`` (indices into ``fields``) with one transform per field
    and one all-reduce for all of them."""
    mesh, box, window, transforms, single = _measure(function, fields, box_size, bins, compensate_cic, window, mesh,
                                                     options, error)
    batch = transforms[0].shape[0]

    def values_of(start, end):
        planes = [t[:, start:end] for t in transforms]
        products = [_product(planes[i], planes[j], mesh, box) for i, j in pairs]
        return torch.stack(products).reshape(len(pairs) * batch, *products[0].shape[1:])

    k, power, modes = _binned(values_of, len(pairs) * batch, mesh, box, bins, window, transforms[0].device)
    power = power.reshape(len(pairs), batch, -1)
    return [PowerSpectrum(k, p[0] if single else p, modes) for p in power]


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
    """The ``stacklevel`` of the first caller outside the torchpm package and torch's
    ``nn.Module`` call (the user's line, also when a torchpm layer warns)."""
    import inspect

    package = os.path.dirname(os.path.abspath(__file__))
    module_call = os.path.abspath(inspect.getsourcefile(torch.nn.Module))
    level, frame = 1, inspect.currentframe().f_back
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep)
                                 or os.path.abspath(frame.f_code.co_filename) == module_call):
        level, frame = level + 1, frame.f_back
    return level


def _shot_noise_argument(shot_noise, n_particles, box_size) -> tuple[float, str | None]:
    """``(the constant to subtract from the auto power, None)`` (0.0: none), or ``(0.0,
    what is wrong)`` for the caller to raise with the ranks' other errors."""
    if shot_noise is not None and n_particles is not None:
        return 0.0, "pass at most one of `shot_noise` and `n_particles`"
    if n_particles is not None:
        if isinstance(n_particles, bool) or not isinstance(n_particles, numbers.Integral) or n_particles <= 0:
            return 0.0, f"`n_particles` must be a positive integer, got {n_particles!r}"
        try:
            return math.prod(as_box_size(box_size)) / int(n_particles), None
        except ValueError as exc:
            return 0.0, str(exc)
    if shot_noise is not None and (isinstance(shot_noise, bool) or not isinstance(shot_noise, numbers.Real)
                                   or not math.isfinite(shot_noise)):
        return 0.0, f"`shot_noise` must be a finite number in (Mpc/h)^3, got {shot_noise!r}"
    return (0.0 if shot_noise is None else float(shot_noise)), None


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
) -> PowerSpectrum:
    """Power spectrum of a field in shells of |k| (see :func:`cross_power` for the arguments).

    Args:
        shot_noise: a constant (Mpc/h)^3 to subtract, or
        n_particles: subtract the Poisson shot noise ``V / n_particles``.
    """
    return _auto_power("power_spectrum", "field", field, box_size, bins, compensate_cic, window, shot_noise,
                       n_particles, mesh)


def _auto_power(function, name, field, box_size, bins, compensate_cic, window, shot_noise, n_particles, mesh):
    """:func:`power_spectrum` of the argument ``name`` of ``function`` (its errors name both)."""
    noise, error = _shot_noise_argument(shot_noise, n_particles, box_size)
    result = _spectra(function, {name: field}, [(0, 0)], box_size, bins, compensate_cic, window, mesh,
                      [("the shot noise subtracted", noise)], error)[0]
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


def correlation_coefficient(field_a, field_b, box_size, *, bins=None, compensate_cic: bool = False,
                            window: str | None = None, mesh=None) -> PowerSpectrum:
    """``r(k) = P_ab / sqrt(P_aa P_bb)`` (returned in the ``power`` slot; the arguments of
    :func:`cross_power`). Each field is transformed once. Raises where an auto power is zero
    (r is undefined there)."""
    cross, auto_a, auto_b = _spectra("correlation_coefficient", {"field_a": field_a, "field_b": field_b},
                                     [(0, 1), (0, 0), (1, 1)], box_size, bins, compensate_cic, window, mesh)
    _require_power("correlation_coefficient", "field_a", auto_a)
    _require_power("correlation_coefficient", "field_b", auto_b)
    return PowerSpectrum(cross.k, cross.power / torch.sqrt(auto_a.power * auto_b.power), cross.modes)


def transfer_function(field, reference, box_size, *, bins=None, compensate_cic: bool = False,
                      window: str | None = None, shot_noise: float | None = None, n_particles: int | None = None,
                      mesh=None) -> PowerSpectrum:
    """``T(k) = sqrt(P_field / P_reference)`` (returned in the ``power`` slot; the arguments
    of :func:`power_spectrum`, shot noise subtracted from both). A batch of fields may share
    one reference (``(B, nx, ny, nz)`` against ``(nx, ny, nz)``). Raises where the
    reference has no power."""
    if mesh is None and all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (field, reference)) \
            and field.shape[-3:] != reference.shape[-3:]:
        raise ValueError(f"transfer_function: `field` {tuple(field.shape)} and `reference` {tuple(reference.shape)} "
                         "must be on the same mesh (the same last three dimensions)")
    auto = _auto_power("transfer_function", "field", field, box_size, bins, compensate_cic, window, shot_noise,
                       n_particles, mesh)
    auto_ref = _auto_power("transfer_function", "reference", reference, box_size, bins, compensate_cic, window,
                           shot_noise, n_particles, mesh)
    _require_power("transfer_function", "reference", auto_ref)
    return PowerSpectrum(auto.k, torch.sqrt(auto.power / auto_ref.power), auto.modes)


# ----------------------------------------------------------------------------
# Redshift space: multipoles of the power spectrum.


class Multipoles(NamedTuple):
    """Binned Legendre multipoles of a power spectrum. ``k``: ``(n_bins,)`` mean |k|
    (h/Mpc) of the modes in each bin; ``power``: ``(B, n_ells, n_bins)`` or
    ``(n_ells, n_bins)`` in (Mpc/h)^3, ``power[..., i, :]`` the multipole ``ells[i]``;
    ``modes``: ``(n_bins,)``; ``ells``: the multipoles' orders. Empty bins are dropped."""

    k: torch.Tensor
    power: torch.Tensor
    modes: torch.Tensor
    ells: tuple[int, ...]


_AXES = {"x": 0, "y": 1, "z": 2}


def line_of_sight_axis(axis, function: str) -> int:
    """``axis`` (0, 1, 2 or "x", "y", "z") as an index."""
    if isinstance(axis, str) and axis in _AXES:
        return _AXES[axis]
    if isinstance(axis, numbers.Integral) and not isinstance(axis, bool) and 0 <= int(axis) <= 2:
        return int(axis)
    raise ValueError(f"{function}: `axis` (the line of sight) must be 0, 1, 2 or 'x', 'y', 'z', got {axis!r}")


def _ells_argument(ells, function: str) -> tuple[int, ...]:
    message = (f"{function}: `ells` must be distinct even integers >= 0 (the multipoles of an auto or cross "
               f"power of real fields in the plane-parallel limit; odd ones vanish), got {ells!r}")
    if isinstance(ells, numbers.Integral) and not isinstance(ells, bool):
        ells = (ells,)
    try:
        values = tuple(ells)
    except TypeError:
        raise ValueError(message) from None
    if not values or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0 or v % 2 for v in values) \
            or len(set(int(v) for v in values)) != len(values):
        raise ValueError(message)
    return tuple(int(v) for v in values)


def _multipole_weights(ells: Sequence[int], k_axis: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``(len(ells), *k.shape)``: ``(2 ell + 1) L_ell(mu)`` per mode, ``mu = k_axis / |k|``
    (0 at ``k = 0``, a mode no shell holds)."""
    k_axis = k_axis.expand_as(k)
    mu = torch.where(k > 0, k_axis / torch.where(k > 0, k, torch.ones_like(k)), torch.zeros_like(k))
    orders = torch.tensor([2.0 * ell + 1 for ell in ells], dtype=k.dtype, device=k.device)
    return legendre(ells, mu) * orders.view(-1, *([1] * k.dim()))


def legendre(ells: Sequence[int], mu: torch.Tensor) -> torch.Tensor:
    """``(len(ells), *mu.shape)``: the Legendre polynomials ``L_ell(mu)`` (Bonnet's recursion)."""
    previous, current = torch.ones_like(mu), mu
    values = {0: previous, 1: current}
    for n in range(1, max(ells)):
        previous, current = current, ((2 * n + 1) * mu * current - n * previous) / (n + 1)
        values[n + 1] = current
    return torch.stack([values[ell] for ell in ells])


def _multipoles(function, fields, box_size, ells, axis, bins, compensate_cic, window, mesh, noise=0.0, error=None):
    try:
        ells = _ells_argument(ells, function)
        axis = line_of_sight_axis(axis, function)
    except ValueError as exc:
        # (raised with the other ranks' errors: on a grid none is left in the agreement)
        ells, axis, error = (0,), -1, error or str(exc)
    mesh, box, window, transforms, single = _measure(function, fields, box_size, bins, compensate_cic, window, mesh,
                                                     [("`ells`", ells), ("`axis`", axis),
                                                      ("the shot noise subtracted", noise)], error)
    a_k, b_k = transforms[0], transforms[-1]

    def values_of(start, end):
        return _product(a_k[:, start:end], b_k[:, start:end], mesh, box)

    k, power, modes = _binned(values_of, a_k.shape[0], mesh, box, bins, window, a_k.device, ells=ells, axis=axis)
    if noise and 0 in ells:  # Poisson noise is isotropic: the monopole's alone
        power = power - torch.tensor([noise if ell == 0 else 0.0 for ell in ells], dtype=power.dtype,
                                     device=power.device).view(1, -1, 1)
    return Multipoles(k, power[0] if single else power, modes, ells)


def power_multipoles(
    field: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    ells: Sequence[int] = (0, 2, 4),
    axis: int | str = 2,
    bins=None,
    compensate_cic: bool = False,
    window: str | None = None,
    shot_noise: float | None = None,
    n_particles: int | None = None,
    mesh=None,
) -> Multipoles:
    """Legendre multipoles of the power spectrum about a fixed line of sight
    (plane-parallel), in shells of |k|::

        P_ell(k) = (2 ell + 1) V/N^2 < |DFT delta|^2 L_ell(mu) >_shell,   mu = k_axis / |k|

    the shell average and its mode counting as in :func:`power_spectrum` (so ``P_0`` is
    :func:`power_spectrum`'s P(k)). For a field in redshift space (e.g. the density of
    :meth:`torchpm.Simulation.redshift_space`'s state) linear theory gives Kaiser's
    ``P_0 = (1 + 2f/3 + f^2/5) P``, ``P_2 = (4f/3 + 4f^2/7) P``, ``P_4 = 8f^2/35 P``.

    Args:
        ells: even multipole orders (default ``(0, 2, 4)``).
        axis: the line of sight: 0, 1, 2 or ``"x"``, ``"y"``, ``"z"``.
        shot_noise, n_particles: subtracted from the monopole only (Poisson noise is
            isotropic); see :func:`power_spectrum`.
        bins, compensate_cic, window, mesh: as in :func:`cross_power` (on a process grid
            every rank gets the global multipoles).

    Returns:
        :class:`Multipoles`; ``power`` is ``(B, len(ells), n_bins)`` for batched input.
    """
    noise, error = _shot_noise_argument(shot_noise, n_particles, box_size)
    return _multipoles("power_multipoles", {"field": field}, box_size, ells, axis, bins, compensate_cic, window,
                       mesh, noise, error)


def cross_multipoles(
    field_a: torch.Tensor,
    field_b: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    ells: Sequence[int] = (0, 2, 4),
    axis: int | str = 2,
    bins=None,
    compensate_cic: bool = False,
    window: str | None = None,
    mesh=None,
) -> Multipoles:
    """Legendre multipoles of the cross power ``V/N^2 Re(DFT a conj(DFT b))`` about a fixed
    line of sight; the arguments of :func:`power_multipoles`."""
    return _multipoles("cross_multipoles", {"field_a": field_a, "field_b": field_b}, box_size, ells, axis, bins, compensate_cic, window, mesh)


def redshift_space(
    positions: torch.Tensor,
    momenta: torch.Tensor,
    a,
    cosmology,
    box_size: float | Sequence[float] | None,
    *,
    axis: int | str = 2,
) -> torch.Tensor:
    """Positions moved to redshift space along a fixed line of sight (plane-parallel)::

        s = x + (v . e) / (a H(a)) e = x + p_axis / (a^2 E(a)) e

    with ``p = a^3 E dx/da`` the simulation's momenta, in the same length unit as the
    positions (Mpc/h, or mesh cells for a :class:`~torchpm.MeshUnitsState`). Differentiable
    in the positions, the momenta and the cosmology's parameters. Local to the particles
    given: on a process grid each rank's call gives its own particles' share of a gradient
    in the cosmology; :meth:`torchpm.Simulation.redshift_space` sums it over the grid (and
    checks that the ranks pass the same arguments).

    Args:
        positions, momenta: ``(B, N, 3)`` (any leading shape, 3 components last).
        a: the scale factor of the particles (a float or a 0-dim tensor).
        cosmology: a :class:`~torchpm.Cosmology` (for ``E(a)``).
        box_size: the periodic box in the positions' unit (the result is wrapped into
            ``[0, box)``), or ``None`` to leave it unwrapped.
        axis: the line of sight, 0, 1, 2 or ``"x"``, ``"y"``, ``"z"``.
    """
    axis = line_of_sight_axis(axis, "redshift_space")
    for name, value in (("positions", positions), ("momenta", momenta)):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() < 1 \
                or value.shape[-1] != 3:
            raise ValueError(f"redshift_space: `{name}` must be a real floating-point tensor of shape (..., 3), got "
                             f"{getattr(value, 'shape', type(value).__name__)}")
    if momenta.shape != positions.shape:
        raise ValueError(f"redshift_space: `momenta` of shape {tuple(momenta.shape)} must have the shape of `positions`, "
                         f"{tuple(positions.shape)}")
    if not callable(getattr(cosmology, "E", None)):
        raise TypeError(f"redshift_space: `cosmology` must be a torchpm.Cosmology, got {type(cosmology).__name__}")
    a_value = float(a.detach()) if isinstance(a, torch.Tensor) and a.numel() == 1 else a
    if isinstance(a_value, bool) or not isinstance(a_value, numbers.Real) or not (0 < float(a_value) <= 1):
        raise ValueError(f"redshift_space: `a` must be a scale factor in (0, 1], got {a!r}")
    box = None if box_size is None else torch.tensor(as_box_size(box_size), dtype=positions.dtype,
                                                     device=positions.device)
    a_tensor = a if isinstance(a, torch.Tensor) else torch.tensor(float(a), dtype=torch.float64)
    factor = 1.0 / (a_tensor.to(torch.float64) ** 2 * cosmology.E(a_tensor.to(torch.float64)))
    shift = momenta[..., axis] * factor.to(device=momenta.device, dtype=momenta.dtype)
    moved = torch.cat([positions[..., :axis], (positions[..., axis] + shift).unsqueeze(-1),
                       positions[..., axis + 1:]], dim=-1)
    if box is not None:
        moved = torch.remainder(moved, box)
        moved = torch.where(moved >= box, moved - box, moved)  # (rounding up to the box)
    return moved


def _owned(mesh, positions, weights):
    """On a process grid, the particles (and weights) moved to the ranks owning their
    positions, as painting needs; empty slots of the padded result get zero weight.
    Unchanged on one device."""
    if getattr(mesh, "is_local", True):
        return positions, weights
    ids = torch.zeros(positions.shape[:2], dtype=torch.int64, device=positions.device)
    # (the channels as one axis; written out, not -1, which an empty rank cannot infer)
    attributes = () if weights is None else (weights.reshape(*weights.shape[:2], math.prod(weights.shape[2:])),)
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
        contains shot noise ``V / N`` (for :func:`correlation_function`'s ``n_particles``,
        paint without interlacing: that keeps only the even aliasing images of the noise).
    """
    _check_mesh_argument(mesh, "paint_density")
    error, name = None, None
    try:
        positions = tensor_argument(positions, "positions", "paint_density")
        weights = tensor_argument(weights, "weights", "paint_density", optional=True)
        if positions.dim() != 3 or positions.shape[-1] != 3:
            raise ValueError(f"paint_density: expected `positions` of shape (B, N, 3), got {tuple(positions.shape)}")
        if weights is not None and (weights.dim() < 2 or tuple(weights.shape[:2]) != tuple(positions.shape[:2])):
            raise ValueError(
                f"paint_density: expected `weights` of shape {tuple(positions.shape[:2])} (B, N) like `positions`, "
                f"got {tuple(weights.shape)}"
            )
        if not isinstance(interlacing, bool):
            raise TypeError(f"`interlacing` must be a bool, got {interlacing!r}")
        name = ORDER_NAMES[order_number(order, "paint_density")]
    except (TypeError, ValueError) as exc:
        if not hasattr(mesh, "agree") or getattr(mesh, "is_local", True):
            raise
        error = exc  # on a grid: raised on every rank together, in the agreement below
    if mesh is None:
        if shape is None:
            raise ValueError("paint_density: pass `mesh` or `shape`")
        mesh = LocalMesh(shape)
    if hasattr(mesh, "agree"):  # the all-reduce below and the paint's halo exchange depend on these
        batch = None if error else int(positions.shape[0])
        mesh.agree("paint_density", [("batch size (dim 0 of `positions`)", batch), ("`order`", name),
                                     ("`interlacing`", None if error else interlacing),
                                     ("`weights` given", None if error else weights is not None)],
                   error)  # (the exception: a TypeError stays one)
    cells = math.prod(mesh.global_shape)
    if weights is None:
        total = torch.full((positions.shape[0],), float(positions.shape[1]), dtype=torch.float64, device=positions.device)
    else:
        total = weights.detach().to(torch.float64).sum(1)
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


# ----------------------------------------------------------------------------
# Configuration space: the two-point correlation function.


class CorrelationFunction(NamedTuple):
    """Binned two-point correlation function. ``r``: ``(n_bins,)`` mean length (Mpc/h) of
    the cell separations in each shell; ``xi``: ``(n_bins,)`` or ``(B, n_bins)``, with
    ``ells`` ``(len(ells), n_bins)`` or ``(B, len(ells), n_bins)``, ``xi[..., i, :]`` the
    multipole ``ells[i]``; ``lags``: ``(n_bins,)`` the number of cell separations (lag
    vectors of the mesh) in each shell; ``ells``: the multipoles' orders, or ``None`` for
    the shell average. Empty shells are dropped."""

    r: torch.Tensor
    xi: torch.Tensor
    lags: torch.Tensor
    ells: tuple[int, ...] | None = None


def aliased_window_power(wavevectors, order) -> torch.Tensor:
    """``sum_n W^2(w + 2 pi n)`` over the aliasing images ``n`` of each wavevector: the
    shape in ``k`` of the Poisson shot noise of particles painted with ``order``'s window
    (Jing 2005), a product over the axes of polynomials in ``s^2 = sin^2(w_i/2)``:
    ``1`` (NGP), ``1 - 2/3 s^2`` (CIC), ``1 - s^2 + 2/15 s^4`` (TSC),
    ``1 - 4/3 s^2 + 2/5 s^4 - 4/315 s^6`` (PCS). For a field painted without interlacing."""
    from .ops._arguments import order_number

    coefficients = {1: (1.0,), 2: (1.0, -2.0 / 3.0), 3: (1.0, -1.0, 2.0 / 15.0),
                    4: (1.0, -4.0 / 3.0, 2.0 / 5.0, -4.0 / 315.0)}[order_number(order, "aliased_window_power")]
    result = 1.0
    for wi in wavevectors:
        s2 = torch.sin(wi / 2) ** 2
        axis = 0.0
        for c in reversed(coefficients):  # Horner
            axis = axis * s2 + c
        result = result * axis
    return result


def _lag_edges(mesh, box, bins, device):
    """The shells' edges (Mpc/h) for ``bins`` (see :func:`correlation_function`)."""
    # (over the axes with more than one cell: a separation has no extent along the others)
    spread = [(b, n) for b, n in zip(box, mesh.global_shape) if n > 1] or list(zip(box, mesh.global_shape))
    cell = max(b / n for b, n in spread)
    r_max = min(b for b, _ in spread) / 2
    if bins is None:
        count = max(1, int(math.floor(r_max / cell - 0.5)))
        return cell * (torch.arange(count + 1, dtype=torch.float64, device=device) + 0.5)
    if isinstance(bins, numbers.Integral) and not isinstance(bins, bool):
        if int(bins) < 1:
            raise ValueError(f"`bins` must be a positive number of bins or increasing bin edges, got {bins}")
        # (the last edge just past half a box side, so that separation is kept)
        return torch.linspace(0.0, r_max * (1 + 1e-12), int(bins) + 1, dtype=torch.float64, device=device)
    return _edges_argument(bins, "Mpc/h", device, least=0.0)


def _minimum_image_lags(mesh, box, device):
    """``(rx, ry, rz)`` in Mpc/h, broadcastable over the local real block: the separation
    each cell's global index stands for (its minimum image in the periodic mesh)."""
    lag = []
    for n, b, o, length in zip(mesh.global_shape, box, mesh.local_real_offset, mesh.local_real_shape):
        index = torch.arange(o, o + length, dtype=torch.float64, device=device)
        lag.append(torch.where(index > n // 2, index - n, index) * (b / n))
    return lag[0].view(-1, 1, 1), lag[1].view(1, -1, 1), lag[2].view(1, 1, -1)


def _lag_binned(values, mesh, box, edges, ells, axis):
    """Shell averages over the cell separations of the local real block, all-reduced over
    the grid. ``values``: ``(count, *local_real_shape)``, the value at each separation
    ``r`` (the minimum image of the block's global index times the cell). Returns ``(r,
    means, lags)`` as :func:`_binned` does (zero separation excluded, empty shells dropped)."""
    device = values.device
    lx, ly, lz = mesh.local_real_shape
    rx, ry, rz = _minimum_image_lags(mesh, box, device)
    n_bins = edges.numel() - 1
    count = values.shape[0]
    extra = () if ells is None else (len(ells),)
    lags = torch.zeros(n_bins + 1, dtype=torch.float64, device=device)
    r_sum = torch.zeros(n_bins + 1, dtype=torch.float64, device=device)
    sums = torch.zeros(count, *extra, n_bins + 1, dtype=torch.float64, device=device)
    planes = max(1, _BIN_CHUNK // max(1, ly * lz))
    for start in range(0, lx, planes):
        end = min(lx, start + planes)
        r = torch.sqrt(rx[start:end] ** 2 + ry**2 + rz**2)  # (end - start, ly, lz)
        flat_r = r.reshape(-1)
        index, valid = _shell_index(flat_r, edges)
        weight = valid.to(torch.float64)
        lags = lags.index_add(0, index, weight)
        r_sum = r_sum.index_add(0, index, weight * flat_r)
        block = values[:, start:end]
        if ells is not None:
            block = block.unsqueeze(1) * _multipole_weights(ells, (rx[start:end], ry, rz)[axis], r)
        flat_values = block.reshape(*block.shape[:-3], -1) * weight
        sums = sums + torch.zeros_like(sums).index_add(-1, index, flat_values)
    return _global_shells(lags, r_sum, sums, mesh)


def _n_particles_argument(n_particles, window, compensate_cic) -> str | None:
    if n_particles is None:
        return None
    if isinstance(n_particles, bool) or not isinstance(n_particles, numbers.Integral) or n_particles <= 0:
        return f"`n_particles` must be a positive integer (of equal-mass particles), got {n_particles!r}"
    if window is None and compensate_cic is not True:
        return ("`n_particles` needs `window=`, the window the particles were painted with: their self-pairs "
                "reach as far as the window does")
    return None


def _correlation(function, fields, box_size, bins, compensate_cic, window, mesh, ells, axis, n_particles=None):
    error = None
    try:
        axis = line_of_sight_axis(axis, function)
        if ells is not None:
            ells = _ells_argument(ells, function)
    except ValueError as exc:
        ells, axis, error = (0,), -1, str(exc)
    error = error or _n_particles_argument(n_particles, window, compensate_cic)
    mesh, box, window, transforms, single = _measure(
        function, fields, box_size, bins, compensate_cic, window, mesh,
        [("`ells`", ells), ("`axis`", axis if ells is not None else None),
         ("`n_particles`", None if n_particles is None or error else repr(int(n_particles)))], error)
    a_k, b_k = transforms[0], transforms[-1]
    edges = _lag_edges(mesh, box, bins, a_k.device)
    w = mesh.wavevectors(dtype=torch.float64, device=a_k.device)
    # conj(A) B: its inverse DFT is sum_x a(x) b(x + r); the k = 0 mode (the means) is dropped.
    product = a_k.conj() * b_k
    if n_particles is not None:
        # Poisson self-pairs of n_particles equal-mass particles painted with the window.
        product = product - aliased_window_power(w, window) * (mesh.size**2 / float(n_particles))
    k_zero = (w[0] == 0) & (w[1] == 0) & (w[2] == 0)
    product = product.masked_fill(k_zero, 0)  # (after the subtraction: none at k = 0 either)
    if window is not None:
        product = product / window_of(w, window) ** 2
    r, sums, lags = _lag_binned(mesh.irfftn(product), mesh, box, edges, ells, axis)
    xi = sums / mesh.size  # (the inverse DFT's sum over x, made a mean, on the shells alone)
    return CorrelationFunction(r, xi[0] if single else xi, lags, ells)


def correlation_function(
    field: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    bins=None,
    ells: Sequence[int] | None = None,
    axis: int | str = 2,
    compensate_cic: bool = False,
    window: str | None = None,
    n_particles: int | None = None,
    mesh=None,
) -> CorrelationFunction:
    """Two-point correlation function of a field on its mesh, in shells of the separation::

        xi(r) = < delta(x) delta(x + r) >_(x, r in the shell)

    averaged over every cell ``x`` and every separation ``r`` of the periodic mesh (the
    minimum image of each cell offset) in the shell: the inverse DFT of the power,
    ``xi(r) = 1/N^2 IDFT(|DFT delta|^2)``, binned. Exact for the mesh's field: it equals the
    sum over all cell pairs, done with two FFTs. The mean of the field is removed (its
    ``k = 0`` mode dropped, as :func:`power_spectrum` does) and zero separation is left out.
    Differentiable; on a process grid every rank gets the global result.

    Args:
        bins: None (shells one cell wide, of the largest cell side ``h``, centred on
            multiples of it, up to half the smallest box side; axes one cell thick left
            out), a number of equal-width shells from 0 to half the smallest box side, or
            bin edges in Mpc/h. Beyond half a box side a shell holds only some directions.
        ells: None for the shell average, or even multipole orders, e.g. ``(0, 2, 4)``:
            ``xi_ell(r) = (2 ell + 1) < xi L_ell(mu) >``, ``mu = r_axis / |r|``, about the
            line of sight ``axis`` (plane-parallel; for redshift-space fields).
        axis: the line of sight with ``ells``: 0, 1, 2 or ``"x"``, ``"y"``, ``"z"``.
        window, compensate_cic: divide the power by the mass-assignment window ``W^2``
            before the transform (see :func:`cross_power`); it sharpens the first few cells.
        n_particles: subtract the Poisson self-pairs of that many equal-mass particles
            painted with ``window`` (required with it) and without interlacing: the shot noise
            ``V / n_particles * sum_n W^2(w + 2 pi n)`` of :func:`aliased_window_power`,
            which reaches as far as the window. Without it the first shells (within the
            window's reach, 1-2 cells) hold the particles' pairs with themselves. An
            interlaced field keeps only the even aliasing images: this form is then wrong.
        mesh: as in :func:`cross_power`.

    Returns:
        :class:`CorrelationFunction`; ``xi`` is batched like the field.
    """
    return _correlation("correlation_function", {"field": field}, box_size, bins, compensate_cic, window, mesh,
                        ells, axis, n_particles)


def cross_correlation(
    field_a: torch.Tensor,
    field_b: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    bins=None,
    ells: Sequence[int] | None = None,
    axis: int | str = 2,
    compensate_cic: bool = False,
    window: str | None = None,
    mesh=None,
) -> CorrelationFunction:
    """Cross-correlation ``xi_ab(r) = < a(x) b(x + r) >`` of two fields on one mesh, in
    shells of the separation (the inverse DFT of ``conj(DFT a) DFT b / N^2``, means
    removed); the arguments of :func:`correlation_function`."""
    return _correlation("cross_correlation", {"field_a": field_a, "field_b": field_b}, box_size, bins,
                        compensate_cic, window, mesh, ells, axis)


def correlation_from_power(r, power, *, k_min: float = 1e-5, k_max: float = 100.0,
                           points: int | None = None) -> torch.Tensor:
    """The correlation function of an isotropic power spectrum at separations ``r``::

        xi(r) = 1 / (2 pi^2) int k^2 P(k) j0(k r) dk,   j0(x) = sin(x) / x

    by the trapezoidal rule in ``ln k`` on ``points`` log-spaced wavenumbers over
    ``[k_min, k_max]`` h/Mpc. The default ``points`` is 200 001, or more where the largest
    ``r`` needs them: 8 per period of ``j0`` at ``k_max``. The default range holds the
    linear power's contribution to a few 1e-4 of xi from 1 to 300 Mpc/h (against a
    converged integral); a tabulated power is integrated over its table's range. E.g.
    linear theory at ``a``: ``correlation_from_power(r, sim.linear_power) * D1(a)^2``.

    Args:
        r: separations in Mpc/h (a tensor or a sequence, > 0); the wavenumbers are made
            on its device.
        power: a callable ``P(k)`` of a float64 tensor of wavenumbers in h/Mpc, in
            (Mpc/h)^3, returning one finite value per wavenumber.

    Returns:
        float64 ``xi`` of ``r``'s shape and device.
    """
    function = "correlation_from_power"
    r = torch.as_tensor(r, dtype=torch.float64)
    if not callable(power):
        raise TypeError(f"{function}: `power` must be a callable P(k), got {type(power).__name__}")
    if points is not None and not (isinstance(points, numbers.Integral) and not isinstance(points, bool)
                                   and points >= 3):
        raise ValueError(f"{function}: `points` must be an integer >= 3 or None, got {points!r}")
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in (k_min, k_max)) \
            or not 0 < k_min < k_max < math.inf:
        raise ValueError(f"{function}: need 0 < `k_min` < `k_max` (finite, h/Mpc), got {k_min!r}, {k_max!r}")
    if r.numel() == 0 or not bool(torch.isfinite(r).all()) or bool((r <= 0).any()):
        raise ValueError(f"{function}: `r` must hold finite separations > 0 (Mpc/h)")
    span = math.log(k_max / k_min)
    if points is None:
        points = max(200_001, math.ceil(8 * k_max * float(r.max()) * span / (2 * math.pi)) + 1)
    log_k = torch.linspace(math.log(k_min), math.log(k_max), int(points), dtype=torch.float64, device=r.device)
    k = torch.exp(log_k)
    values = power(k)
    values = torch.as_tensor(values, dtype=torch.float64).to(r.device) if values is not None else None
    if values is None or values.shape != k.shape or not bool(torch.isfinite(values).all()):
        raise ValueError(f"{function}: `power` must return one finite value per wavenumber, shape {tuple(k.shape)}, "
                         f"got {None if values is None else tuple(values.shape)}"
                         + ("" if values is None or values.shape != k.shape else " with NaN or infinite values"))
    weights = torch.full_like(k, span / (int(points) - 1))
    weights[0] = weights[-1] = weights[0] / 2
    integrand = values * k**3 * weights / (2 * math.pi**2)
    flat = r.reshape(-1)
    result = torch.empty_like(flat)
    rows = max(1, (1 << 22) // int(points))  # (temporaries of about 4 million entries)
    for start in range(0, flat.numel(), rows):
        x = flat[start:start + rows, None] * k
        result[start:start + rows] = (integrand * torch.sinc(x / math.pi)).sum(-1)
    return result.reshape(r.shape)
