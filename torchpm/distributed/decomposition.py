"""`PencilDecomposition`: a 3-D mesh on a ``(P0, P1)`` process grid, with everything the
physics needs from a mesh (the protocol of :mod:`torchpm.mesh`).

It composes the concerns that live in their own files: block layout arithmetic
(:mod:`.layout`), process groups and grid-wide reductions (:mod:`.groups`), the
distributed FFT (:mod:`.fft`), halo exchange (:mod:`.halo`) and particle migration
(:mod:`.particles`). A 1 x 1 grid needs no process group and runs the plain local
operations (``torch.fft``, periodic paint and readout) with no copies or
communication; :class:`torchpm.mesh.LocalMesh` is that case.

Failures. Every collective is bounded by its process group's timeout: a rank that
raised or died makes the others raise a ``torch.distributed.DistBackendError``
naming the group once the timeout expires (or as soon as gloo sees the peer's
socket close). Set it where the groups are made:
``torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=60))``
or ``process_grid_groups(grid, timeout=...)``. Problems the ranks can detect
(bad particles, capacity) raise on every rank together instead, and so do ranks
that disagree about a call: before every collective the ranks all-reduce a small
descriptor of it (operation, dtype, batch shape, halo widths, ...) and a rank's own
argument error, so a mismatched all-to-all never runs (``check_agreement``).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Sequence

import torch
import torch.nn.functional as F

from ..ops import check as _check_deferred_errors
from ..ops import halo_widths
from ..ops.finite_difference import FD4_REACH, _scale_vector, fd4_gradient, fd4_gradient_transpose
from ..ops import paint as _paint
from ..ops import readout as _readout
from ..ops._arguments import order_number as _order_number
from . import fft as _fft
from . import halo as _halo
from . import particles as _particles
from .groups import GridGroups, agreement_checks, eager, process_grid_groups
from .layout import BlockLayout, split_sizes

__all__ = ["PencilDecomposition", "split_sizes", "process_grid_groups"]


def _local(mesh, *args, **kwargs) -> bool:
    return mesh.is_local


class PencilDecomposition:
    """A 3-D mesh split over a ``(P0, P1)`` process grid along x and y.

    Args:
        global_shape: ``(nx, ny, nz)`` of the whole mesh.
        groups: ``None`` (one process, a 1 x 1 grid); one ProcessGroup (x slabs
            over it); or a pair ``(group_axis0, group_axis1)`` whose members differ
            only in their x (resp. y) block, either of which may be ``None``
            for a grid axis of size 1. See :func:`process_grid_groups`.
        mesh: alternatively a 1-D or 2-D ``torch.distributed.DeviceMesh``; its
            dimension ``i`` is grid axis ``i``.
        always_transpose: run the staged FFT pipeline (1-D FFTs, pack, all-to-all,
            unpack) even on grid axes of size 1 that have a group. Only for
            measuring or testing the transposer on one process.
        check_agreement: before every collective (FFT, transpose, halo exchange,
            migration), check that all ranks pass the same dtype, leading (batch)
            shape, halo widths and operation, and raise the same clear error on every
            rank if not, instead of reaching a mismatched all-to-all (which gloo
            answers by aborting a process or returning wrong numbers). One small
            all-reduce per call (see benchmarks/RESULTS.md, section 4). ``None``: on
            unless ``TORCHPM_CHECK_AGREEMENT=0``. Turn it off for benchmarks only. The
            ranks agree on this setting when the decomposition is built.

    Attributes (all plain tuples of ints):
        global_shape, grid_shape ``(P0, P1)``, grid_coords ``(r0, r1)``,
        local_real_shape / local_real_offset: this rank's real block,
        fourier_shape ``(nx, ny, nz // 2 + 1)``,
        local_fourier_shape / local_fourier_offset: this rank's Fourier block,
        groups: ``(group_axis0, group_axis1)`` (None for an axis of size 1).

    Every method that communicates is collective over the grid's groups: all
    ranks must call it in the same order with tensors of the same leading shape.
    """

    def __init__(self, global_shape: Sequence[int], groups=None, *, mesh=None, always_transpose: bool = False,
                 check_agreement: bool | None = None):
        if mesh is not None:
            if groups is not None:
                raise ValueError("PencilDecomposition: pass either `groups` or `mesh`, not both")
            if mesh.ndim not in (1, 2):
                raise ValueError(f"PencilDecomposition: `mesh` must be 1-D or 2-D, got {mesh.ndim}-D")
            groups = tuple(mesh.get_group(i) for i in range(mesh.ndim))
        if groups is None:
            groups = (None, None)
        elif not isinstance(groups, (tuple, list)):
            groups = (groups, None)
        elif len(groups) == 1:
            groups = (groups[0], None)
        if len(groups) != 2:
            raise ValueError(f"PencilDecomposition: `groups` must hold one group per grid axis (2), got {len(groups)}")
        self.groups = tuple(groups)
        self.grid = GridGroups(groups)
        self._axes = self.grid.axes
        # The other arguments: one rank's error raises on every rank of the grid together
        # (alone, it would leave the others waiting in the agreement below).
        error = None
        try:
            self._take_arguments(global_shape, always_transpose, check_agreement)
        except (ValueError, TypeError) as exc:
            error = exc
        self.grid.raise_together(error, operation="PencilDecomposition's arguments")
        self._check_agreement()

    def _take_arguments(self, global_shape, always_transpose, check_agreement):
        try:
            items = tuple(global_shape)
            # (integers only: 4.5 or True are not sizes)
            shape = tuple(operator.index(n) for n in items)
            if any(isinstance(n, bool) for n in items):
                raise TypeError
        except (TypeError, ValueError):
            raise ValueError(f"PencilDecomposition: `global_shape` must be 3 integers, got {global_shape!r}") from None
        if len(shape) != 3 or any(n < 1 for n in shape):
            raise ValueError(f"PencilDecomposition: `global_shape` must be 3 positive integers, got {shape}")
        self._staged = bool(always_transpose) and all(axis.group is not None for axis in self._axes)
        if always_transpose and not self._staged:
            raise ValueError("PencilDecomposition: `always_transpose` needs a process group on both grid axes")
        if check_agreement is None:
            check_agreement = agreement_checks()
        elif not isinstance(check_agreement, bool):
            raise TypeError(f"PencilDecomposition: `check_agreement` must be None, True or False, got {check_agreement!r}")
        self.layout = BlockLayout(shape, self.grid.shape)
        self.global_shape = shape
        self.fourier_shape = self.layout.fourier_shape
        self.local_real_shape, self.local_real_offset = self.real_block(self.grid_coords)
        self.local_fourier_shape, self.local_fourier_offset = self.fourier_block(self.grid_coords)
        self.check_agreement = check_agreement

    def _check_agreement(self):
        """Every rank of the grid must describe the same mesh: a rank with another global
        shape would exchange messages of other sizes, which gloo answers by aborting a
        process or returning wrong numbers. One small all-reduce at construction; every
        rank raises the same error."""
        if self.is_local:
            return
        mine = [*self.global_shape, *self.grid_shape, int(self.check_agreement)]
        table = self.grid.all_gather_counts(mine)
        if bool((table != table[0]).any()):
            rows = "; ".join(
                f"rank {rank}: global shape {tuple(row[:3])}, grid {tuple(row[3:5])}, check_agreement {bool(row[5])}"
                for rank, row in enumerate(table.tolist())
            )
            raise ValueError(
                f"PencilDecomposition: the ranks disagree on the mesh ({rows}); every rank must build the "
                "decomposition with the same `global_shape` on the same process grid (and the same "
                "`check_agreement` / TORCHPM_CHECK_AGREEMENT)"
            )

    # ------------------------------------------------------------------ layout

    @property
    def grid_shape(self) -> tuple[int, int]:
        return self.grid.shape

    @property
    def grid_coords(self) -> tuple[int, int]:
        return self.grid.coords

    @property
    def is_local(self) -> bool:
        """True for a 1 x 1 grid: no communication at all."""
        return self.grid_shape == (1, 1)

    @property
    def size(self) -> int:
        """Number of cells of the global mesh, ``nx * ny * nz``."""
        return math.prod(self.global_shape)

    def real_block(self, coords: Sequence[int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``(shape, offset)`` of the real-space block of the rank at grid ``coords``."""
        return self.layout.real_block(coords)

    def fourier_block(self, coords: Sequence[int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``(shape, offset)`` of the Fourier-space block (transposed layout) at grid ``coords``."""
        return self.layout.fourier_block(coords)

    def local_real_part(self, field: torch.Tensor) -> torch.Tensor:
        """This rank's block (a view) of a whole real field ``(..., nx, ny, nz)``."""
        self._check_trailing(field, self.global_shape, "field", "local_real_part")
        (lx, ly, _), (ox, oy, _) = self.local_real_shape, self.local_real_offset
        return field[..., ox : ox + lx, oy : oy + ly, :]

    def local_fourier_part(self, field_k: torch.Tensor) -> torch.Tensor:
        """This rank's block (a view) of a whole ``rfftn`` output ``(..., nx, ny, nz // 2 + 1)``."""
        self._check_trailing(field_k, self.fourier_shape, "field_k", "local_fourier_part")
        (lx, ly, lz), (ox, oy, oz) = self.local_fourier_shape, self.local_fourier_offset
        return field_k[..., ox : ox + lx, oy : oy + ly, oz : oz + lz]

    def wavevectors(self, dtype: torch.dtype = torch.float32, device=None):
        """Angular wavenumbers ``(w_x, w_y, w_z)`` of this rank's Fourier block.

        ``w_d = 2 pi fftfreq(n_d)`` in radians per cell (``rfftfreq`` along z, the
        real-to-complex axis; the Nyquist entry of an even axis is ``-pi`` along x
        and y, ``+pi`` along z), restricted to the local block and shaped
        ``(lx, 1, 1)``, ``(1, ly, 1)``, ``(1, 1, lz)`` so that they broadcast against
        the local complex tensor ``(..., lx, ly, lz)``. Computed in float64, then cast.
        """
        nx, ny, nz = self.global_shape
        (lx, ly, lz), (ox, oy, oz) = self.local_fourier_shape, self.local_fourier_offset
        two_pi = 2 * math.pi
        wx = two_pi * torch.fft.fftfreq(nx, dtype=torch.float64)[ox : ox + lx]
        wy = two_pi * torch.fft.fftfreq(ny, dtype=torch.float64)[oy : oy + ly]
        wz = two_pi * torch.fft.rfftfreq(nz, dtype=torch.float64)[oz : oz + lz]
        return (
            wx.reshape(lx, 1, 1).to(dtype=dtype, device=device),
            wy.reshape(1, ly, 1).to(dtype=dtype, device=device),
            wz.reshape(1, 1, lz).to(dtype=dtype, device=device),
        )

    def hermitian_weights(self, dtype=torch.float64, device=None) -> torch.Tensor:
        """How many modes of the full complex DFT each entry of the local rfft block stands for.

        2 for ``0 < k_z < nz/2`` (the entry and its conjugate), 1 on the ``k_z = 0``
        plane and, for even ``nz``, on the Nyquist plane; the local slice of the
        (possibly split) kz axis, shaped ``(1, 1, lz)``. Sums over every rank's block
        weighted by this equal sums over all modes.
        """
        nz = self.global_shape[2]
        weights = torch.full((nz // 2 + 1,), 2.0, dtype=dtype, device=device)
        weights[0] = 1.0
        if nz % 2 == 0:
            weights[-1] = 1.0
        lz, oz = self.local_fourier_shape[2], self.local_fourier_offset[2]
        return weights[oz : oz + lz].reshape(1, 1, -1)

    # --------------------------------------------------------------- transforms

    @eager(local=_local)
    def rfftn(self, field: torch.Tensor) -> torch.Tensor:
        """Distributed forward real-to-complex 3-D DFT, unnormalised.

        ``field``: real ``(..., *local_real_shape)`` (float32 or float64).
        Returns complex ``(..., *local_fourier_shape)``: this rank's block of
        ``torch.fft.rfftn(whole_field, dim=(-3, -2, -1))`` in the transposed
        layout. Differentiable; the backward is collective.
        """
        def check():
            self._check_trailing(field, self.local_real_shape, "field", "rfftn")
            if field.is_complex() or not field.is_floating_point():
                raise ValueError(f"PencilDecomposition.rfftn: expected a real floating `field`, got {field.dtype}")

        self._checked_collective("rfftn", check, field, "field")
        return _fft.rfftn(field, self.layout, self._axes, self._staged)

    @eager(local=_local)
    def irfftn(self, field_k: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rfftn` (``1/N`` normalised, ``N = nx ny nz``).

        ``field_k``: complex ``(..., *local_fourier_shape)`` in the transposed
        layout. Returns real ``(..., *local_real_shape)``: this rank's block of
        ``torch.fft.irfftn(whole_field_k, s=global_shape)``. Differentiable.
        """
        def check():
            self._check_trailing(field_k, self.local_fourier_shape, "field_k", "irfftn")
            if not field_k.is_complex():
                raise ValueError(f"PencilDecomposition.irfftn: expected a complex `field_k`, got {field_k.dtype}")

        self._checked_collective("irfftn", check, field_k, "field_k")
        return _fft.irfftn(field_k, self.layout, self._axes, self._staged)

    @eager(local=_local)
    def transpose(self, t: torch.Tensor, axis: int, inverse: bool = False) -> torch.Tensor:
        """One transpose step of the FFT, exposed for tests and custom pipelines.

        ``axis = 1``: ``(..., lx, ly, nzc)`` (y split over grid axis 1) ->
        ``(..., lx, ny, lzc)`` (kz split). ``axis = 0``: ``(..., lx, ny, lzc)``
        (x split over grid axis 0) -> ``(..., nx, lky, lzc)``. ``inverse`` undoes it.
        Works on any dtype.
        """
        layout = self.layout
        geometry = {}

        def check():
            if axis == 1:
                pair = ((-2, layout.real_y), (-1, layout.fourier_z))
            elif axis == 0:
                pair = ((-3, layout.real_x), (-2, layout.fourier_y))
            else:
                raise ValueError(f"PencilDecomposition.transpose: `axis` must be 0 or 1, got {axis!r}")
            (gd, gs), (sd, ss) = reversed(pair) if inverse else pair
            if not isinstance(t, torch.Tensor) or t.dim() < 3:
                raise ValueError(
                    f"PencilDecomposition.transpose: expected a tensor of at least 3 dimensions, got "
                    f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                )
            if t.shape[gd] != gs[self._axes[axis].rank] or t.shape[sd] != sum(ss):
                raise ValueError(
                    f"PencilDecomposition.transpose: tensor of shape {tuple(t.shape)} does not match the layout "
                    f"expected before {'inverse ' if inverse else ''}transpose {axis} (dim {gd} = "
                    f"{gs[self._axes[axis].rank]}, dim {sd} = {sum(ss)})"
                )
            geometry.update(gd=gd, gs=gs, sd=sd, ss=ss)

        self._checked_collective("transpose", check, t, "t", ("`axis`", str(axis)), ("`inverse`", str(bool(inverse))))
        gd, gs, sd, ss = geometry["gd"], geometry["gs"], geometry["sd"], geometry["ss"]
        return _fft.transpose(t, self._axes[axis], gather_dim=gd, gather_sizes=gs, split_dim=sd, split_sizes=ss,
                              staged=self._staged)

    # ------------------------------------------------------------------- halos

    def halo_shape(self, width) -> tuple[int, int, int]:
        """Local real block shape with a halo of ``width`` on x and y (see :meth:`fill_halo`)."""
        (lo_x, hi_x), (lo_y, hi_y) = self._check_width(width)
        lx, ly, nz = self.local_real_shape
        return (lx + lo_x + hi_x, ly + lo_y + hi_y, nz)

    def pad_halo(self, field: torch.Tensor, width) -> torch.Tensor:
        """Zero-pad a local block ``(..., lx, ly, nz)`` with the halo of ``width`` on x and y."""
        (lo_x, hi_x), (lo_y, hi_y) = self._check_width(width)
        self._check_trailing(field, self.local_real_shape, "field", "pad_halo")
        return F.pad(field, (0, 0, lo_y, hi_y, lo_x, hi_x))

    def strip_halo(self, field: torch.Tensor, width) -> torch.Tensor:
        """The interior ``(..., lx, ly, nz)`` (a view) of a haloed block."""
        (lo_x, _), (lo_y, _) = self._check_width(width)
        self._check_trailing(field, self.halo_shape(width), "field", "strip_halo")
        lx, ly, _ = self.local_real_shape
        return field[..., lo_x : lo_x + lx, lo_y : lo_y + ly, :]

    @eager(local=_local)
    def fill_halo(self, field: torch.Tensor, width) -> torch.Tensor:
        """Periodic halo fill along x and y: copy the neighbours' edge planes into my halo.

        ``field``: ``(..., lx + lo + hi, ly + lo + hi, nz)``, the local block with
        ``lo`` halo planes below and ``hi`` above on x and y. ``width`` is an int
        (``lo = hi``), a pair ``(lo, hi)`` for both axes, or one pair per axis
        ``((lo_x, hi_x), (lo_y, hi_y))``. Global index ``i`` of the block sits at
        padded index ``i - offset + lo``. Returns a new tensor whose halo holds the
        periodic neighbours' values, corners included; the interior is unchanged
        and the input halo is ignored. Axes of grid size 1 wrap onto themselves.
        Needs every width ``<=`` every block's size. Differentiable; its adjoint is
        :meth:`add_halo`.
        """
        widths = self._checked_halo("fill_halo", field, width)
        return _halo.fill_halo(field, widths, self._axes)

    @eager(local=_local)
    def add_halo(self, field: torch.Tensor, width) -> torch.Tensor:
        """Periodic halo add along x and y: add my halo into the neighbours' edge planes.

        The adjoint of :meth:`fill_halo` (same shapes and ``width``): each halo
        cell's value is added to the interior cell of the neighbour (corners:
        the diagonal neighbour) that owns it, and the returned halo is zero.
        Painting into a haloed block then calling this gives the painted local
        block. Differentiable; its adjoint is :meth:`fill_halo`.
        """
        widths = self._checked_halo("add_halo", field, width)
        return _halo.add_halo(field, widths, self._axes)

    # ------------------------------------------------------ finite differences

    def fd4_halo(self):
        """Halo widths ``((lo_x, hi_x), (lo_y, hi_y))`` of the 4-point finite difference
        (:meth:`fd4_gradient`): 2 on split axes, 0 elsewhere; None when a block along a
        split axis has fewer than 2 planes (a halo comes from one neighbour), and the
        gradient is then taken in Fourier space (:class:`torchpm.fourier.FourierKernels`)."""
        widths = tuple((FD4_REACH, FD4_REACH) if self.grid_shape[axis] > 1 else (0, 0) for axis in (0, 1))
        for (lo, _), sizes in zip(widths, (self.layout.real_x, self.layout.real_y)):
            if lo > min(sizes):
                return None
        return widths

    def _fd4_geometry(self, method):
        widths = self.fd4_halo()
        if widths is None:
            raise ValueError(
                f"PencilDecomposition.{method}: a block along a split axis has fewer than {FD4_REACH} planes "
                f"(blocks {self.layout.real_x} along x, {self.layout.real_y} along y); the stencil's halo "
                f"cannot come from one neighbour"
            )
        return widths, [self.grid_shape[0] == 1, self.grid_shape[1] == 1, True]

    def _check_fd4_field(self, field, method):
        self._check_trailing(field, self.local_real_shape, "field", method)
        if field.dim() != 4:
            raise ValueError(f"PencilDecomposition.{method}: expected `field` of shape (B, "
                             f"*{self.local_real_shape}), got {tuple(field.shape)}")

    @eager(local=_local)
    def fd4_gradient(self, field: torch.Tensor, scale, *, halo_for: str | None = None) -> torch.Tensor:
        """``(B, 3, *local_real_shape)``: channel ``i`` is ``scale[i] * D_i field``, ``D`` the
        4-point finite difference of the global periodic mesh in nodes
        (:func:`torchpm.ops.fd4_gradient`; Fourier multiplier ``i (8 sin w - sin 2w) / 6``).

        ``field``: ``(B, *local_real_shape)``; ``scale``: 3 factors (numbers, 0-d tensors
        or a (3,) tensor, differentiable). On split axes the stencil's halo is filled
        from the neighbours first. Collective on a grid; differentiable.

        ``halo_for``: a mass-assignment order. The gradient then comes with the halo a
        readout of that order needs, filled (shape ``(B, 3, *halo_shape(stencil_halo(
        halo_for)))``, for :meth:`readout` with ``haloed=True``): the field's halo is
        filled once, wide enough for both stencils (:meth:`fd4_readout_halo`), and the
        gradient formed on the block plus the readout's halo, one exchange of one channel
        instead of a second one of the three components. Blocks too thin for that halo
        take the second exchange.
        """
        if self.is_local:
            return fd4_gradient(field, scale, True)
        prepared = []

        def check():
            self._check_fd4_field(field, "fd4_gradient")
            widths, periodic = self._fd4_geometry("fd4_gradient")
            refill = None  # the readout's halo, when it must come from a second exchange
            if halo_for is not None:
                wide = self.fd4_readout_halo(halo_for)
                if wide is None:
                    refill = self.stencil_halo(halo_for)
                else:
                    widths = wide
            prepared.append((widths, periodic, refill, _scale_vector(scale, field, "fd4_gradient"),
                             self.pad_halo(field, widths)))

        self._checked_collective("fd4_gradient", check, field, "field",
                                 ("halo widths (field, readout refill) of `halo_for`",
                                  lambda: prepared[0][0:3:2] if prepared else str(halo_for)))
        widths, periodic, refill, scale, padded = prepared[0]
        gradient = torch.ops.torchpm._fd4_gradient(_halo.fill_halo(padded, widths, self._axes, inplace=True), scale,
                                                   periodic)
        if refill is not None:  # too thin for one wide halo: the readout's halo from a second exchange
            gradient = self.with_stencil_halo(gradient, halo_for)
        return gradient

    @eager(local=_local)
    def fd4_gradient_transpose(self, grad: torch.Tensor, scale) -> torch.Tensor:
        """The transpose of :meth:`fd4_gradient` (same ``scale``): ``(B, 3,
        *local_real_shape)`` to ``(B, *local_real_shape)``, ``-sum_i scale[i] D_i grad[:, i]``.
        On a grid the stencil's reach into the halo is added into the neighbours
        (:meth:`add_halo`). Collective on a grid; differentiable."""
        if self.is_local:
            return fd4_gradient_transpose(grad, scale, True)
        prepared = []

        def check():
            if not isinstance(grad, torch.Tensor) or grad.dim() != 5 or grad.shape[1] != 3:
                raise ValueError(
                    f"PencilDecomposition.fd4_gradient_transpose: expected `grad` of shape (B, 3, "
                    f"*{self.local_real_shape}), got {tuple(grad.shape) if isinstance(grad, torch.Tensor) else grad!r}"
                )
            self._check_trailing(grad, self.local_real_shape, "grad", "fd4_gradient_transpose")
            widths, periodic = self._fd4_geometry("fd4_gradient_transpose")
            vector = _scale_vector(scale, grad, "fd4_gradient_transpose")
            prepared.append((widths, torch.ops.torchpm._fd4_gradient_transpose(grad, vector, periodic)))

        self._checked_collective("fd4_gradient_transpose", check, grad, "grad")
        widths, haloed = prepared[0]
        return self.strip_halo(_halo.add_halo(haloed, widths, self._axes, inplace=True), widths)

    def fd4_readout_halo(self, order: str = "cic"):
        """Halo widths ``((lo_x, hi_x), (lo_y, hi_y))`` of the field for
        :meth:`fd4_gradient` with ``halo_for=order``: the 4-point stencil's 2 plus the
        readout stencil's reach (:meth:`stencil_halo`) on split axes; None when a block
        is too thin for it (a halo comes from one neighbour) or the gradient is taken in
        Fourier space (:meth:`fd4_halo` is None)."""
        fd4 = self.fd4_halo()
        if fd4 is None:
            return None
        widths = tuple((a + c, b + d) for (a, b), (c, d) in zip(fd4, self.stencil_halo(order)))
        return None if self._too_thin(widths) else widths

    def _checked_halo(self, method, field, width):
        """The local checks of a halo exchange and the ranks' agreement on it; returns the widths."""
        found = []

        def check():
            found.append(self._check_width(width))
            self._check_trailing(field, self.halo_shape(width), "field", method)

        self._checked_collective(method, check, field, "field",
                                 ("halo `width` ((lo_x, hi_x), (lo_y, hi_y))", lambda: found[0] if found else str(width)))
        return found[0]

    # ------------------------------------------------------------- agreement

    def _checked_collective(self, method, check, tensor, name, *extra):
        """Run the local argument checks ``check()`` of a collective ``method``, then (on a grid
        with ``check_agreement``) make every rank agree on the call before any message moves.

        A rank whose own check failed still joins the agreement all-reduce and reports its
        error there, so every rank raises together instead of the others waiting in the
        all-to-all for it. The descriptor: operation, global shape, grid, dtype and leading
        (batch) shape of ``tensor``, and ``extra`` ``(name, value or callable)`` pairs.
        """
        if self.is_local or not self.check_agreement:
            check()
            return
        error = None
        try:
            check()
            # With deferred error checking (the default on CUDA) the local paint's bad
            # particles, or an earlier torchpm op's, are reported by check(): raise them
            # here, inside the agreement, so every rank raises together. The agreement
            # waits for the device anyway.
            _check_deferred_errors()
        except (ValueError, TypeError) as exc:
            error = exc
        is_tensor = isinstance(tensor, torch.Tensor)
        values = [
            ("`global_shape` of the decomposition", self.global_shape),
            ("process grid", self.grid_shape),
            (f"dtype of `{name}`", tensor.dtype if is_tensor else type(tensor).__name__),
            (f"leading (batch) shape of `{name}`", tuple(tensor.shape[:-3]) if is_tensor and tensor.dim() >= 3 else ()),
        ]
        values += [(key, value() if callable(value) else value) for key, value in extra]
        # (on the groups' control device: the CPU wherever they have a CPU backend, the
        # GPU with NCCL alone, which cannot reduce a CPU tensor)
        self.grid.agree(f"PencilDecomposition.{method}", values, error)

    def _check_width(self, width):
        def pair(value):
            if isinstance(value, bool):
                raise TypeError
            if isinstance(value, int):
                return value, value
            lo, hi = value
            if isinstance(lo, bool) or isinstance(hi, bool):
                raise TypeError
            return int(lo), int(hi)

        try:
            if isinstance(width, (tuple, list)) and len(width) == 2 and all(isinstance(w, (tuple, list)) for w in width):
                widths = (pair(width[0]), pair(width[1]))
            else:
                widths = (pair(width),) * 2
        except (TypeError, ValueError):
            raise ValueError(
                f"halo `width` must be an int, a pair (lo, hi) or one pair per axis ((lo_x, hi_x), (lo_y, hi_y)), "
                f"got {width!r}"
            ) from None
        bad = next(((name, lo, hi, sizes) for (lo, hi), sizes, name in zip(widths, self._block_sizes(), "xy")
                    if min(lo, hi) < 0), None) or self._too_thin(widths)
        if bad:
            name, lo, hi, sizes = bad
            raise ValueError(
                f"halo `width` ({lo}, {hi}) along {name} must be non-negative and at most the smallest block "
                f"size {min(sizes)} along {name} (a halo must come from one neighbour)"
            )
        return widths

    def _block_sizes(self):
        """The real blocks' plane counts along x and along y, one per rank of that grid axis."""
        return self.layout.real_x, self.layout.real_y

    def _too_thin(self, widths):
        """The first axis whose thinnest block cannot supply the halo ``(lo, hi)`` of ``widths``
        from one neighbour, as ``(axis name, lo, hi, block sizes)``; None when every axis can."""
        return next(((name, lo, hi, sizes) for (lo, hi), sizes, name in zip(widths, self._block_sizes(), "xy")
                     if max(lo, hi) > min(sizes)), None)

    def check_paint_order(self, order, what: str = "the mesh") -> None:
        """Refuse a mass-assignment ``order`` whose stencil reaches past one neighbour's block
        on a split axis (its halo comes from one neighbour), naming ``paint_order``; ``what``
        names the mesh in the message."""
        thin = self._too_thin(self.stencil_halo(order))
        if thin:
            name, lo, hi, sizes = thin
            raise ValueError(
                f"{what} split over the {self.grid_shape} process grid leaves blocks of {min(sizes)} plane(s) "
                f"along {name} ({list(sizes)}), fewer than the {max(lo, hi)} that the stencil of `paint_order` "
                f"{order!r} reaches; use a larger mesh, fewer ranks along that axis or a lower `paint_order`"
            )

    # ------------------------------------------------------ paint and readout

    def stencil_halo(self, order: str = "cic"):
        """Halo widths ``((lo_x, hi_x), (lo_y, hi_y))`` that painting with ``order`` needs
        for particles owned by this rank: the stencil's reach on split axes, 0 elsewhere."""
        below, above = halo_widths(order)
        return tuple((below, above) if self.grid_shape[axis] > 1 else (0, 0) for axis in (0, 1))

    def _block_geometry(self, order):
        widths = self.stencil_halo(order)
        shape = list(self.local_real_shape)
        offset = list(self.local_real_offset)
        periodic = [True, True, True]
        for axis, (lo, hi) in enumerate(widths):
            if self.grid_shape[axis] > 1:
                shape[axis] += lo + hi
                offset[axis] -= lo
                periodic[axis] = False
        return widths, shape, offset, periodic

    def wrap(self, positions: torch.Tensor) -> torch.Tensor:
        """``(B, N, 3)`` positions (global mesh cells) wrapped into ``[0, n)`` along the
        split axes, the interval whose blocks the ranks own: a periodic image of an owned
        particle (shifted by whole boxes) becomes owned, as a single device's periodic
        paint and readout take any image. A coordinate already in ``[0, n)`` keeps its
        bits; a non-finite one or one at or beyond +-2^40 cells is kept for the paint to
        name. Differentiable (derivative 1); the identity on a 1 x 1 grid. Local."""
        axes = [axis for axis in (0, 1) if self.grid_shape[axis] > 1]
        if not axes:
            return positions
        columns = list(positions.unbind(-1))
        for axis in axes:
            column = columns[axis]
            wrapped = _particles._wrapped_column(column, self.global_shape[axis])
            columns[axis] = torch.where(_particles._within_reach(column), wrapped, column)
        return torch.stack(columns, -1)

    @eager(local=_local)
    def paint(self, positions: torch.Tensor, weights: torch.Tensor | None = None, *, order: str = "cic",
              _caller_error: BaseException | None = None) -> torch.Tensor:
        """Paint ``(B, N, 3)`` particles (global mesh-cell units) onto the local block.

        The particles must be owned by this rank (their position lies in the local
        block along split axes: see :meth:`migrate`, and :meth:`wrap` for periodic
        images of owned particles). They are painted
        into the block plus the stencil's halo, which :meth:`add_halo` then adds
        into the neighbours. Returns ``(B, *local_real_shape)`` (or
        ``(B, C, ...)`` for ``(B, N, C)`` weights). Collective on a grid.
        (``_caller_error``: a caller's own argument error, raised in the paint's agreement:
        on every rank together.)
        """
        # Unsplit axes are periodic with no halo, so on a 1 x 1 grid this is the plain
        # periodic paint: no halo exchange and no copy.
        if self.is_local:
            if _caller_error is not None:
                raise _caller_error
            widths, shape, offset, periodic = self._block_geometry(order)
            return _paint(positions, weights, shape, order=order, offset=offset, periodic=periodic)
        painted = []

        def check():
            if _caller_error is not None:
                raise _caller_error
            widths, shape, offset, periodic = self._block_geometry(order)
            painted.append((widths, _paint(positions, weights, shape, order=order, offset=offset, periodic=periodic)))

        # A rank whose particles cannot be painted (not owned, NaN) reports it in the
        # agreement before the halo exchange, so every rank raises instead of waiting.
        self._checked_collective(
            "paint", check, positions, "positions",
            ("halo widths of `order`", lambda: painted[0][0] if painted else str(order)),
            ("leading shape (batch, channels) of the painted block",
             lambda: tuple(painted[0][1].shape[:-3]) if painted else ()),
        )
        widths, block = painted[0]
        return self.strip_halo(_halo.add_halo(block, widths, self._axes, inplace=True), widths)

    @eager(local=lambda mesh, *args, haloed=False, **kwargs: mesh.is_local or haloed)
    def readout(self, field: torch.Tensor, positions: torch.Tensor, *, order: str = "cic",
                haloed: bool = False) -> torch.Tensor:
        """Read the local block ``(B, [C,] *local_real_shape)`` at ``(B, N, 3)`` owned
        particles: ``(B, N)`` or ``(B, N, C)``. Fills the stencil's halo from the
        neighbours first (collective on a grid), unless ``haloed``: ``field`` then
        already holds it (``(B, [C,] *halo_shape(stencil_halo(order)))``, e.g. from
        :meth:`with_stencil_halo` or :meth:`fd4_gradient` with ``halo_for``), and the
        readout is local."""
        if self.is_local:
            _, _, offset, periodic = self._block_geometry(order)
            return _readout(field, positions, order=order, offset=offset, periodic=periodic)
        if haloed:
            widths, _, offset, periodic = self._block_geometry(order)
            self._check_trailing(field, self.halo_shape(widths), "field", "readout")
            return _readout(field, positions, order=order, offset=offset, periodic=periodic)
        prepared = []

        def check():
            widths, _, offset, periodic = self._block_geometry(order)
            prepared.append((widths, offset, periodic, self.pad_halo(field, widths)))

        self._checked_collective("readout", check, field, "field",
                                 ("halo widths of `order`", lambda: prepared[0][0] if prepared else str(order)))
        widths, offset, periodic, padded = prepared[0]
        field = _halo.fill_halo(padded, widths, self._axes, inplace=True)
        # A collective call: one rank's bad particle raises on every rank (one small
        # all-reduce; the run's own readouts take a haloed field and stay local).
        values, error = None, None
        try:
            values = _readout(field, positions, order=order, offset=offset, periodic=periodic)
            _check_deferred_errors()  # (deferred checking, the CUDA default: its count now)
        except (ValueError, TypeError) as exc:
            error = exc
        self.raise_together(error, operation="PencilDecomposition.readout (after the halo fill)")
        return values

    def readout_kick_drift_(self, field: torch.Tensor, positions: torch.Tensor, momenta: torch.Tensor,
                            kicks: Sequence[float], drift: float | None = None, *, order: str = "cic") -> None:
        """The integrator's updates fused into :meth:`readout` (``haloed=True``) of the force
        ``field`` ``(B, 3, ...)`` at owned ``positions``: ``momenta += F * k`` for each of
        the one or two ``kicks``, then (with ``drift``) ``positions += momenta * drift``,
        in place, each rounded as :func:`torchpm.pm.add_scaled_` rounds it (the same
        bits as that composition), without writing ``F``
        (``torch.ops.torchpm._readout_kick_drift_``). Contiguous float tensors of one
        shape, dtype and device, outside any graph. Local (no collective).

        A particle the readout rejects (or one reading a NaN/Inf) is not updated: its
        momentum becomes NaN, its position stays as read, and the error names it (on CUDA,
        whose error checking is deferred by default, the late error gives the count and
        names the particle only under ``torchpm.set_error_checking("immediate")``). Every
        other particle is updated."""
        widths, _, offset, periodic = self._block_geometry(order)
        if not self.is_local:
            self._check_trailing(field, self.halo_shape(widths), "field", "readout_kick_drift_")
        torch.ops.torchpm._readout_kick_drift_(field, positions, momenta, offset, periodic,
                                               _order_number(order, "readout_kick_drift_"),
                                               [float(k) for k in kicks], None if drift is None else float(drift))

    @eager(local=_local)
    def with_stencil_halo(self, field: torch.Tensor, order: str = "cic") -> torch.Tensor:
        """``field`` ``(..., *local_real_shape)`` padded with the halo a stencil of ``order``
        reaches (:meth:`stencil_halo`) and that halo filled from the neighbours: what
        :meth:`readout` reads, for several readouts or position gradients of one field.
        On a 1 x 1 grid (no halo) ``field`` itself. Collective on a grid; differentiable."""
        widths = self.stencil_halo(order)
        if not any(lo or hi for lo, hi in widths):
            return field
        padded = self.pad_halo(field, widths)
        widths = self._checked_halo("fill_halo", padded, widths)
        return _halo.fill_halo(padded, widths, self._axes, inplace=True)

    # -------------------------------------------------------------- particles

    @property
    def padding_position(self) -> list[float]:
        """The position (mesh cells) that :meth:`migrate` gives the empty slots of a batch
        member left without particles (the others sit next to their neighbours): the
        lower corner of the local block along split axes, 0 along the others."""
        return [float(o) if self.grid_shape[axis] > 1 else 0.0
                for axis, o in enumerate(self.local_real_offset[:2])] + [0.0]

    @eager(local=_local)
    def migrate(self, positions: torch.Tensor, ids: torch.Tensor, *attributes: torch.Tensor,
                capacity: int | None = None, destination: torch.Tensor | None = None, overwrite: bool = False,
                overwrite_ids: bool = False):
        """Move particles to the rank that owns their position (wrapped along split axes).

        Args:
            positions: ``(B, n, 3)`` global mesh-cell units, float32 or float64.
            ids: ``(B, n)`` int64 particle ids, ``-1`` for empty slots.
            attributes: more per-particle tensors ``(B, n, ...)`` to move along.
            capacity: most slots per batch member on a rank afterwards, a positive
                integer (None: grow as needed); it may differ between ranks.
            destination: optional ``(B, n)`` int64 grid rank (``r0 * P1 + r1``) to send each
                particle to instead of the owner of its position (any value in an empty slot).
            overwrite: ``positions`` and ``attributes`` are scratch that the migration may
                write into instead of copying (not ``ids``: see ``overwrite_ids``; never a
                tensor that records gradients): saves a copy of each when this rank's slot
                count is unchanged.
            overwrite_ids: ``ids`` are scratch too (the simulation's steps, on the ids an
                earlier migration returned): saves the copy of the ids. A plan returned
                earlier reads the ids it returned (``plan.padding``), which this changes.

        Returns:
            ``(plan, positions, ids, *attributes)``; ``plan.exchange`` moves any
            other per-particle tensor the same way, ``plan.gather`` moves values
            back. On a 1 x 1 grid nothing moves and nothing is copied.
            Collective; differentiable in positions and attributes.
        """
        def check():
            if not isinstance(positions, torch.Tensor) or positions.dim() != 3 or positions.shape[-1] != 3:
                raise ValueError(f"migrate: expected `positions` of shape (B, n, 3), got {_describe(positions)}")
            if not isinstance(ids, torch.Tensor) or ids.shape != positions.shape[:2] or ids.dtype != torch.int64:
                raise ValueError(
                    f"migrate: expected int64 `ids` of shape {tuple(positions.shape[:2])}, got {_describe(ids)}"
                )
            if positions.dtype not in (torch.float32, torch.float64):
                raise ValueError(f"migrate: expected float32 or float64 `positions`, got {positions.dtype}")
            for index, attribute in enumerate(attributes):
                if not isinstance(attribute, torch.Tensor) or attribute.shape[:2] != positions.shape[:2]:
                    raise ValueError(
                        f"migrate: expected attribute {index} of shape {tuple(positions.shape[:2])} + (...), "
                        f"got {_describe(attribute)}"
                    )
            if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral)
                                         or capacity < 1):
                raise ValueError(f"migrate: `capacity` must be a positive integer or None, got {capacity!r}")
            if destination is not None:
                if (not isinstance(destination, torch.Tensor) or destination.dtype != torch.int64
                        or destination.shape != ids.shape or destination.device != ids.device):
                    raise ValueError(f"migrate: expected `destination` as int64 of shape {tuple(ids.shape)} on "
                                     f"{ids.device}, got {_describe(destination)}")
                # (the occupied slots' ranks; one device sync, on this path only)
                routed = destination[ids >= 0]
                if routed.numel() and not bool(((routed >= 0) & (routed < self.grid.size)).all()):
                    wrong = routed[(routed < 0) | (routed >= self.grid.size)][0]
                    raise ValueError(f"migrate: `destination` must hold grid ranks 0 .. {self.grid.size - 1} "
                                     f"(r0 * P1 + r1) for the occupied slots, got {int(wrong)}")

        # Batch, dtypes and per-particle trailing shapes set the message sizes of every
        # stage; the slot count n may differ between ranks. The debug checks add collectives.
        debug = _particles.debug_checks()
        self._checked_collective(
            "migrate", check, positions, "positions",
            ("batch size (dim 0 of `positions`)",
             int(positions.shape[0]) if isinstance(positions, torch.Tensor) and positions.dim() else -1),
            ("`destination` given", destination is not None),
            ("number of attributes", len(attributes)),
            ("attributes (dtype, per-particle shape)",
             tuple((str(a.dtype), tuple(a.shape[2:])) if isinstance(a, torch.Tensor) else type(a).__name__
                   for a in attributes)),
            ("debug checks (TORCHPM_DEBUG_MIGRATION, torchpm.distributed.debug_checks)", debug),
        )
        corner = self.padding_position
        before = (ids >= 0).sum(1) if debug else None
        plan, positions, ids, *moved = _particles.migrate(
            self.layout, self.grid, positions, ids, *attributes, capacity=capacity, corner=corner,
            destination=destination, overwrite=overwrite, overwrite_ids=overwrite_ids,
            check_agreement=self.check_agreement,
        )
        if debug:
            self.check_conservation(before, ids)
        return (plan, positions, ids, *moved)

    @eager(local=_local)
    def check_conservation(self, counts_before: torch.Tensor, ids: torch.Tensor) -> None:
        """Check a migration (debug mode and tests): the global number of particles of every
        batch member is unchanged and no id appears twice on this rank. Collective."""
        counts = torch.stack([counts_before.to(torch.int64), (ids >= 0).sum(1).to(torch.int64)])
        counts = self.all_reduce(counts.to(ids.device))
        error = None
        if not torch.equal(counts[0], counts[1]):
            error = (f"particle migration lost or duplicated particles: global counts per batch member "
                     f"{counts[0].tolist()} before, {counts[1].tolist()} after")
        else:
            for member, row in enumerate(ids):
                valid = row[row >= 0]
                if torch.unique(valid).numel() != valid.numel():
                    error = f"particle migration duplicated ids of batch member {member} on this rank"
                    break
        self.raise_together(error, RuntimeError, operation="PencilDecomposition.check_conservation")

    # ------------------------------------------------------------ reductions

    @eager(local=_local)
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce over every rank of the grid (``"sum"`` differentiable; ``"max"``, ``"min"``).

        A primitive: every rank must pass a tensor of the same shape and dtype, which is
        not checked (no agreement all-reduce before it: torchpm's own calls are alike by
        construction); ranks that differ get gloo's abort or NCCL's wrong numbers. Call
        :meth:`agree` first with the shape where it may differ."""
        return self.grid.all_reduce(tensor, op)

    @eager(local=_local)
    def raise_together(self, error: str | BaseException | None, exception=ValueError,
                       operation: str = "a check raised together") -> None:
        """Raise ``exception`` on every rank when any rank has an ``error`` (collective;
        ``operation`` names the call when ranks are found in different ones)."""
        self.grid.raise_together(error, exception, operation=operation)

    @eager(local=_local)
    def agree(self, operation: str, values, error: str | BaseException | None = None) -> None:
        """Raise the same ValueError on every rank when any rank has an ``error`` or the ranks'
        ``values`` (``(name, value)`` pairs) differ: for callers about to run collectives
        whose sizes depend on those values. One small all-reduce (collective); with
        ``check_agreement`` off only the errors are exchanged, as :meth:`raise_together`."""
        if self.check_agreement:
            self.grid.agree(operation, values, error)
        else:
            self.grid.raise_together(error, operation=operation)

    # ------------------------------------------------------------------ misc

    def _check_trailing(self, tensor, expected, name, method):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"PencilDecomposition.{method}: `{name}` must be a tensor, got {type(tensor).__name__}")
        if tensor.dim() < 3 or tuple(tensor.shape[-3:]) != tuple(expected):
            raise ValueError(
                f"PencilDecomposition.{method}: expected `{name}` of shape (..., {', '.join(map(str, expected))}) "
                f"on grid coordinates {self.grid_coords} of the {self.grid_shape[0]} x {self.grid_shape[1]} grid, "
                f"got {tuple(tensor.shape)}"
            )

    def __repr__(self):
        return (
            f"PencilDecomposition(global_shape={self.global_shape}, grid={self.grid_shape}, "
            f"coords={self.grid_coords}, real={self.local_real_shape}@{self.local_real_offset}, "
            f"fourier={self.local_fourier_shape}@{self.local_fourier_offset})"
        )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def _has_halo(widths) -> bool:
    return any(lo or hi for lo, hi in widths)
