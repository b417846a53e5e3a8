"""Weak lensing from a simulation's light cone: density planes and the Born convergence.

The observer sits on the face ``x_axis = 0`` of the box and looks along ``axis``; the
box's depth along that axis is cut into ``n`` slabs (lens planes) of comoving width
``w = depth / n`` centred at ``chi_i = (i + 1/2) w``. Plane ``i`` is taken from the
particles at the scale factor ``a_i = a(chi_i)`` at which light from it reaches the
observer (:func:`lens_planes`), so a run must step to every ``a_i``
(:func:`lightcone_steps` merges them into a step list) and :func:`lightcone` collects
the planes while it runs. The transverse directions are periodic: a plane is the
projected overdensity of its slab on an ``R0 x R1`` pixel grid over the box's
transverse extent (:func:`density_plane`), read at the comoving transverse position
``f_K(chi_i) theta`` of each angle (flat sky, the plane repeated periodically).

Born approximation (convergence of sources at comoving distance ``chi_s``)::

    kappa(theta) = 3/2 Om (H0/c)^2 sum_i w_i f_K(chi_i) f_K(chi_s - chi_i) / f_K(chi_s)
                   * delta_i(f_K(chi_i) theta) / a_i

(:func:`convergence_born`; planes beyond the source do not contribute). Everything is
differentiable: in the particles (so in the white noise and the cosmology through the
run), in the planes, in the angles and in the cosmology's parameters (``Om``, the source
distance, ``f_K``). The planes' scale factors are fixed numbers (the steps of the run),
computed in the cosmology given to :func:`lens_planes`.

On a process grid each rank paints its own particles into the whole plane and the
planes are summed over the grid (a plane is ``R0 R1`` numbers, small next to the
mesh), so every rank holds the same planes and the same convergence map, with the
replicated-result convention of :func:`torchpm.analysis.power_spectrum`.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple, Sequence

import torch

from .analysis import line_of_sight_axis
from .cosmology import HUBBLE_DISTANCE, Cosmology, _gauss_legendre
from .mesh import as_box_size
from .ops import paint, readout
from .ops._arguments import ORDER_NAMES, order_number

__all__ = [
    "LensPlanes",
    "lens_planes",
    "lightcone_steps",
    "density_plane",
    "angular_grid",
    "convergence_born",
    "lightcone",
    "AngularPowerSpectrum",
    "angular_power_spectrum",
    "limber_convergence_power",
]


class LensPlanes(NamedTuple):
    """Where the lens planes are, nearest first. ``distances``: comoving distance of
    each plane's centre (Mpc/h); ``widths``: its comoving thickness (Mpc/h);
    ``scale_factors``: ``a(distance)``, when the run must take the plane; ``axis``:
    the line of sight (0, 1 or 2), the observer being on the face where it is 0."""

    distances: tuple[float, ...]
    widths: tuple[float, ...]
    scale_factors: tuple[float, ...]
    axis: int


def _positive_int(value, name, function) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{function}: `{name}` must be a positive integer, got {value!r}")
    return int(value)


def _pair(value, name, function, kind, limit=None) -> tuple:
    """``value`` (one or two ``kind`` values, at most ``limit``) as a pair."""
    values = (value, value) if not isinstance(value, (tuple, list)) else tuple(value)
    if len(values) != 2:
        raise ValueError(f"{function}: `{name}` must be one or two values, got {value!r}")
    if kind is int:
        return tuple(_positive_int(v, name, function) for v in values)
    if any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0)
           for v in values):
        raise ValueError(f"{function}: `{name}` must be one or two positive numbers, got {value!r}")
    if limit is not None and any(v > limit for v in values):
        raise ValueError(f"{function}: `{name}` must be at most {limit:g} (flat sky), got {value!r}")
    return tuple(float(v) for v in values)


def _check_planes(planes, function) -> None:
    """ValueError unless ``planes`` is a usable :class:`LensPlanes`."""
    if not isinstance(planes, LensPlanes):
        raise ValueError(f"{function}: `planes` must be a LensPlanes (from lens_planes), got {type(planes).__name__}")
    n = len(planes.distances)
    if n == 0 or len(planes.widths) != n or len(planes.scale_factors) != n:
        raise ValueError(f"{function}: `planes` must hold at least one plane and as many widths and scale factors as "
                         f"distances, got {len(planes.distances)}, {len(planes.widths)} and {len(planes.scale_factors)}")
    values = [*planes.distances, *planes.widths, *planes.scale_factors]
    if any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) for v in values) \
            or any(d < 0 for d in planes.distances) or any(w <= 0 for w in planes.widths) \
            or any(not 0 < a <= 1 for a in planes.scale_factors) or planes.axis not in (0, 1, 2):
        raise ValueError(f"{function}: `planes` must have distances >= 0, widths > 0, scale factors in (0, 1] and an "
                         f"axis 0, 1 or 2, got {planes!r}")


def _cosmology(cosmology, function) -> Cosmology:
    if not isinstance(cosmology, Cosmology):
        raise ValueError(f"{function}: `cosmology` must be a torchpm.Cosmology, got {type(cosmology).__name__}")
    return cosmology


def lens_planes(cosmology: Cosmology, box_size, n_planes: int, *, axis: int | str = 2,
                depth: float | None = None) -> LensPlanes:
    """``n_planes`` slabs of equal width tiling ``[0, depth]`` along ``axis`` (default
    ``depth``: the box's length along it), with the scale factor of each centre in
    ``cosmology`` (the one the simulation runs).

    Args:
        cosmology: a :class:`~torchpm.Cosmology`.
        box_size: the box (Mpc/h), a number or 3 numbers.
        n_planes: number of planes.
        axis: line of sight, 0, 1, 2 or ``"x"``, ``"y"``, ``"z"``.
        depth: comoving depth of the light cone (Mpc/h), at most the box's length along
            ``axis`` (a slab is one piece of the box: no particle is used twice).
    """
    function = "lens_planes"
    cosmology = _cosmology(cosmology, function)
    box = as_box_size(box_size)
    axis = line_of_sight_axis(axis, function)
    n_planes = _positive_int(n_planes, "n_planes", function)
    if depth is None:
        depth = box[axis]
    if isinstance(depth, bool) or not isinstance(depth, numbers.Real) or not (0 < depth <= box[axis] * (1 + 1e-12)):
        raise ValueError(f"{function}: `depth` must be in (0, {box[axis]}] Mpc/h (the box's length along the line of "
                         f"sight), got {depth!r}")
    width = float(depth) / n_planes
    distances = tuple((i + 0.5) * width for i in range(n_planes))
    with torch.no_grad():
        scale_factors = cosmology.scale_factor_at_distance(torch.tensor(distances, dtype=torch.float64))
    return LensPlanes(distances, (width,) * n_planes, tuple(float(a) for a in scale_factors.cpu()), axis)


def lightcone_steps(planes: LensPlanes, a_start: float, steps: int) -> list[float]:
    """The scale factors to pass as a simulation's ``steps`` so that it stops at every
    plane: ``steps`` steps linear in ``a`` from ``a_start`` to the nearest plane's ``a``,
    the planes' scale factors put in place of the nearest linear ones (a linear step
    closer than a quarter step to a plane is dropped, so no step is tiny)."""
    function = "lightcone_steps"
    _check_planes(planes, function)
    steps = _positive_int(steps, "steps", function)
    a_far, a_near = min(planes.scale_factors), max(planes.scale_factors)
    if isinstance(a_start, bool) or not isinstance(a_start, numbers.Real) or not (0 < a_start < a_far):
        raise ValueError(f"{function}: `a_start` must be in (0, {a_far:.6g}) (before the farthest plane's scale "
                         f"factor), got {a_start!r}")
    spacing = (a_near - a_start) / steps
    linear = [a_start + spacing * (i + 1) for i in range(steps)]
    kept = [a for a in linear if min(abs(a - p) for p in planes.scale_factors) > 0.25 * spacing]
    return sorted(set(kept) | set(planes.scale_factors))


def density_plane(
    positions: torch.Tensor,
    box_size,
    center: float,
    width: float,
    resolution: int | Sequence[int],
    *,
    axis: int | str = 2,
    weights: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    total=None,
    order: str | int = "cic",
    mesh=None,
    _edges: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Projected overdensity ``delta`` of the slab ``center - w/2 <= x_axis < center + w/2``
    (``w = width``; periodic: positions wrapped into ``[0, L)``; slabs sharing an edge
    compare each particle with the same number, so they never both hold it) on an ``R0 x R1`` grid
    over the two transverse axes (in increasing order), painted with the window
    ``order``. Node ``(j0, j1)`` sits at transverse position ``(j0 L0 / R0, j1 L1 / R1)``.

    ``delta = painted / mean - 1`` with ``mean = total (width / L_axis) / (R0 R1)``, the
    expected count per pixel of a uniform distribution of ``total`` particles (default:
    the sum of the weights, over the grid when ``mesh`` is one).

    Args:
        positions: ``(B, N, 3)`` comoving positions in Mpc/h (any values: wrapped).
        box_size: the box (Mpc/h).
        center, width: the slab along ``axis`` (Mpc/h).
        resolution: pixels per transverse axis (one or two integers).
        weights: ``(B, N)`` masses (default 1).
        ids: ``(B, N)`` int64; slots with ``ids < 0`` (a grid state's empty slots) carry
            no mass. Required with a process grid's ``mesh``.
        total: the number (or total weight) of particles per batch member, over all ranks.
        order: mass-assignment window (``"ngp"``, ``"cic"``, ``"tsc"``, ``"pcs"``).
        mesh: a process grid's mesh (e.g. ``sim.force_mesh``): each rank paints its own
            particles and the plane is summed over the grid, so every rank gets it whole.

    Returns:
        ``(B, R0, R1)``, differentiable in ``positions`` and ``weights``.
    """
    function = "density_plane"
    distributed = mesh is not None and not getattr(mesh, "is_local", True)
    error, values = None, []
    try:
        box = as_box_size(box_size)
        axis = line_of_sight_axis(axis, function)
        order = order_number(order, function, "order")
        resolution = _pair(resolution, "resolution", function, int)
        for name, value in (("center", center), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{function}: `{name}` must be a finite number (Mpc/h), got {value!r}")
        if not 0 < width <= box[axis]:
            raise ValueError(f"{function}: `width` must be in (0, {box[axis]}] Mpc/h, got {width!r}")
        if not isinstance(positions, torch.Tensor) or not positions.is_floating_point() or positions.dim() != 3 \
                or positions.shape[-1] != 3:
            raise ValueError(f"{function}: `positions` must be a (B, N, 3) floating-point tensor, got "
                             f"{getattr(positions, 'shape', type(positions).__name__)}")
        if distributed and ids is None:
            raise ValueError(f"{function}: on a process grid pass `ids` (a grid state's empty slots, id -1, carry "
                             "no mass; for particles without empty slots pass zeros)")
        for name, value in (("weights", weights), ("ids", ids)):
            if value is not None and (not isinstance(value, torch.Tensor)
                                      or tuple(value.shape) != tuple(positions.shape[:2])):
                raise ValueError(f"{function}: `{name}` must be a {tuple(positions.shape[:2])} tensor like the "
                                 f"positions' first two axes, got {getattr(value, 'shape', type(value).__name__)}")
        if total is not None and (isinstance(total, bool) or not isinstance(total, numbers.Real)
                                  or not (math.isfinite(total) and total > 0)):
            raise ValueError(f"{function}: `total` must be a positive number (particles per batch member), got {total!r}")
        if weights is not None and weights.dtype != positions.dtype:
            raise ValueError(f"{function}: `weights` must have the positions' dtype {positions.dtype}, got {weights.dtype}")
        finite = torch.isfinite(positions.detach()).all(-1)
        if ids is not None:
            finite = finite | (ids < 0)
        if not bool(finite.all()):
            raise ValueError(f"{function}: `positions` must be finite, got {int((~finite).sum())} particles with NaN "
                             "or inf coordinates")
        if weights is not None and total is None:  # (summed into the total; with `total`: those in the slab, below)
            finite = torch.isfinite(weights.detach())
            if ids is not None:
                finite = finite | (ids < 0)  # (an empty slot's weight is never read)
            if not bool(finite.all()):
                raise ValueError(f"{function}: `weights` must be finite, got {int((~finite).sum())} NaN or inf")
        values = [("box_size", box), ("axis", axis), ("order", order), ("resolution", resolution),
                  ("center", float(center)), ("width", float(width)), ("batch", positions.shape[0]),
                  ("dtype", str(positions.dtype)), ("weights", weights is not None),
                  ("total", None if total is None else float(total))]
    except ValueError as exc:
        if not distributed:
            raise
        error = str(exc)
    if distributed:
        mesh.agree("density_plane", values, error)
    dtype, device = positions.dtype, positions.device
    lengths = torch.tensor(box, dtype=dtype, device=device)
    transverse = [i for i in range(3) if i != axis]
    # the slab [lo, hi) of [0, L) (two pieces when it crosses the box's face); the wrapped
    # coordinate is compared with the edges themselves, so neighbouring slabs agree
    length = box[axis]
    along = torch.remainder(positions[..., axis].detach(), length)
    along = torch.where(along >= length, along - length, along)  # (rounding up to L)
    # (`_edges`: the slab's edges as the caller computed them, so that the edges of
    # neighbouring slabs are the same numbers: :func:`lightcone`)
    lo, hi = (center - 0.5 * width, center + 0.5 * width) if _edges is None else _edges
    shift = math.floor(lo / length) * length
    lo, hi = lo - shift, hi - shift  # lo in [0, L)
    if hi <= length:
        mass = (along >= lo) & (along < hi)
    else:
        mass = (along >= lo) | (along < hi - length)
    if ids is not None:
        mass = mass & (ids >= 0)
    if weights is not None and total is not None:
        # the weights read: the slab's (ranks agree on `weights` and `total`: all check)
        bad = int((mass & ~torch.isfinite(weights.detach())).sum())
        error = f"{function}: `weights` must be finite in the slab, got {bad} NaN or inf" if bad else None
        if distributed:
            mesh.raise_together(error, operation="density_plane (weights)")
        elif error:
            raise ValueError(error)
    # Only the slab's particles are painted (a slab holds a fraction of them): each
    # member's slab particles, in slot order, in the first of K slots (K the largest
    # count of a member; the others' extra slots point at slot 0 with mass 0). One
    # linear compaction (nonzero, then each particle's place within its member's row).
    # Gathering them is exact for values and gradients: a particle outside paints
    # nothing either way.
    counts = mass.sum(1)
    rows, columns = mass.nonzero(as_tuple=True)
    starts = (counts.cumsum(0) - counts).repeat_interleave(counts)
    selected = torch.zeros(mass.shape[0], int(counts.max()), dtype=torch.int64, device=device)
    selected[rows, torch.arange(len(rows), device=device) - starts] = columns
    inside = torch.arange(selected.shape[1], device=device) < counts.unsqueeze(1)
    plane_positions = positions[..., transverse].gather(1, selected.unsqueeze(-1).expand(-1, -1, 2))
    mass = inside.to(dtype)
    if weights is not None:  # (the unused slots point at slot 0, which may be empty: its weight is not read)
        mass = torch.where(inside, weights.gather(1, selected), torch.zeros((), dtype=dtype, device=device))
    # (an empty slot's or an outside particle's coordinates are never looked at)
    plane_positions = torch.where(inside.unsqueeze(-1), plane_positions, torch.zeros((), dtype=dtype, device=device))
    pixels = torch.tensor(resolution, dtype=dtype, device=device)
    plane_positions = torch.remainder(plane_positions, lengths[transverse]) / lengths[transverse] * pixels
    plane_positions = torch.cat([plane_positions, torch.zeros_like(plane_positions[..., :1])], dim=-1)
    plane = paint(plane_positions, mass, (*resolution, 1), order=ORDER_NAMES[order])[..., 0]
    if total is None:
        count = (weights if weights is not None else torch.ones_like(positions[..., 0]))
        if ids is not None:
            count = torch.where(ids >= 0, count, torch.zeros((), dtype=dtype, device=device))
        total = count.sum(-1)
        if distributed:
            total = mesh.all_reduce(total)
        total = total.view(-1, 1, 1)
    if distributed:
        plane = mesh.all_reduce(plane)
    if isinstance(total, torch.Tensor):
        if not bool((total.detach() > 0).all()):  # (the same on every rank: all-reduced)
            raise ValueError(f"{function}: the particles' total weight is {float(total.detach().min())} (no particle, "
                             "or all weights 0): there is no mean density to divide by; pass `total`")
    mean = total * (width / box[axis]) / (resolution[0] * resolution[1])
    return plane / mean - 1.0


def angular_grid(field_of_view, pixels, *, dtype=torch.float64, device=None) -> torch.Tensor:
    """Angles (radians) of the pixel centres of a flat-sky map covering ``field_of_view``
    degrees (one or two numbers) with ``pixels`` pixels (one or two integers):
    ``(P0, P1, 2)``, ``theta_j = (j + 1/2) field / P`` per axis."""
    function = "angular_grid"
    field = _pair(field_of_view, "field_of_view", function, float, limit=90.0)
    pixels = _pair(pixels, "pixels", function, int)
    axes = [(torch.arange(p, dtype=torch.float64) + 0.5) * math.radians(f) / p for f, p in zip(field, pixels)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)
    return grid.to(dtype=dtype, device=device)


def _source_distances(z_source, cosmology, device):
    z = torch.as_tensor(z_source, dtype=torch.float64, device=device)
    scalar = z.dim() == 0
    z = z.reshape(-1)
    if z.numel() == 0 or not bool(((z > 0) & torch.isfinite(z)).all()):
        raise ValueError(f"convergence_born: `z_source` must be positive finite redshifts, got {z_source!r}")
    return cosmology.comoving_distance(1.0 / (1.0 + z)), scalar


def convergence_born(
    planes: torch.Tensor,
    geometry: LensPlanes,
    box_size,
    angles: torch.Tensor,
    z_source,
    cosmology: Cosmology,
    *,
    order: str | int = "cic",
) -> torch.Tensor:
    """Born-approximation convergence at ``angles`` for sources at ``z_source``.

    Args:
        planes: ``(B, n, R0, R1)`` or ``(n, R0, R1)`` overdensity planes (from
            :func:`density_plane` or :func:`lightcone`), in the order of ``geometry``.
        geometry: the planes' :class:`LensPlanes`.
        box_size: the box (Mpc/h); the planes span its transverse extent.
        angles: ``(..., 2)`` flat-sky angles in radians along the two transverse axes
            (e.g. :func:`angular_grid`).
        z_source: a source redshift, or a 1-D sequence of them.
        cosmology: for ``Om``, ``chi_s`` and ``f_K``.
        order: the window the planes are interpolated with (``"cic"``: bilinear, the
            pixel values at the nodes ``j L / R``; periodic).

    Returns:
        ``(B, ..., n_z)`` (no ``n_z`` axis for one source redshift; no ``B`` for
        ``(n, R0, R1)`` planes), in the planes' dtype.
    """
    function = "convergence_born"
    cosmology = _cosmology(cosmology, function)
    if not isinstance(geometry, LensPlanes):
        raise ValueError(f"{function}: `geometry` must be a LensPlanes (from lens_planes), got {type(geometry).__name__}")
    _check_planes(geometry, function)
    box = as_box_size(box_size)
    order = ORDER_NAMES[order_number(order, function, "order")]
    if not isinstance(planes, torch.Tensor) or not planes.is_floating_point() or planes.dim() not in (3, 4) \
            or planes.shape[-3] != len(geometry.distances):
        raise ValueError(f"{function}: `planes` must be a (B, n, R0, R1) or (n, R0, R1) floating-point tensor with "
                         f"n = {len(geometry.distances)} planes, got {getattr(planes, 'shape', type(planes).__name__)}")
    if not isinstance(angles, torch.Tensor) or not angles.is_floating_point() or angles.dim() < 1 \
            or angles.shape[-1] != 2:
        raise ValueError(f"{function}: `angles` must be a (..., 2) floating-point tensor (radians), got "
                         f"{getattr(angles, 'shape', type(angles).__name__)}")
    unbatched = planes.dim() == 3
    if unbatched:
        planes = planes.unsqueeze(0)
    batch, _, r0, r1 = planes.shape
    dtype, device = planes.dtype, planes.device
    transverse = [i for i in range(3) if i != geometry.axis]
    # the distances and weights in float64 where the cosmology lives, then to the planes' device
    home = cosmology.device
    chi_s, scalar = _source_distances(z_source, cosmology, home)
    f_s = cosmology.transverse_distance(chi_s)
    chi = torch.tensor(geometry.distances, dtype=torch.float64, device=home)
    f_chi = cosmology.transverse_distance(chi)
    efficiency = cosmology.transverse_distance(torch.clamp(chi_s.unsqueeze(0) - chi.unsqueeze(1), min=0.0)) / f_s
    # (n,) prefactor of plane i: 3/2 Om (H0/c)^2 w_i f_K(chi_i) / a_i; (n, n_z) with the efficiency
    prefactor = (1.5 * cosmology.Omega_m / HUBBLE_DISTANCE**2
                 * torch.tensor(geometry.widths, dtype=torch.float64, device=home) * f_chi
                 / torch.tensor(geometry.scale_factors, dtype=torch.float64, device=home))
    kernel = (prefactor.unsqueeze(1) * efficiency).to(device=device, dtype=dtype)
    flat = angles.reshape(-1, 2).to(device=device, dtype=dtype)
    pixel = torch.tensor([box[transverse[0]] / r0, box[transverse[1]] / r1], dtype=torch.float64, device=home)
    # (n, 2) comoving transverse distance per radian, in pixels, for each plane
    scale = (f_chi.unsqueeze(1) / pixel).to(device=device, dtype=dtype)
    kappa = 0
    for i in range(planes.shape[1]):
        where = flat * scale[i]
        where = torch.cat([where, torch.zeros_like(where[:, :1])], dim=-1).expand(batch, -1, -1)
        values = readout(planes[:, i].unsqueeze(-1), where, order=order)  # (B, M)
        kappa = kappa + values.unsqueeze(-1) * kernel[i]
    kappa = kappa.reshape(batch, *angles.shape[:-1], chi_s.numel())
    if scalar:
        kappa = kappa.squeeze(-1)
    return kappa.squeeze(0) if unbatched else kappa


class AngularPowerSpectrum(NamedTuple):
    """Binned flat-sky angular power. ``ell``: ``(n_bins,)`` mean multipole of the modes in
    each bin; ``power``: ``(B, n_bins)`` or ``(n_bins,)`` ``C_ell`` (steradians); ``modes``:
    ``(n_bins,)`` number of Fourier modes. Empty bins are dropped."""

    ell: torch.Tensor
    power: torch.Tensor
    modes: torch.Tensor


def angular_power_spectrum(maps: torch.Tensor, field_of_view) -> AngularPowerSpectrum:
    """Flat-sky angular power spectrum of maps over ``field_of_view`` degrees (one or two
    numbers), their DFT taken as it is (the map treated as periodic, no apodisation: a
    map that is not, such as a Born map of part of the sky, leaks some power from its
    edges into the highest multipoles)::

        C_ell = Omega_pix^2 / Omega <|DFT kappa|^2>_ring,   Omega = field area (sr),

    over rings of width the fundamental ``ell_f = 2 pi / field`` (of the wider axis) up to
    the smaller Nyquist multipole, ``ell = 0`` excluded (a white map of pixel variance
    ``s^2`` has ``C_ell = s^2 Omega_pix``). ``maps``: ``(P0, P1)`` or ``(B, P0, P1)``;
    differentiable."""
    function = "angular_power_spectrum"
    if not isinstance(maps, torch.Tensor) or not maps.is_floating_point() or maps.dim() not in (2, 3):
        raise ValueError(f"{function}: `maps` must be a (P0, P1) or (B, P0, P1) floating-point tensor, got "
                         f"{getattr(maps, 'shape', type(maps).__name__)}")
    field = [math.radians(f) for f in _pair(field_of_view, "field_of_view", function, float, limit=90.0)]
    single = maps.dim() == 2
    batch = maps.unsqueeze(0) if single else maps
    p0, p1 = batch.shape[-2:]
    transform = torch.fft.fft2(batch.to(torch.float64))
    ell0 = 2 * math.pi * torch.fft.fftfreq(p0, d=field[0] / p0, dtype=torch.float64, device=maps.device)
    ell1 = 2 * math.pi * torch.fft.fftfreq(p1, d=field[1] / p1, dtype=torch.float64, device=maps.device)
    ell = torch.sqrt(ell0[:, None] ** 2 + ell1[None, :] ** 2)
    fundamental = 2 * math.pi / max(field)
    nyquist = min(math.pi * p0 / field[0], math.pi * p1 / field[1])
    n_bins = max(1, int(round(nyquist / fundamental)))
    index = torch.floor(ell / fundamental + 0.5).to(torch.int64).reshape(-1)
    keep = (index >= 1) & (index <= n_bins)
    index = torch.where(keep, index - 1, torch.full_like(index, n_bins))
    modes = torch.zeros(n_bins + 1, dtype=torch.float64, device=maps.device).index_add_(
        0, index, torch.ones_like(ell.reshape(-1)))
    ell_sum = torch.zeros_like(modes).index_add_(0, index, ell.reshape(-1))
    squared = (transform.real**2 + transform.imag**2).reshape(batch.shape[0], -1)
    power = torch.zeros(batch.shape[0], n_bins + 1, dtype=torch.float64, device=maps.device).index_add(
        1, index, squared)
    pixel = field[0] * field[1] / (p0 * p1)
    filled = modes[:n_bins] > 0
    power = (power[:, :n_bins] / modes[:n_bins].clamp(min=1) * pixel**2 / (field[0] * field[1]))[:, filled]
    power = power.to(maps.dtype)
    return AngularPowerSpectrum((ell_sum[:n_bins] / modes[:n_bins].clamp(min=1))[filled], power[0] if single else power,
                                modes[:n_bins][filled])


def limber_convergence_power(ell, z_source: float, cosmology: Cosmology, *, power=None, chi_max: float | None = None,
                             nodes: int = 512) -> torch.Tensor:
    """Limber's prediction of the convergence power for sources at ``z_source``::

        C_ell = int_0^chi_max dchi W(chi)^2 / f_K(chi)^2 P((ell + 1/2) / f_K(chi), a(chi)),
        W = 3/2 Om (H0/c)^2 f_K(chi) f_K(chi_s - chi) / (f_K(chi_s) a)

    with ``chi_max`` the source distance or less (e.g. the depth of a simulation's light
    cone). ``power``: the linear power at ``a = 1`` as :class:`~torchpm.Simulation` takes
    it (a built-in name, default Eisenstein & Hu, a table's path or a
    :class:`~torchpm.PowerTable`), grown as ``P(k, a) = D1(a)^2 P_lin(k)``; or a callable
    ``P(k, a)`` of the power at ``a`` itself (e.g. a non-linear model). A table covers a
    finite range of k: the integral then starts at the ``chi`` where
    ``(ell + 1/2) / f_K(chi)`` falls to the table's largest k (the nearer part needs k
    beyond it), and the table must reach down to ``(ell + 1/2) / f_K(chi_max)``.
    Gauss-Legendre in ``chi`` (``nodes`` points); float64, differentiable in the cosmology
    (second derivatives included)."""
    from .cosmology import PowerTable, growth_table, resolve_power

    function = "limber_convergence_power"
    cosmology = _cosmology(cosmology, function)
    ell = torch.as_tensor(ell, dtype=torch.float64, device=cosmology.device)
    if not bool(((ell > 0) & torch.isfinite(ell)).all()):
        raise ValueError(f"{function}: `ell` must be positive and finite")
    if isinstance(z_source, bool) or not isinstance(z_source, numbers.Real) or not (0 < z_source < 999):
        raise ValueError(f"{function}: `z_source` must be a redshift in (0, 999) (the growth table starts at "
                         f"a = 1e-3), got {z_source!r}")
    if chi_max is not None and (isinstance(chi_max, bool) or not isinstance(chi_max, numbers.Real)
                                or not (math.isfinite(chi_max) and chi_max > 0)):
        raise ValueError(f"{function}: `chi_max` must be None or a positive distance (Mpc/h), got {chi_max!r}")
    nodes = _positive_int(nodes, "nodes", function)
    chi_s = cosmology.comoving_distance(torch.tensor(1.0 / (1.0 + z_source), dtype=torch.float64))
    upper = chi_s if chi_max is None else torch.minimum(chi_s, torch.tensor(float(chi_max), dtype=torch.float64))
    table = None
    if power is None or isinstance(power, (str, os.PathLike, PowerTable)):
        linear = resolve_power("eisenstein_hu" if power is None else power)
        table = linear if isinstance(linear, PowerTable) else None
        growth = growth_table(cosmology)

        def evaluate(k, a):
            return growth.at(a).D1 ** 2 * linear(k, cosmology)
    elif callable(power):
        evaluate = power
    else:
        raise ValueError(f"{function}: `power` must be a built-in name, a table (path or PowerTable) or a callable "
                         f"P(k, a), got {type(power).__name__}")
    x, w = _gauss_legendre(nodes, cosmology.device)
    ells = ell.reshape(-1, 1)
    if table is None:
        lower = torch.zeros_like(ells)
    else:
        # from where (ell + 1/2) / f_K(chi) is the table's largest k (f_K(chi) = (ell + 1/2) / k_max)
        k_low, k_high = table.k_range
        with torch.no_grad():
            reach = cosmology.transverse_distance(upper.detach())
        needed = float(((ells + 0.5) / reach).min())
        if needed < k_low * (1 - 1e-9):
            raise ValueError(f"{function}: the power table {table.path!r} starts at k = {k_low:.4g} h/Mpc, but ell = "
                             f"{float(ell.min()):.4g} needs k = {needed:.4g} h/Mpc at chi = {float(reach):.6g} Mpc/h; "
                             "extend the table")
        # (flat-space inverse of f_K near the observer: exact when Omega_k = 0, and the
        # lower end of a curved one is where f_K and chi agree to (chi / D_H)^2 Omega_k)
        lower = torch.minimum((ells + 0.5) / k_high * (1 + 1e-12), upper.detach())
    chi = lower + 0.5 * (upper - lower) * (x + 1)  # (n_ell, nodes)
    a = cosmology.scale_factor_at_distance(chi)
    f_chi = cosmology.transverse_distance(chi)
    kernel = 1.5 * cosmology.Omega_m / HUBBLE_DISTANCE**2 * cosmology.transverse_distance(chi_s - chi) \
        / cosmology.transverse_distance(chi_s) / a  # W / f_K(chi)
    k = (ells + 0.5) / f_chi
    if table is not None:
        k = torch.minimum(k, torch.tensor(table.k_range[1], dtype=torch.float64, device=k.device))
    values = kernel**2 * evaluate(k, a)
    return (0.5 * (upper - lower) * (values * w).sum(-1, keepdim=True)).reshape(ell.shape)


def _shared_edges(planes: LensPlanes, length: float) -> list[tuple[float, float]]:
    """Each plane's slab ``(lo, hi)``, the edge two neighbouring planes share made one
    number (``d + w/2`` and the next ``d - w/2`` may differ in the last bit), so that at
    one time a particle on it is in exactly one of them."""
    edges = [[d - 0.5 * w, d + 0.5 * w] for d, w in zip(planes.distances, planes.widths)]
    by_distance = sorted(range(len(edges)), key=lambda i: edges[i][0])
    for near, far in zip(by_distance[:-1], by_distance[1:]):
        if abs(edges[near][1] - edges[far][0]) <= 1e-9 * length:
            edges[far][0] = edges[near][1]
    return [tuple(edge) for edge in edges]


def lightcone(sim, white_noise: torch.Tensor | None = None, *, planes: LensPlanes, resolution,
              linear_field: torch.Tensor | None = None, order: str | int = "cic", callback=None) -> torch.Tensor:
    """Run ``sim`` and take each lens plane's :func:`density_plane` at its scale factor.

    ``sim`` must step to every plane's scale factor (build it with
    ``steps=lightcone_steps(planes, a_start, n)``). The run goes from the farthest plane
    to the nearest in one :meth:`~torchpm.Simulation.trajectory`, painting each plane
    as the run passes its scale factor (no force is evaluated twice; each plane is
    painted from the state ``sim(..., until=a)`` returns, bit for bit on the CPU).
    Differentiable in the white noise (or linear field), the cosmology and a force
    correction, like a run; with ``adjoint=True`` each stretch between planes is one
    adjoint integration, handing its last force and that force's gradient to the
    next. On a process grid every rank passes its block (as to ``sim(...)``) and gets
    all the planes.

    Returns:
        ``(B, n, R0, R1)`` overdensity planes, nearest first (the order of ``planes``).
    """
    function = "lightcone"
    mesh = sim.force_mesh
    steps = sim.scale_factors
    error = None
    try:
        _check_planes(planes, function)
        depth = max(d + 0.5 * w for d, w in zip(planes.distances, planes.widths))
        if depth > sim.box_size[planes.axis] * (1 + 1e-12):
            raise ValueError(f"{function}: the planes reach {depth:.6g} Mpc/h along axis {planes.axis}, beyond the "
                             f"simulation's box ({sim.box_size[planes.axis]} Mpc/h)")
        missing = [a for a in planes.scale_factors if not any(abs(a - s) <= 1e-12 * s for s in steps)]
        if missing:
            raise ValueError(
                f"{function}: the simulation does not step to the planes' scale factors {missing[:4]}"
                f"{' ...' if len(missing) > 4 else ''}; build it with steps=torchpm.lensing.lightcone_steps(planes, "
                f"a_start, n)")
        resolution = _pair(resolution, "resolution", function, int)
        order = ORDER_NAMES[order_number(order, function, "order")]
    except ValueError as exc:
        if mesh.is_local:
            raise
        error = str(exc)
    if not mesh.is_local:
        # one rank's bad or different planes, resolution or window raises on every rank
        # (none is left waiting in the run)
        mesh.agree(function, [("`planes`", repr(planes) if error is None else None),
                              ("`resolution`", resolution if error is None else None),
                              ("`order`", order if error is None else None)], error)
    taker = _PlaneTaker(sim, planes, resolution, order)
    sim.trajectory(white_noise, linear_field=linear_field, at=taker.at, observe=taker.take, callback=callback,
                   return_mesh_units=True)
    return taker.planes()


class _PlaneTaker:
    """The lens planes of a run, painted as its trajectory passes their scale factors:
    :attr:`at` (the steps, increasing) for :meth:`~torchpm.Simulation.trajectory`,
    :meth:`take` as (or inside) its ``observe`` with mesh-unit states, :meth:`planes`
    at the end. Collective on a grid (every rank takes every plane)."""

    def __init__(self, sim, planes: LensPlanes, resolution, order: str):
        self.sim, self.lens, self.resolution, self.order = sim, planes, resolution, order
        self.cell = torch.tensor(sim.cell_size, dtype=sim.dtype, device=sim.device)
        self.edges = _shared_edges(planes, sim.box_size[planes.axis])
        # The planes farthest first (earliest), grouped by the step they are taken at.
        self.groups: dict[float, list[int]] = {}
        for i in sorted(range(len(planes.distances)), key=lambda i: planes.scale_factors[i]):
            a = next(s for s in sim.scale_factors if abs(s - planes.scale_factors[i]) <= 1e-12 * s)
            self.groups.setdefault(a, []).append(i)
        self.at = list(self.groups)
        self.taken = [None] * len(planes.distances)

    def take(self, state) -> None:
        """Paints the planes taken at ``state.a`` (a mesh-unit state; none elsewhere)."""
        sim, lens = self.sim, self.lens
        for i in self.groups.get(state.a, ()):
            self.taken[i] = density_plane(state.positions * self.cell, sim.box_size, lens.distances[i],
                                          lens.widths[i], self.resolution, axis=lens.axis, ids=state.ids,
                                          total=sim.n_total, order=self.order, mesh=sim.force_mesh,
                                          _edges=self.edges[i])

    def planes(self) -> torch.Tensor:
        """``(B, n, R0, R1)``, nearest first."""
        return torch.stack(self.taken, dim=1)
