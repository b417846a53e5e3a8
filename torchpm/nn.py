"""``torch.nn`` layers: CIC paint and readout, a differentiable power spectrum and
bispectrum, and learnable force corrections for ``Simulation(force_correction=...)``.

A force correction is a module ``(k, a) -> filter``: ``k`` is the ``|k|`` mesh of the
force mesh's rfft block in h/Mpc (shape broadcastable like the block), ``a`` a 0-d
tensor; the returned real filter multiplies the gravitational potential in Fourier
space (:func:`torchpm.pm.compute_forces`). Both corrections here start as the
identity filter (exactly 1.0), so an untrained model reproduces the plain PM run bit
for bit.

All layers follow ``torch.nn`` conventions: ``.to(device, dtype)`` moves parameters and
buffers, ``state_dict`` holds the learned weights only, ``extra_repr`` prints the
settings. They run on cpu and cuda in float32 and float64.

``torch.compile``: every layer here but :class:`BispectrumEstimator` compiles with
``fullgraph=True`` (no graph breaks), forward and backward (tests/test_nn.py checks
each against eager; the bispectrum's forward checks its field and Q's denominator on
the host, loops over the shells in Python and was not tried under the compiler):
:class:`NeuralSplineCorrection`, :class:`PGDCorrection`, :class:`PowerSpectrum` and
:class:`CorrelationFunction` are pure torch ops; :class:`CICPaint` and :class:`CICReadout` call the
``torch.ops.torchpm`` custom ops, whose fake kernels and registered backwards
(themselves custom ops) let AOTAutograd trace both passes, and inductor keeps
them as opaque calls. What does *not* compile as one graph is a whole
:class:`torchpm.Simulation`: its set-up branches on tensor values (the growth
table's start, the finiteness checks that raise errors, the migration's
capacity checks on a process grid) and ``adjoint=True`` runs its own backward
loop in an ``autograd.Function`` with Python-side state. ``torch.compile(sim)``
without ``fullgraph`` runs with graph breaks around those and gives the eager
numbers, but compiling took 2 minutes for a 4^3-particle, 2-step run on the
2-core CI machine, and a run's time is in the FFTs and the mass-assignment
kernels, which compiling leaves as they are; compile the network around the
simulation instead.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch
from torch import nn

from ._transforms import is_transformed, outside_transforms
from .analysis import (_bin_edges, _bins_key, _ells_argument, _lag_edges, _minimum_image_lags, _multipole_weights,
                       _n_particles_argument, _shell_index, _window_argument, aliased_window_power,
                       line_of_sight_axis)
from .bispectrum import Bispectrum, _settings, _Tables
from .config import SettingError, as_bool, as_float
from .fourier import window_of
from .distributed import PencilDecomposition
from .mesh import LocalMesh, as_box_size, as_shape
from .ops import cic_paint, cic_readout

__all__ = [
    "CICPaint",
    "CICReadout",
    "PowerSpectrum",
    "CorrelationFunction",
    "BispectrumEstimator",
    "NeuralSplineCorrection",
    "PGDCorrection",
    "save_weights",
    "load_weights",
]


def _layer_mesh(layer: str, mesh, shape=None, error=None):
    """The :class:`~torchpm.distributed.PencilDecomposition` a layer's ``mesh`` names, or
    None for one device (``None``, a :class:`~torchpm.LocalMesh` or a 1 x 1 grid).
    ``error``: the layer's own argument error, raised on every rank of a grid."""
    if mesh is None:
        return None
    _check_mesh_type(layer, mesh)
    if shape is not None:
        mesh.agree(layer, [("`shape`", shape)],
                   error or _mesh_shape_error(layer, mesh, shape, "the particles are painted on"))
    return None if mesh.is_local else mesh


def _layer_shape(layer: str, shape, mesh):
    """``(shape, error)``: a layer's ``shape`` argument; on a grid a bad one is the error the
    construction's agreement raises on every rank (the mesh's shape standing in meanwhile)."""
    try:
        return as_shape(shape, "shape"), None
    except (TypeError, ValueError) as exc:
        if not isinstance(mesh, PencilDecomposition) or mesh.is_local:
            raise
        return tuple(mesh.global_shape), f"{layer}: {exc}"


def _check_mesh_type(layer: str, mesh) -> None:
    if not isinstance(mesh, PencilDecomposition):
        raise TypeError(
            f"{layer}: `mesh` must be None or a torchpm.distributed.PencilDecomposition "
            f"(e.g. sim.force_mesh) or a torchpm.LocalMesh, got {type(mesh).__name__}"
        )


def _mesh_shape_error(layer: str, mesh, shape, what: str) -> str | None:
    if tuple(mesh.global_shape) == shape:
        return None
    return (
        f"{layer}: `mesh` has the global shape {tuple(mesh.global_shape)} but `shape` is "
        f"{shape}; pass the shape of the mesh {what} (mesh.global_shape)"
    )


def _layer_field_error(layer, field, name, local_shape, shape, mesh, batch=None):
    """What is wrong with a layer's ``field`` (None if nothing); ``batch``: the size of dim 0
    it must have (``other``'s, the field's)."""
    if not isinstance(field, torch.Tensor) or field.dim() != 4 or tuple(field.shape[1:]) != local_shape \
            or (batch is not None and field.shape[0] != batch):
        block = "" if mesh is None else f" (this rank's block of the {shape} mesh)"
        first = "B" if batch is None else f"B = {batch}, as `field`"
        return (
            f"{layer}: `{name}` must be a real tensor of shape ({first}, {', '.join(map(str, local_shape))})"
            f"{block}, got {tuple(field.shape) if isinstance(field, torch.Tensor) else type(field).__name__}"
        )
    if field.is_complex() or not field.is_floating_point():
        return f"{layer}: `{name}` must be real floating point, got {field.dtype}"
    if field.dtype == torch.bfloat16 or (field.dtype == torch.float16 and field.device.type == "cpu"):
        # (torch's FFTs: float32 and float64 everywhere, float16 on CUDA for powers of 2)
        return f"{layer}: `{name}` must be float32 or float64, got {field.dtype} on {field.device.type}"
    if field.shape[0] == 0:
        return f"{layer}: `{name}` holds no field (batch size 0)"
    return None


def _layer_geometry(layer, shape, box_size, dtype, mesh):
    """``(shape, box_size, error)`` of a layer's arguments: a bad one is the error that
    :meth:`PencilDecomposition.agree` raises on every rank of a grid (with the mesh's own
    shape standing in meanwhile); without a mesh it is raised at once."""
    try:
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and not dtype.is_complex):
            raise TypeError(f"`dtype` must be a real floating-point torch.dtype, got {dtype!r}")
        return as_shape(shape, "shape"), as_box_size(box_size), None
    except (TypeError, ValueError) as exc:
        if mesh is None:
            raise type(exc)(f"{layer}: {exc}") from None
        return tuple(getattr(mesh, "global_shape", (1, 1, 1))), (1.0, 1.0, 1.0), f"{layer}: {exc}"


def _layer_shells(x, weight, edges, mesh):
    """A layer's shells, made once: ``(index, counts, mean x)`` of the entries ``x`` (each
    standing for ``weight`` of them) in the shells ``edges``, the counts and sums all-reduced
    over the grid (the same shells on every rank), the shells empty everywhere dropped and
    the rest renumbered ``0..n-1``; an entry in no shell (or at ``x = 0``) gets ``n``, a slot
    the forward pass drops, so it needs no boolean indexing."""
    index, valid = _shell_index(x, edges)
    n_bins = edges.numel() - 1
    weight = weight * valid
    sums = torch.zeros(2, n_bins + 1, dtype=torch.float64)
    sums[0].index_add_(0, index, weight)
    sums[1].index_add_(0, index, weight * x)
    counts, x_sums = mesh.all_reduce(sums[:, :n_bins].contiguous())
    keep = counts > 0
    n = int(keep.sum())
    renumber = torch.full((n_bins + 1,), n, dtype=torch.long)
    renumber[:n_bins][keep] = torch.arange(n)
    return renumber[index], counts[keep], x_sums[keep] / counts[keep]


def _shell_sums(values, index, n_bins, mesh):
    """The sums of ``values`` (``(..., entries)``) over the shells ``index`` (``n_bins`` for an
    entry in none), all-reduced over a process grid: every rank gets the global sums (the
    reduction and autograd convention of :func:`~torchpm.analysis.cross_power`)."""
    sums = values.new_zeros(*values.shape[:-1], n_bins + 1).index_add(-1, index, values)[..., :n_bins]
    return sums if mesh is None else mesh.all_reduce(sums)


class CICPaint(nn.Module):
    """Cloud-in-cell paint onto a periodic mesh (:func:`torchpm.cic_paint`).

    Args:
        shape: mesh cells per side (int) or ``(nx, ny, nz)``: the global mesh.
        mesh: None (the whole mesh on this device) or a
            :class:`~torchpm.distributed.PencilDecomposition` of global shape ``shape``
            (e.g. ``sim.force_mesh``). On a process grid each rank passes the particles
            it owns (their wrapped position lies in its block: a simulation state's
            particles are) and gets its block ``(B, *mesh.local_real_shape)`` of the
            global painted mesh (:meth:`~torchpm.distributed.PencilDecomposition.paint`:
            the stencil's halo is added into the neighbours; collective, every rank calls
            it, and builds the layer: construction checks that the ranks agree on
            ``shape``). A particle this rank does not own, or a non-finite one, raises on
            every rank. Differentiable: each rank's particles receive their gradient from
            the blocks' cotangents of every rank.

    ``forward(positions, weights=None, ids=None)``: positions ``(B, N, 3)`` in mesh-cell
    units (a state's from ``return_mesh_units=True``, or its Mpc/h positions divided by the
    cell size), weights ``(B, N)`` / ``(B, N, C)`` or None (unit mass), ``ids`` ``(B, N)``
    or None: slots with id -1 (the empty slots a state holds on a grid) get no mass.
    Returns ``(B, nx, ny, nz)`` (or ``(B, C, nx, ny, nz)``), this rank's block of it on a
    grid.
    """

    def __init__(self, shape: int | Sequence[int], *, mesh: PencilDecomposition | None = None):
        super().__init__()
        self.shape, error = _layer_shape("CICPaint", shape, mesh)
        self._mesh = _layer_mesh("CICPaint", mesh, self.shape, error)

    def forward(self, positions: torch.Tensor, weights: torch.Tensor | None = None,
                ids: torch.Tensor | None = None) -> torch.Tensor:
        error = None
        if ids is not None:
            try:
                weights = _weights_of_ids(positions, weights, ids)
            except ValueError as exc:
                if self._mesh is None or self._mesh.is_local:
                    raise
                # on a grid: raised inside the paint's agreement, on every rank together
                error = exc
        if self._mesh is not None:
            return self._mesh.paint(positions, weights, order="cic", _caller_error=error)
        return cic_paint(positions, weights, self.shape, periodic=True)

    def extra_repr(self) -> str:
        grid = "" if self._mesh is None else f", grid={self._mesh.grid_shape}"
        return f"shape={self.shape}{grid}"


def _weights_of_ids(positions, weights, ids):
    """``weights`` (None: unit mass) with the empty slots (id -1) of ``ids`` given no mass."""
    expected = tuple(positions.shape[:2]) if isinstance(positions, torch.Tensor) else None
    if (not isinstance(ids, torch.Tensor) or tuple(ids.shape) != expected or ids.dtype == torch.bool
            or ids.is_floating_point() or ids.is_complex()):
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"CICPaint: `ids` must be an integer (B, N) = {expected} tensor (-1 marks an empty slot), "
                         f"got {got}")
    if weights is not None and (not isinstance(weights, torch.Tensor) or weights.dim() not in (2, 3)
                                or tuple(weights.shape[:2]) != expected):
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"CICPaint: `weights` must be (B, N) or (B, N, C) with (B, N) = {expected}, got {got}")
    mass = (ids >= 0).to(positions.dtype)
    return mass if weights is None else weights * (mass if weights.dim() == 2 else mass.unsqueeze(-1))


class CICReadout(nn.Module):
    """Cloud-in-cell readout of a periodic mesh at particle positions (:func:`torchpm.cic_readout`).

    Args:
        mesh: None (the whole mesh on this device) or a
            :class:`~torchpm.distributed.PencilDecomposition` (e.g. ``sim.force_mesh``).
            On a process grid each rank passes its block ``(B, [C,] *mesh.local_real_shape)``
            and the particles it owns; the block's halo is filled from the neighbours
            first (:meth:`~torchpm.distributed.PencilDecomposition.readout`; collective,
            every rank calls it). A particle this rank does not own raises on every rank.

    ``forward(mesh, positions)``: mesh ``(B, nx, ny, nz)`` or ``(B, C, nx, ny, nz)``,
    positions ``(B, N, 3)`` in mesh-cell units; returns ``(B, N)`` or ``(B, N, C)``.
    """

    def __init__(self, *, mesh: PencilDecomposition | None = None):
        super().__init__()
        self._mesh = _layer_mesh("CICReadout", mesh)

    def forward(self, mesh: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._mesh is not None:
            return self._mesh.readout(mesh, positions, order="cic")
        return cic_readout(mesh, positions, periodic=True)

    def extra_repr(self) -> str:
        return "" if self._mesh is None else f"grid={self._mesh.grid_shape}"


class PowerSpectrum(nn.Module):
    """Differentiable binned (cross) power spectrum of fields on a fixed mesh.

    The estimator of :func:`torchpm.analysis.power_spectrum`:
    ``P(k) = V/N^2 <Re(DFT a conj(DFT b))>_shell`` with the k = 0 mode excluded, the rfft
    half-spectrum weighted by the number of full-DFT modes each entry stands for.
    The shell of every mode is computed once, at construction, so the forward pass
    is an FFT, a product and one ``index_add`` (no data-dependent shapes: it compiles).

    Args:
        shape: mesh cells per side (int) or ``(nx, ny, nz)``: the global mesh.
        box_size: box side(s) in Mpc/h.
        bins: None (shells of width ``2 pi / L`` centred on its multiples, up to the
            smallest Nyquist frequency), a number of equal-width bins up to the
            largest |k|, or increasing bin edges in h/Mpc. Empty bins are dropped.
        compensate_cic: divide each field by the CIC window ``prod sinc^2(w/2pi)``.
        ells: None (the power spectrum), or even multipole orders such as ``(0, 2, 4)``:
            the Legendre multipoles about the line of sight ``axis`` of
            :func:`torchpm.analysis.power_multipoles` (redshift space), ``(B, len(ells),
            n_bins)``.
        axis: the line of sight of ``ells``: 0, 1, 2 or ``"x"``, ``"y"``, ``"z"``.
        dtype: of the ``k`` / ``modes`` buffers and the per-mode weights; the FFTs run in
            the field's own dtype (a float64 field in a float32 layer is weighted and
            summed with float32-rounded weights).
        mesh: the mesh the fields live on, of global shape ``shape``: None (the whole
            mesh on this device) or a :class:`~torchpm.distributed.PencilDecomposition`
            (e.g. ``sim.force_mesh``). On a process grid each rank passes its block
            ``(B, *mesh.local_real_shape)``; construction then precomputes the shells of
            the rank's Fourier block and all-reduces their mode counts (collective: every
            rank builds the layer with the same arguments), and the forward pass
            all-reduces the shell sums as :func:`~torchpm.analysis.cross_power` does, so
            every rank gets the global ``(B, n_bins)`` spectrum (and the same ``k`` and
            ``modes``). Differentiable there with the same convention: every rank computes
            the same loss from it and calls backward, and each rank's field receives its
            block of the global gradient.

    ``forward(field, other=None)``: ``(B, nx, ny, nz)`` real fields (this rank's
    block on a grid); returns ``(B, n_bins)`` power in (Mpc/h)^3 (the cross power
    with ``other`` when given), or ``(B, len(ells), n_bins)`` multipoles. Attributes ``k`` (mean |k| of each bin, h/Mpc) and
    ``modes`` are buffers.
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        box_size: float | Sequence[float],
        *,
        bins=None,
        compensate_cic: bool = False,
        ells: Sequence[int] | None = None,
        axis: int | str = 2,
        dtype: torch.dtype = torch.float32,
        device=None,
        mesh: PencilDecomposition | None = None,
    ):
        super().__init__()
        self.shape, self.box_size, error = _layer_geometry("PowerSpectrum", shape, box_size, dtype, mesh)
        try:
            self.compensate_cic = as_bool("compensate_cic", compensate_cic)  # ("no" is not False)
        except ValueError as exc:  # (a SettingError: a ValueError and a TypeError, as the functions raise)
            self.compensate_cic, error = False, error or type(exc)(f"PowerSpectrum: {exc}")
        try:
            self.ells = None if ells is None else _ells_argument(ells, "PowerSpectrum")
            self.axis = line_of_sight_axis(axis, "PowerSpectrum")
        except (TypeError, ValueError) as exc:  # (raised below with the other ranks' errors)
            self.ells, self.axis, error = None, -1, error or str(exc)
        if mesh is None:
            mesh = LocalMesh(self.shape)
        _check_mesh_type("PowerSpectrum", mesh)
        error = error or _mesh_shape_error("PowerSpectrum", mesh, self.shape, "the fields live on")
        # The shells' mode counts are all-reduced below, as many as there are bins: the
        # ranks agree on what sets them first (one rank's error raises on every rank).
        mesh.agree("PowerSpectrum", [("`shape`", self.shape), ("`box_size`", self.box_size),
                                     ("`bins`", _bins_key(bins)), ("`compensate_cic`", self.compensate_cic),
                                     ("`ells`", self.ells), ("`axis`", self.axis)], error)
        # On one device the forward pass calls torch.fft directly, as before.
        self._mesh = None if mesh.is_local else mesh
        w = mesh.wavevectors(dtype=torch.float64)
        k_axes = [wi * n / b for wi, n, b in zip(w, self.shape, self.box_size)]
        k = torch.sqrt(sum(ki**2 for ki in k_axes)).expand(*mesh.local_fourier_shape).reshape(-1)
        weight = mesh.hermitian_weights(dtype=torch.float64).expand(*mesh.local_fourier_shape).reshape(-1)
        try:
            edges = _bin_edges(k_axes, mesh, self.box_size, bins, None)  # (the same on every rank)
        except ValueError as exc:
            raise ValueError(f"PowerSpectrum: {exc}") from None
        index, modes, k_mean = _layer_shells(k, weight, edges, mesh)
        scale = weight * (math.prod(self.box_size) / mesh.size**2)
        if self.compensate_cic:
            scale = scale / (window_of(w, "cic") ** 2).expand(*mesh.local_fourier_shape).reshape(-1)
        scale = scale / torch.cat([modes, torch.ones(1, dtype=torch.float64)])[index]
        if self.ells is not None:
            k_axis = k_axes[self.axis].expand(*mesh.local_fourier_shape).reshape(-1)
            scale = scale * _multipole_weights(self.ells, k_axis, k)
        self.n_bins = len(modes)
        self._local_shape = tuple(mesh.local_real_shape)
        self.register_buffer("k", k_mean.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("modes", modes.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("_bin_index", index.to(device=device), persistent=False)
        self.register_buffer("_mode_scale", scale.to(dtype=dtype, device=device), persistent=False)

    def _field_error(self, field, name):
        """What is wrong with ``field`` (None if nothing)."""
        return _layer_field_error("PowerSpectrum", field, name, self._local_shape, self.shape, self._mesh)

    def _rfftn(self, field):
        if self._mesh is None:
            return torch.fft.rfftn(field, dim=(-3, -2, -1))
        return self._mesh.rfftn(field)

    def forward(self, field: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        error = self._field_error(field, "field") or (
            None if other is None else _layer_field_error("PowerSpectrum", other, "other", self._local_shape,
                                                          self.shape, self._mesh, batch=field.shape[0]))
        if self._mesh is not None:
            # A rank with a bad field raises on every rank, not leaving the others in the FFT;
            # so does one that passes `other` where the others do not (one more FFT).
            self._mesh.agree("torchpm.nn.PowerSpectrum", [("`other`", "None" if other is None else "a field")], error)
        elif error:
            raise ValueError(error)
        field_k = self._rfftn(field).reshape(field.shape[0], -1)
        if other is None:
            product = field_k.real**2 + field_k.imag**2
        else:
            other_k = self._rfftn(other).reshape(field.shape[0], -1)
            product = field_k.real * other_k.real + field_k.imag * other_k.imag
        if self.ells is not None:  # (B, len(ells), modes)
            product = product.unsqueeze(1)
        return _shell_sums(product * self._mode_scale.to(product.dtype), self._bin_index, self.n_bins, self._mesh)

    def extra_repr(self) -> str:
        grid = "" if self._mesh is None else f", grid={self._mesh.grid_shape}"
        return (
            f"shape={self.shape}, box_size={self.box_size}, n_bins={self.n_bins}, "
            f"compensate_cic={self.compensate_cic}"
            f"{'' if self.ells is None else f', ells={self.ells}, axis={self.axis}'}{grid}"
        )


class CorrelationFunction(nn.Module):
    """Differentiable binned two-point correlation function of fields on a fixed mesh.

    The estimator of :func:`torchpm.analysis.correlation_function`: ``xi(r) = <a(x) b(x +
    r)>`` over every cell and every separation of the periodic mesh in a shell of ``|r|``
    (the means removed, zero separation left out), computed as the inverse DFT of
    ``conj(DFT a) DFT b / N^2``. The shell of every separation, the window's filter and the
    self-pairs' noise are computed once, at construction, so the forward pass is two FFTs
    (three for a cross-correlation), a product and one ``index_add`` (no data-dependent
    shapes: it compiles). Its buffers: the shell of each separation, 8 bytes per cell of
    this rank's block; with ``ells`` ``len(ells)`` values of ``dtype`` per cell; 1 byte per
    Fourier entry (the ``k = 0`` mode), and one value per entry more with ``window`` and with
    ``n_particles``. Buffers in float32 round the result to float32 whatever the field's dtype.

    Args:
        shape: mesh cells per side (int) or ``(nx, ny, nz)``: the global mesh.
        box_size: box side(s) in Mpc/h.
        bins: None, a number of shells, or shell edges in Mpc/h, as in
            :func:`~torchpm.analysis.correlation_function`. Empty shells are dropped.
        ells: None, or even multipole orders about the line of sight ``axis``:
            ``(B, len(ells), n_bins)``.
        axis: the line of sight of ``ells``: 0, 1, 2 or ``"x"``, ``"y"``, ``"z"``.
        window: divide the power by this mass-assignment window squared first (``"ngp"``,
            ``"cic"``, ``"tsc"``, ``"pcs"``), or None.
        n_particles: subtract the Poisson self-pairs of this many equal-mass particles
            painted with ``window`` (required with it), without interlacing; for the
            auto-correlation only (``forward`` then refuses ``other``).
        dtype, device: of the buffers (the computation runs in the field's dtype).
        mesh: None (the whole mesh on this device) or a
            :class:`~torchpm.distributed.PencilDecomposition` of global shape ``shape``
            (e.g. ``sim.force_mesh``): each rank passes its block, construction is
            collective (the shells' counts are all-reduced), and every rank gets the
            global ``xi``, differentiable with :class:`PowerSpectrum`'s convention.

    ``forward(field, other=None)``: ``(B, *local block)`` real fields; returns ``(B,
    n_bins)`` (or ``(B, len(ells), n_bins)``). Buffers ``r`` (mean separation of each
    shell, Mpc/h) and ``lags`` (separations per shell).
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        box_size: float | Sequence[float],
        *,
        bins=None,
        ells: Sequence[int] | None = None,
        axis: int | str = 2,
        window: str | None = None,
        n_particles: int | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
        mesh: PencilDecomposition | None = None,
    ):
        super().__init__()
        self.shape, self.box_size, error = _layer_geometry("CorrelationFunction", shape, box_size, dtype, mesh)
        try:
            self.axis = line_of_sight_axis(axis, "CorrelationFunction")
            self.ells = None if ells is None else _ells_argument(ells, "CorrelationFunction")
            self.window = _window_argument(window, False, "CorrelationFunction")
        except (TypeError, ValueError) as exc:  # (raised below with the other ranks' errors)
            self.ells, self.axis, self.window, error = None, -1, None, error or str(exc)
        error = error or _n_particles_argument(n_particles, self.window, False)
        self.n_particles = None if n_particles is None or error else int(n_particles)
        if mesh is None:
            mesh = LocalMesh(self.shape)
        _check_mesh_type("CorrelationFunction", mesh)
        error = error or _mesh_shape_error("CorrelationFunction", mesh, self.shape, "the fields live on")
        mesh.agree("CorrelationFunction", [("`shape`", self.shape), ("`box_size`", self.box_size),
                                           ("`bins`", _bins_key(bins)), ("`ells`", self.ells), ("`axis`", self.axis),
                                           ("`window`", self.window),
                                           ("`n_particles`", None if self.n_particles is None else
                                            repr(self.n_particles))], error)
        self._mesh = None if mesh.is_local else mesh
        try:
            edges = _lag_edges(mesh, self.box_size, bins, None)  # (the same on every rank)
        except ValueError as exc:
            raise ValueError(f"CorrelationFunction: {exc}") from None
        rx, ry, rz = _minimum_image_lags(mesh, self.box_size, None)
        r = torch.sqrt(rx**2 + ry**2 + rz**2).reshape(-1)
        index, lags, r_mean = _layer_shells(r, torch.ones_like(r), edges, mesh)
        # xi = irfftn(filtered product) / N, averaged over the shell's separations: a divisor
        # per shell, or with ells the Legendre weights per separation too.
        divisor = torch.cat([lags, torch.ones(1, dtype=torch.float64)]) * mesh.size
        scale = None
        if self.ells is not None:
            along = (rx, ry, rz)[self.axis].expand(*mesh.local_real_shape).reshape(-1)
            scale = _multipole_weights(self.ells, along, r) / divisor[index]
        w = mesh.wavevectors(dtype=torch.float64)
        fourier_shape = mesh.local_fourier_shape
        k_zero = ((w[0] == 0) & (w[1] == 0) & (w[2] == 0)).expand(*fourier_shape)  # (the means: dropped)
        noise = filter_ = None
        if self.n_particles is not None:
            noise = (aliased_window_power(w, self.window) * (mesh.size**2 / self.n_particles)).expand(*fourier_shape)
        if self.window is not None:
            filter_ = (1.0 / window_of(w, self.window) ** 2).expand(*fourier_shape)
        self.n_bins = len(lags)
        self._local_shape = tuple(mesh.local_real_shape)

        def buffer(name, value, kind=dtype):
            self.register_buffer(name, None if value is None else value.contiguous().to(dtype=kind, device=device),
                                 persistent=False)

        buffer("r", r_mean)
        buffer("lags", lags)
        # (int64: index_add with int32 indices is about 40x slower on the CPU in torch 2.13)
        buffer("_lag_index", index, torch.int64)  # 8 bytes per cell
        buffer("_divisor", divisor[:-1], torch.float64)  # (exact counts, cast to the field's dtype)
        buffer("_lag_scale", scale)  # with ells: len(ells) values per cell
        buffer("_k_zero", k_zero, torch.bool)  # 1 byte per Fourier entry
        buffer("_filter", filter_)  # with a window: one value per Fourier entry
        buffer("_noise", noise)  # with n_particles: one value per Fourier entry

    def forward(self, field: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        error = _layer_field_error("CorrelationFunction", field, "field", self._local_shape, self.shape, self._mesh) \
            or (None if other is None else
                _layer_field_error("CorrelationFunction", other, "other", self._local_shape, self.shape, self._mesh,
                                   batch=field.shape[0]))
        if error is None and other is not None and self.n_particles is not None:
            error = ("CorrelationFunction: `other` with `n_particles`: the Poisson self-pairs are those of one "
                     "particle set's auto-correlation; build the layer without n_particles for a cross-correlation")
        if self._mesh is not None:
            self._mesh.agree("torchpm.nn.CorrelationFunction", [("`other`", "None" if other is None else "a field")],
                             error)
        elif error:
            raise ValueError(error)
        rfftn = (lambda f: torch.fft.rfftn(f, dim=(-3, -2, -1))) if self._mesh is None else self._mesh.rfftn
        field_k = rfftn(field)
        other_k = field_k if other is None else rfftn(other)
        real = field_k.real.dtype
        # conj(a) b, less the self-pairs' noise, the window divided out, k = 0 dropped
        if other is None:  # (|a|^2: no imaginary part to compute)
            power = field_k.real**2 + field_k.imag**2
            product = torch.complex(power, torch.zeros_like(power))
        else:
            product = torch.complex(field_k.real * other_k.real + field_k.imag * other_k.imag,
                                    field_k.real * other_k.imag - field_k.imag * other_k.real)
        if self._noise is not None:
            product = product - self._noise.to(real)
        if self._filter is not None:
            product = product * self._filter.to(real)
        product = product.masked_fill(self._k_zero, 0)
        if self._mesh is None:
            xi = torch.fft.irfftn(product, s=self.shape, dim=(-3, -2, -1))
        else:
            xi = self._mesh.irfftn(product)
        values = xi.reshape(field.shape[0], -1)
        if self.ells is not None:  # (B, len(ells), cells)
            values = values.unsqueeze(1) * self._lag_scale.to(values.dtype)
            return _shell_sums(values, self._lag_index, self.n_bins, self._mesh)
        return _shell_sums(values, self._lag_index, self.n_bins, self._mesh) / self._divisor.to(values.dtype)

    def extra_repr(self) -> str:
        grid = "" if self._mesh is None else f", grid={self._mesh.grid_shape}"
        return (
            f"shape={self.shape}, box_size={self.box_size}, n_bins={self.n_bins}, window={self.window!r}"
            f"{'' if self.n_particles is None else f', n_particles={self.n_particles:g}'}"
            f"{'' if self.ells is None else f', ells={self.ells}, axis={self.axis}'}{grid}"
        )


class BispectrumEstimator(nn.Module):
    """The bispectrum of fields on a fixed mesh, prepared once for a training loop:
    :func:`torchpm.bispectrum.bispectrum`'s estimator and results, without its set-up
    at every call.

    Construction does everything that does not depend on the field: the shells and the
    configurations (the default ones without a closed triangle left out), the shell of
    every Fourier entry and the triangle plan, and the triangle counts and mean side
    lengths (the inverse FFTs of each shell's indicator, about two thirds of a call of
    the function at 64^3). The forward pass transforms the field and computes what
    depends on it: the shells' power, the triangle sums (whose backward recomputes the
    shell fields), B, Q and the shot noise. The function builds the same tables at
    every call and runs the same code, so the two agree to rounding.

    Args:
        shape: mesh cells per side (int) or ``(nx, ny, nz)``: the global mesh.
        box_size, bins, triangles, window, compensate_cic, shot_noise, n_particles: as
            for :func:`~torchpm.bispectrum.bispectrum` (the default ``bins`` and
            configurations are the same).
        dtype: of the fields the layer takes and of its results and ``k`` / ``edges``
            buffers (``.to(dtype)`` changes it). The measurement itself runs in float64
            whatever the dtype, as the function's does: the buffers it uses are
            integers (frequencies, shells, counts), which a ``.to(dtype)`` leaves exact.
            ``k`` and ``edges`` (reported, never computed with) keep the rounding of the
            narrowest dtype they passed through: a layer built in float32 and moved to
            float64 reports them to float32 precision (build it in float64 for more).
        device: where the buffers live and the fields must be (``.to(device)`` moves
            them).
        mesh: None (the whole mesh on this device), a :class:`~torchpm.LocalMesh` or a
            :class:`~torchpm.distributed.PencilDecomposition` of global shape ``shape``
            (e.g. ``sim.force_mesh``). On a process grid construction is collective:
            every rank builds the layer with the same arguments (checked first: one
            rank's bad or different argument raises on every rank), and the mode and
            triangle counts are all-reduced. So is the forward pass: each rank passes
            its block ``(B, *mesh.local_real_shape)`` (the same ``B`` on every rank) and
            every rank gets the global result, differentiable with the convention of
            :class:`PowerSpectrum` (every rank computes the same loss from it and calls
            backward; each rank's block receives its part of the gradient).

    ``forward(field)``: ``(B, nx, ny, nz)`` or ``(nx, ny, nz)`` real field (this rank's
    block on a grid) of the layer's dtype, on its device, finite; a field that does not
    match raises a ValueError saying what the layer was built for (on every rank of a
    grid). Returns a :class:`~torchpm.bispectrum.Bispectrum`: ``bispectrum``,
    ``reduced`` and ``power`` computed from the field, in the layer's dtype (unbatched
    for a 3-d field); ``k``, ``triangles``, ``shells`` and ``edges`` are the layer's
    buffers (also its attributes). Differentiable in the field, also twice, and under
    ``torch.func.grad``. The buffers are non-persistent: ``state_dict`` is empty.

    Memory: the shells' indices (int64, half a float64 field) stay between calls; a
    call needs what the function's bispectrum part does (one float64 field per shell
    and batch member, two in the backward), not the counts' two fields per shell.
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        box_size: float | Sequence[float],
        *,
        bins=None,
        triangles=None,
        window: str | None = None,
        compensate_cic: bool = False,
        shot_noise: float | None = None,
        n_particles: int | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
        mesh: PencilDecomposition | None = None,
    ):
        super().__init__()
        name = "BispectrumEstimator"
        self.shape, shape_error = _layer_shape(name, shape, mesh)
        if mesh is None:
            mesh = LocalMesh(self.shape)
        _check_mesh_type(name, mesh)
        box, edges, configurations, window, noise, key, error = _settings(
            name, self.shape, box_size, bins, triangles, compensate_cic, window, shot_noise, n_particles)
        error = shape_error or error
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            error = error or f"`dtype` must be a real floating-point torch.dtype (e.g. torch.float32), got {dtype!r}"
        error = error or _mesh_shape_error(name, mesh, self.shape, "the fields live on")
        if error and not str(error).startswith(name):  # (the exception's type kept: TypeError or ValueError)
            error = type(error)(f"{name}: {error}") if isinstance(error, BaseException) else f"{name}: {error}"
        # The counts are all-reduced, as many as there are configurations: the ranks agree
        # on what sets them first (one rank's error raises on every rank).
        mesh.agree(name, [("`shape`", self.shape), ("`box_size`", box), ("`bins`", _bins_key(bins)),
                          ("`window`", window), ("the shot noise subtracted", noise), ("`triangles`", key)], error)
        self.box_size = box
        self._mesh = mesh
        device = torch.empty(0, device=device).device
        self._tables = _Tables(name, mesh, box, edges, configurations, window, noise, device).to(dtype=dtype)

    @property
    def k(self) -> torch.Tensor:
        """``(n, 3)``: the mean ``|k|`` (h/Mpc) of each side over its configuration's triangles."""
        return self._tables.k

    @property
    def triangles(self) -> torch.Tensor:
        """``(n,)`` int64: the number of closed triangles of each configuration."""
        return self._tables.triangles

    @property
    def shells(self) -> torch.Tensor:
        """``(n, 3)`` int64: each side's shell (an index into ``edges``)."""
        return self._tables.shells

    @property
    def edges(self) -> torch.Tensor:
        """``(n_bins + 1,)``: the shells' edges in h/Mpc."""
        return self._tables.edges

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the fields the layer takes and of its results."""
        return self._tables.k.dtype

    @property
    def device(self) -> torch.device:
        return self._tables.triangles.device

    def _field_error(self, field) -> str | None:
        """What is wrong with ``field`` (None if nothing)."""
        name = "BispectrumEstimator"
        block = tuple(self._mesh.local_real_shape)
        if not isinstance(field, torch.Tensor) or field.dim() not in (3, 4) or tuple(field.shape[-3:]) != block:
            where = "" if self._mesh.is_local else (
                f", this rank's block of the {self.shape} mesh on the {self._mesh.grid_shape[0]} x "
                f"{self._mesh.grid_shape[1]} grid")
            cells = ", ".join(map(str, block))
            got = tuple(field.shape) if isinstance(field, torch.Tensor) else type(field).__name__
            return f"{name}: `field` must be a tensor of shape (B, {cells}) or ({cells}) (the mesh the layer was " \
                   f"built for{where}), got {got}"
        if field.dtype != self.dtype:
            return (f"{name}: `field` must be {self.dtype} (the layer's dtype), got {field.dtype}; convert the field, "
                    f"or the layer with .to({field.dtype})" if field.is_floating_point() and not field.is_complex()
                    else f"{name}: `field` must be a real {self.dtype} tensor (the layer's dtype), got {field.dtype}")
        if field.device != self.device:
            return (f"{name}: `field` is on {field.device} but the layer was built for {self.device}; move the field, "
                    f"or the layer with .to({str(field.device)!r})")
        if not bool(torch.isfinite(field).all()):
            return f"{name}: `field` contains NaN or infinite values"
        return None

    def forward(self, field: torch.Tensor) -> Bispectrum:
        error = self._field_error(field)
        batch = field.shape[0] if error is None and field.dim() == 4 else 1
        # Every rank checks its block (and the ranks' batch sizes, which set the sums'
        # size) before the transforms: a bad block raises on every rank.
        self._mesh.agree("BispectrumEstimator", [("the batch size", batch)], error)
        single = field.dim() == 3
        batched = field.unsqueeze(0) if single else field
        value, reduced, power = self._tables(self._mesh.rfftn(batched.to(torch.float64)))
        value, reduced, power = (x.to(self.dtype) for x in (value, reduced, power))
        if single:
            value, reduced, power = value[0], reduced[0], power[0]
        return Bispectrum(self.k, value, self.triangles, reduced, power, self.shells, self.edges)

    def extra_repr(self) -> str:
        tables = self._tables
        grid = "" if self._mesh.is_local else f", grid={self._mesh.grid_shape}"
        return (f"shape={self.shape}, box_size={self.box_size}, n_bins={tables.modes.numel()}, "
                f"configurations={len(tables.configurations)}, window={tables.window}, shot_noise={tables.noise:g}"
                f"{grid}")


def _bspline_taps(k: torch.Tensor, knots: int, k_max: float):
    """Where each ``k`` falls among ``knots`` control points spread evenly over
    ``[0, k_max]`` (``k`` clamped to that range): the index of the first of the 4
    control points of its cubic B-spline segment (into the end-padded control points)
    and the 4 weights, ``(4, *k.shape)``."""
    t = torch.clamp(k / k_max, 0.0, 1.0) * (knots - 1)
    index = torch.clamp(torch.floor(t), max=knots - 2).long()
    u = t - index
    u2, u3 = u * u, u * u * u
    weights = torch.stack(((1 - u) ** 3 / 6, (3 * u3 - 6 * u2 + 4) / 6, (-3 * u3 + 3 * u2 + 3 * u + 1) / 6, u3 / 6))
    return index, weights


def _cubic_bspline(k: torch.Tensor, coefficients: torch.Tensor, k_max: float, taps=None) -> torch.Tensor:
    """Uniform cubic B-spline with control points ``coefficients`` (``n >= 2``) spread
    evenly over ``[0, k_max]``, evaluated at ``k`` (clamped to that range). The end
    control points are repeated, so the curve is flat beyond ``k_max``; zero control
    points give exactly zero. ``taps``: :func:`_bspline_taps` of ``k``, if known."""
    index, weights = taps if taps is not None else _bspline_taps(k, coefficients.shape[-1], k_max)
    padded = torch.cat([coefficients[:1], coefficients, coefficients[-1:], coefficients[-1:]])
    return sum(weights[j] * padded[index + j] for j in range(4))


def _number(layer: str, name: str, value, positive: bool = False) -> float:
    """:func:`torchpm.config.as_float` of a layer's argument, named after the layer (a
    one-element tensor as float() takes it)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() \
            and value.dtype != torch.bool:
        value = value.item()
    try:
        return as_float(name, value, 0.0 if positive else None, low_open=positive)
    except SettingError as error:
        raise SettingError(f"{layer}: {error}") from None


def _parameter_dtype(layer: str, dtype):
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{layer}: `dtype` must be None or a real floating-point torch.dtype, got {dtype!r}")
    return dtype


class NeuralSplineCorrection(nn.Module):
    """Hybrid-PM force correction: an MLP of the scale factor (and optionally of
    conditioning values such as cosmological parameters) outputs the control points of
    a cubic B-spline over ``|k|``; the potential is multiplied by ``1 + spline(k)``.

    The last layer starts at zero, so the filter is exactly 1 until trained.

    Args:
        k_max: |k| (h/Mpc) of the last control point; beyond it the spline is flat.
            Use at least the largest |k| of the force mesh (``sqrt(3) pi / cell``).
        knots: number of control points.
        hidden: widths of the hidden layers.
        conditions: number of extra inputs to the MLP; set their values with
            :meth:`set_conditions` (e.g. ``Omega_m, sigma8``) before each run.
        dtype, device: of the parameters (``.to()`` changes them later).

    ``forward(k, a)``: ``k`` any shape (h/Mpc), ``a`` a 0-d tensor or float; returns the
    filter, shaped like ``k``, in the dtype of ``k``.
    """

    def __init__(
        self,
        k_max: float,
        knots: int = 16,
        hidden: Sequence[int] = (32, 32),
        conditions: int = 0,
        *,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        super().__init__()
        k_max = _number("NeuralSplineCorrection", "k_max", k_max, positive=True)
        dtype = _parameter_dtype("NeuralSplineCorrection", dtype)
        if isinstance(knots, bool) or not isinstance(knots, int) or knots < 2:
            raise ValueError(f"NeuralSplineCorrection: `knots` must be an integer >= 2, got {knots!r}")
        try:
            hidden = tuple(hidden)
        except TypeError:
            raise ValueError(f"NeuralSplineCorrection: `hidden` must be a sequence of positive integer widths "
                             f"(e.g. (32, 32)), got {hidden!r}") from None
        if any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hidden):
            raise ValueError(f"NeuralSplineCorrection: `hidden` must be positive integer widths, got {hidden!r}")
        if isinstance(conditions, bool) or not isinstance(conditions, int) or conditions < 0:
            raise ValueError(f"NeuralSplineCorrection: `conditions` must be a non-negative integer, got {conditions!r}")
        self.k_max = float(k_max)
        self.knots = knots
        self.conditions = conditions
        widths = (1 + conditions,) + hidden
        layers: list[nn.Module] = []
        for width_in, width_out in zip(widths, widths[1:]):
            layers += [nn.Linear(width_in, width_out, dtype=dtype, device=device), nn.SiLU()]
        last = nn.Linear(widths[-1], knots, dtype=dtype, device=device)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.network = nn.Sequential(*layers, last)
        self._taps_cache = None
        reference = last.weight
        self.register_buffer(
            "condition_values", torch.zeros(conditions, dtype=reference.dtype, device=reference.device), persistent=False
        )

    # Checked equal on every rank of a grid run (Simulation), as the parameters are.
    replicated_buffers = ("condition_values",)

    def set_conditions(self, values) -> None:
        """Set the ``conditions`` extra MLP inputs (a sequence or 1-d tensor; may require grad)."""
        if (isinstance(values, torch.Tensor) and (values.dtype == torch.bool or values.is_complex())) or (
                isinstance(values, (list, tuple)) and any(isinstance(v, bool) for v in values)):
            raise ValueError(f"NeuralSplineCorrection.set_conditions: the values must be real numbers, got {values!r}")
        values = torch.as_tensor(values, dtype=self.condition_values.dtype, device=self.condition_values.device)
        if values.shape != (self.conditions,):
            raise ValueError(
                f"NeuralSplineCorrection.set_conditions: expected {self.conditions} values, got shape {tuple(values.shape)}"
            )
        if not bool(torch.isfinite(values.detach()).all()):
            raise ValueError(f"NeuralSplineCorrection.set_conditions: the values must be finite, got {values.tolist()}")
        self.condition_values = values

    def control_points(self, a) -> torch.Tensor:
        """The spline's ``(knots,)`` control points at scale factor ``a``."""
        reference = self.network[-1].weight
        a = torch.as_tensor(a, dtype=reference.dtype, device=reference.device)
        if a.numel() != 1:
            raise ValueError(f"NeuralSplineCorrection: `a` must be one scale factor, got shape {tuple(a.shape)}")
        a = a.reshape(1)
        inputs = torch.cat([a, self.condition_values.to(reference.dtype)])
        return self.network(inputs)

    def _taps(self, k: torch.Tensor):
        # A simulation passes the same |k| mesh at every step: its spline taps are
        # computed once and reused while it is the same, unmodified tensor object (the
        # cache holds a reference to it, so its memory cannot be reused by another k).
        # Under a torch.func transform the taps of a plain k are built outside it: made
        # inside, they would be the transform's wrappers, which fail ("escaped?") under a
        # later transform of fewer levels.
        if k.requires_grad or torch.compiler.is_compiling() or is_transformed(k):
            return None
        cache = self._taps_cache
        if cache is None or cache[0] is not k or cache[1] != k._version:
            if not bool(torch.isfinite(k).all()):  # (once per |k| tensor: the taps are cached)
                raise ValueError("NeuralSplineCorrection: `k` holds NaN or infinite values")
            with outside_transforms():
                cache = self._taps_cache = (k, k._version, _bspline_taps(k, self.knots, self.k_max))
        return cache[2]

    def forward(self, k: torch.Tensor, a) -> torch.Tensor:
        coefficients = self.control_points(a).to(k.dtype)
        return 1.0 + _cubic_bspline(k, coefficients, self.k_max, self._taps(k))

    def extra_repr(self) -> str:
        return f"k_max={self.k_max:.4g}, knots={self.knots}, conditions={self.conditions}"


class PGDCorrection(nn.Module):
    """Potential-gradient-descent short-range force correction (after Dai, Feng & Seljak 2018).

    PGD moves particles along the gradient of the potential band-passed by
    ``O(k) = exp(-(k_l/k)^2) exp(-(k/k_s)^4)``, which sharpens halos that a coarse PM
    mesh leaves too diffuse. As a force filter this is an extra, band-limited force
    each kick::

        filter(k, a) = 1 + alpha a^mu O(k)

    with trainable ``alpha`` (starts at 0: the identity filter), ``mu`` and the scales
    ``k_l``, ``k_s`` (kept positive through their logarithms).

    Args:
        k_long: ``k_l`` in h/Mpc (the large-scale cut, below which nothing changes).
        k_short: ``k_s`` in h/Mpc (the small-scale cut, around the mesh resolution).
        alpha, mu: initial amplitude and scale-factor exponent.
        dtype, device: of the parameters.

    ``forward(k, a)``: filter shaped like ``k`` (dtype of ``k``); 1 at ``k = 0``.
    """

    def __init__(
        self,
        k_long: float,
        k_short: float,
        alpha: float = 0.0,
        mu: float = 0.0,
        *,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        super().__init__()
        k_long = _number("PGDCorrection", "k_long", k_long, positive=True)
        k_short = _number("PGDCorrection", "k_short", k_short, positive=True)
        alpha = _number("PGDCorrection", "alpha", alpha)
        mu = _number("PGDCorrection", "mu", mu)
        dtype = _parameter_dtype("PGDCorrection", dtype)
        factory = dict(dtype=dtype if dtype is not None else torch.get_default_dtype(), device=device)
        self.log_k_long = nn.Parameter(torch.tensor(math.log(k_long), **factory))
        self.log_k_short = nn.Parameter(torch.tensor(math.log(k_short), **factory))
        self.alpha = nn.Parameter(torch.tensor(alpha, **factory))
        self.mu = nn.Parameter(torch.tensor(mu, **factory))

    def band(self, k: torch.Tensor) -> torch.Tensor:
        """``O(k)``, 0 at ``k = 0``."""
        k_long = torch.exp(self.log_k_long).to(k.dtype)
        k_short = torch.exp(self.log_k_short).to(k.dtype)
        positive = k > 0
        safe = torch.where(positive, k, torch.ones_like(k))
        value = torch.exp(-((k_long / safe) ** 2) - (safe / k_short) ** 4)
        return torch.where(positive, value, torch.zeros_like(value))

    def forward(self, k: torch.Tensor, a) -> torch.Tensor:
        a = torch.as_tensor(a, dtype=k.dtype, device=k.device)
        amplitude = self.alpha.to(k.dtype) * a ** self.mu.to(k.dtype)
        return 1.0 + amplitude * self.band(k)

    def extra_repr(self) -> str:
        return (
            f"k_long={float(self.log_k_long.detach().exp()):.4g}, k_short={float(self.log_k_short.detach().exp()):.4g}, "
            f"alpha={float(self.alpha.detach()):.4g}, mu={float(self.mu.detach()):.4g}"
        )


def save_weights(module: nn.Module, path) -> None:
    """Save ``module.state_dict()`` in a format that cannot carry code.

    ``*.safetensors`` files use safetensors (needs ``pip install safetensors``); any
    other name gets ``torch.save`` of the plain tensor dict, which :func:`load_weights`
    reads back with ``weights_only=True``.
    """
    state = {key: value.detach().contiguous() for key, value in module.state_dict().items()}
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)


def load_weights(module: nn.Module, path, strict: bool = True):
    """Load weights written by :func:`save_weights` into ``module`` (on its device and dtype).

    Pickled objects other than tensors are refused (``torch.load(weights_only=True)``;
    safetensors files hold tensors only), so loading a file cannot run code.
    Raises ``ValueError`` naming the file when it holds anything else (or is not a
    readable file of its kind), ``FileNotFoundError`` when there is none.
    """
    if isinstance(path, (str, os.PathLike)) and not os.path.isfile(path):  # (a file object is read as is)
        raise FileNotFoundError(f"load_weights: no file {str(path)!r}")
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except Exception as error:  # noqa: BLE001 - SafetensorError (a plain Exception) and friends
            raise ValueError(f"load_weights: {path} is not a readable safetensors file ({error})") from error
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # UnpicklingError, or a RuntimeError wrapping it
            # torch's reason without its advice to load with weights_only=False (which runs the code)
            lines = [line for line in str(error).split("\n") if line.strip()]
            reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[-1] if lines
                          else "")
            reason = f"{type(error).__name__}: {reason}"
            raise ValueError(
                f"load_weights: {path} does not hold plain tensors only (refused to unpickle it: {reason}); "
                "save weights with torchpm.nn.save_weights"
            ) from error
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"load_weights: {path} must hold a dict of tensors (a state_dict), got {type(state).__name__}")
    return module.load_state_dict(state, strict=strict)
