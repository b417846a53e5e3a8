"""Pencil (and slab) decomposition of a 3-D mesh, the distributed real-to-complex
FFT on it, and the periodic halo exchange.

Layouts. The global mesh ``(nx, ny, nz)`` is split over a process grid
``(P0, P1)``: grid axis 0 splits x, grid axis 1 splits y, z is never split. A
rank with grid coordinates ``(r0, r1)`` holds the real-space block

    x in [ox, ox + lx), y in [oy, oy + ly), z in [0, nz)

where the sizes follow :func:`split_sizes` (the first ``n % P`` ranks hold one
extra plane). Its Fourier-space block (the *transposed* layout the forward
transform leaves behind, and the inverse takes) is

    kx in [0, nx) (whole), ky block r0 of ny over P0, kz block r1 of nz//2+1 over P1.

Tensors keep the dimension order ``(..., x, y, z)`` in both spaces; only which
axes are split changes. A 1 x 1 grid is the plain local transform.

Algorithm (forward): rfft along z; all-to-all over grid axis 1 (gather y, split
kz); fft along y; all-to-all over grid axis 0 (gather x, split ky); fft along x.
The inverse runs the same steps backwards with ``1/N`` normalisation. Each
all-to-all moves one contiguous block per peer (``pack_blocks`` ->
``_all_to_all`` -> ``unpack_blocks``, all C++/CUDA ops), and bytes moved per
rank per transpose are ``local block bytes * (P - 1) / P``.

Failures. Every collective is bounded by its process group's timeout: a rank
that raised or died makes the others raise a ``torch.distributed.DistBackendError``
naming the group once the timeout expires (or as soon as gloo sees the peer's
socket close). Set it where the groups are made:
``torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=60))``
or ``process_grid_groups(grid, timeout=...)``.
"""

from __future__ import annotations

import datetime
import math
from typing import Sequence

import torch
import torch.nn.functional as F

from ._ops import all_to_all, pack_blocks, unpack_blocks

__all__ = ["PencilDecomposition", "split_sizes", "process_grid_groups"]


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` consecutive blocks of ``n`` planes: the first ``n % parts`` get one more."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


def process_grid_groups(
    grid: Sequence[int],
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
):
    """Create the two process groups of a ``(P0, P1)`` grid over the default world.

    World rank ``r0 * P1 + r1`` gets grid coordinates ``(r0, r1)``. Every rank of
    the world must call this with the same arguments (``new_group`` is
    collective). Returns ``(group_axis0, group_axis1)`` for the calling rank; an
    axis of size 1 gets ``None`` (no communication along it).

    Args:
        grid: ``(P0, P1)`` with ``P0 * P1 == world size``.
        backend: passed to ``new_group`` (default: the world's backend).
        timeout: bound on every collective of these groups (default: the world's).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "process_grid_groups: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (or build a PencilDecomposition "
            "without groups for a single process)"
        )
    p0, p1 = (int(p) for p in grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    if p0 < 1 or p1 < 1 or p0 * p1 != world:
        raise ValueError(f"process_grid_groups: `grid` {tuple(grid)} must multiply to the world size {world}")
    r0, r1 = divmod(rank, p1)
    group0 = group1 = None
    kwargs = {"backend": backend, "timeout": timeout}
    if p0 > 1:
        for column in range(p1):
            g = dist.new_group([row * p1 + column for row in range(p0)], **kwargs)
            if column == r1:
                group0 = g
    if p1 > 1:
        for row in range(p0):
            g = dist.new_group([row * p1 + column for column in range(p1)], **kwargs)
            if row == r0:
                group1 = g
    return group0, group1


class _GridAxis:
    """One axis of the process grid: its group (None for size 1), size and our rank in it."""

    def __init__(self, group, axis):
        self.group = group
        if group is None:
            self.size, self.rank, self.name = 1, 0, None
        else:
            import torch.distributed as dist

            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            self.name = group.group_name
            if self.rank < 0:
                raise ValueError(f"PencilDecomposition: this process is not a member of the group of grid axis {axis}")


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
        always_transpose: run the staged pipeline (1-D FFTs, pack, all-to-all,
            unpack) even on grid axes of size 1 that have a group. Only for
            measuring or testing the transposer on one process; the default
            skips every step that moves nothing.

    Attributes (all plain tuples of ints):
        global_shape, grid_shape ``(P0, P1)``, grid_coords ``(r0, r1)``,
        local_real_shape / local_real_offset: this rank's real block,
        fourier_shape ``(nx, ny, nz // 2 + 1)``,
        local_fourier_shape / local_fourier_offset: this rank's Fourier block.

    Every method that communicates is collective over the grid's groups: all
    ranks must call it in the same order with tensors of the same leading shape.
    """

    def __init__(self, global_shape: Sequence[int], groups=None, *, mesh=None, always_transpose: bool = False):
        try:
            shape = tuple(int(n) for n in global_shape)
        except TypeError:
            raise ValueError(f"PencilDecomposition: `global_shape` must be 3 integers, got {global_shape!r}") from None
        if len(shape) != 3 or any(n < 1 for n in shape):
            raise ValueError(f"PencilDecomposition: `global_shape` must be 3 positive integers, got {shape}")
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
        self._axes = (_GridAxis(groups[0], 0), _GridAxis(groups[1], 1))
        self._staged = bool(always_transpose) and all(axis.group is not None for axis in self._axes)
        if always_transpose and not self._staged:
            raise ValueError("PencilDecomposition: `always_transpose` needs a process group on both grid axes")
        p0, p1 = self.grid_shape
        nx, ny, nz = shape
        nzc = nz // 2 + 1
        for what, n, p in (("nx", nx, p0), ("ny", ny, p1), ("ny", ny, p0), ("nz // 2 + 1", nzc, p1)):
            if n < p:
                raise ValueError(
                    f"PencilDecomposition: mesh {shape} is too small for the {p0} x {p1} process grid: "
                    f"{what} = {n} must be at least {p} so that every rank owns at least one plane; "
                    "use a larger mesh or fewer ranks along that grid axis"
                )
        self.global_shape = shape
        self.fourier_shape = (nx, ny, nzc)
        # Block sizes along each split axis, per grid coordinate.
        self._real_x = split_sizes(nx, p0)
        self._real_y = split_sizes(ny, p1)
        self._fourier_y = split_sizes(ny, p0)
        self._fourier_z = split_sizes(nzc, p1)
        self.local_real_shape, self.local_real_offset = self.real_block(self.grid_coords)
        self.local_fourier_shape, self.local_fourier_offset = self.fourier_block(self.grid_coords)

    # ------------------------------------------------------------------ layout

    @property
    def grid_shape(self) -> tuple[int, int]:
        return (self._axes[0].size, self._axes[1].size)

    @property
    def grid_coords(self) -> tuple[int, int]:
        return (self._axes[0].rank, self._axes[1].rank)

    @property
    def is_local(self) -> bool:
        """True for a 1 x 1 grid: no communication at all."""
        return self.grid_shape == (1, 1)

    def real_block(self, coords: Sequence[int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``(shape, offset)`` of the real-space block of the rank at grid ``coords``."""
        r0, r1 = self._check_coords(coords)
        shape = (self._real_x[r0], self._real_y[r1], self.global_shape[2])
        offset = (_offsets(self._real_x)[r0], _offsets(self._real_y)[r1], 0)
        return shape, offset

    def fourier_block(self, coords: Sequence[int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``(shape, offset)`` of the Fourier-space block (transposed layout) at grid ``coords``."""
        r0, r1 = self._check_coords(coords)
        shape = (self.global_shape[0], self._fourier_y[r0], self._fourier_z[r1])
        offset = (0, _offsets(self._fourier_y)[r0], _offsets(self._fourier_z)[r1])
        return shape, offset

    def _check_coords(self, coords):
        r0, r1 = (int(c) for c in coords)
        p0, p1 = self.grid_shape
        if not (0 <= r0 < p0 and 0 <= r1 < p1):
            raise ValueError(f"PencilDecomposition: grid coordinates {tuple(coords)} outside the {p0} x {p1} grid")
        return r0, r1

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
        real-to-complex axis; the Nyquist entry of an even axis is ``-pi``),
        restricted to the local block and shaped ``(lx, 1, 1)``, ``(1, ly, 1)``,
        ``(1, 1, lz)`` so that they broadcast against the local complex tensor
        ``(..., lx, ly, lz)``. Computed in float64, then cast to ``dtype``.
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

    # --------------------------------------------------------------- transforms

    def rfftn(self, field: torch.Tensor) -> torch.Tensor:
        """Distributed forward real-to-complex 3-D DFT, unnormalised.

        ``field``: real ``(..., *local_real_shape)`` (float32 or float64).
        Returns complex ``(..., *local_fourier_shape)``: this rank's block of
        ``torch.fft.rfftn(whole_field, dim=(-3, -2, -1))`` in the transposed
        layout. Differentiable; the backward is collective.
        """
        self._check_trailing(field, self.local_real_shape, "field", "rfftn")
        if field.is_complex() or not field.is_floating_point():
            raise ValueError(f"PencilDecomposition.rfftn: expected a real floating `field`, got {field.dtype}")
        # Staged mode takes the general path, as if both grid axes were split.
        p0, p1 = (2, 2) if self._staged else self.grid_shape
        if p0 == 1 and p1 == 1:
            return torch.fft.rfftn(field, dim=(-3, -2, -1))
        if p1 == 1:
            t = torch.fft.rfftn(field, dim=(-2, -1))
        else:
            t = torch.fft.rfft(field, dim=-1)
            t = self._transpose(t, 1, gather_dim=-2, gather_sizes=self._real_y,
                                split_dim=-1, split_sizes=self._fourier_z)
            if p0 == 1:
                return torch.fft.fftn(t, dim=(-3, -2))
            t = torch.fft.fft(t, dim=-2)
        t = self._transpose(t, 0, gather_dim=-3, gather_sizes=self._real_x,
                            split_dim=-2, split_sizes=self._fourier_y)
        return torch.fft.fft(t, dim=-3)

    def irfftn(self, field_k: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rfftn` (``1/N`` normalised, ``N = nx ny nz``).

        ``field_k``: complex ``(..., *local_fourier_shape)`` in the transposed
        layout. Returns real ``(..., *local_real_shape)``: this rank's block of
        ``torch.fft.irfftn(whole_field_k, s=global_shape)``. Differentiable.
        """
        self._check_trailing(field_k, self.local_fourier_shape, "field_k", "irfftn")
        if not field_k.is_complex():
            raise ValueError(f"PencilDecomposition.irfftn: expected a complex `field_k`, got {field_k.dtype}")
        nx, ny, nz = self.global_shape
        # Staged mode takes the general path, as if both grid axes were split.
        p0, p1 = (2, 2) if self._staged else self.grid_shape
        if p0 == 1 and p1 == 1:
            return torch.fft.irfftn(field_k, s=(nx, ny, nz), dim=(-3, -2, -1))
        if p0 > 1:
            t = torch.fft.ifft(field_k, dim=-3)
            t = self._transpose(t, 0, gather_dim=-2, gather_sizes=self._fourier_y,
                                split_dim=-3, split_sizes=self._real_x)
            if p1 == 1:
                return torch.fft.irfftn(t, s=(ny, nz), dim=(-2, -1))
            t = torch.fft.ifft(t, dim=-2)
        else:
            t = torch.fft.ifftn(field_k, dim=(-3, -2))
        t = self._transpose(t, 1, gather_dim=-1, gather_sizes=self._fourier_z,
                            split_dim=-2, split_sizes=self._real_y)
        return torch.fft.irfft(t, n=nz, dim=-1)

    def _transpose(self, t, axis, *, gather_dim, gather_sizes, split_dim, split_sizes):
        """All-to-all over grid ``axis``: ``gather_dim`` becomes whole, ``split_dim`` split.

        Input: ``gather_dim`` holds block ``me`` of ``gather_sizes``, ``split_dim``
        is whole. Output: ``gather_dim`` whole, ``split_dim`` holds block ``me``
        of ``split_sizes``. A permutation of the global data, so its adjoint is
        the reverse transpose (autograd gets it from the three ops).
        """
        grid_axis = self._axes[axis]
        if grid_axis.size == 1 and not self._staged:
            return t
        me = grid_axis.rank
        rest = t.numel() // (t.shape[gather_dim] * t.shape[split_dim])
        send = pack_blocks(t, split_dim, split_sizes)
        send_counts = [rest * gather_sizes[me] * s for s in split_sizes]
        receive_counts = [rest * g * split_sizes[me] for g in gather_sizes]
        received = all_to_all(send, send_counts, receive_counts, grid_axis.name)
        shape = list(t.shape)
        shape[gather_dim] = sum(gather_sizes)
        shape[split_dim] = split_sizes[me]
        return unpack_blocks(received, shape, gather_dim, gather_sizes)

    def transpose(self, t: torch.Tensor, axis: int, inverse: bool = False) -> torch.Tensor:
        """One transpose step of the FFT, exposed for tests and custom pipelines.

        ``axis = 1``: ``(..., lx, ly, nzc)`` (y split over grid axis 1) ->
        ``(..., lx, ny, lzc)`` (kz split). ``axis = 0``: ``(..., lx, ny, lzc)``
        (x split over grid axis 0) -> ``(..., nx, lky, lzc)``. ``inverse`` undoes it.
        Works on any dtype.
        """
        if axis == 1:
            pair = ((-2, self._real_y), (-1, self._fourier_z))
        elif axis == 0:
            pair = ((-3, self._real_x), (-2, self._fourier_y))
        else:
            raise ValueError(f"PencilDecomposition.transpose: `axis` must be 0 or 1, got {axis!r}")
        (gd, gs), (sd, ss) = reversed(pair) if inverse else pair
        if t.dim() < 3:
            raise ValueError(f"PencilDecomposition.transpose: expected at least 3 dimensions, got {tuple(t.shape)}")
        if t.shape[gd] != gs[self._axes[axis].rank] or t.shape[sd] != sum(ss):
            raise ValueError(
                f"PencilDecomposition.transpose: tensor of shape {tuple(t.shape)} does not match the layout "
                f"expected before {'inverse ' if inverse else ''}transpose {axis} (dim {gd} = "
                f"{gs[self._axes[axis].rank]}, dim {sd} = {sum(ss)})"
            )
        return self._transpose(t, axis, gather_dim=gd, gather_sizes=gs, split_dim=sd, split_sizes=ss)

    # ------------------------------------------------------------------- halos

    def halo_shape(self, width) -> tuple[int, int, int]:
        """Local real block shape with a halo of ``width`` on x and y (see :meth:`fill_halo`)."""
        lo, hi = self._check_width(width)
        lx, ly, nz = self.local_real_shape
        return (lx + lo + hi, ly + lo + hi, nz)

    def pad_halo(self, field: torch.Tensor, width) -> torch.Tensor:
        """Zero-pad a local block ``(..., lx, ly, nz)`` with the halo of ``width`` on x and y."""
        lo, hi = self._check_width(width)
        self._check_trailing(field, self.local_real_shape, "field", "pad_halo")
        return F.pad(field, (0, 0, lo, hi, lo, hi))

    def strip_halo(self, field: torch.Tensor, width) -> torch.Tensor:
        """The interior ``(..., lx, ly, nz)`` (a view) of a haloed block."""
        lo, hi = self._check_width(width)
        self._check_trailing(field, self.halo_shape(width), "field", "strip_halo")
        lx, ly, _ = self.local_real_shape
        return field[..., lo : lo + lx, lo : lo + ly, :]

    def fill_halo(self, field: torch.Tensor, width) -> torch.Tensor:
        """Periodic halo fill along x and y: copy the neighbours' edge planes into my halo.

        ``field``: ``(..., lx + lo + hi, ly + lo + hi, nz)``, the local block with
        ``lo`` halo planes below and ``hi`` above on x and y (``width`` is an int
        for ``lo = hi`` or a pair ``(lo, hi)``); global index ``i`` of the block
        sits at padded index ``i - offset + lo``. Returns a new tensor whose
        halo holds the periodic neighbours' values, corners included (x then y,
        the y step carrying the x halo along); the interior is unchanged and the
        input halo is ignored. Axes of grid size 1 wrap onto themselves. z is
        never split and gets no halo. Needs ``lo, hi <= `` every block's size.
        Differentiable; its adjoint is :meth:`add_halo`.
        """
        lo, hi = self._check_width(width)
        self._check_trailing(field, self.halo_shape(width), "field", "fill_halo")
        field = self._fill_axis(field, 0, -3, lo, hi)
        return self._fill_axis(field, 1, -2, lo, hi)

    def add_halo(self, field: torch.Tensor, width) -> torch.Tensor:
        """Periodic halo add along x and y: add my halo into the neighbours' edge planes.

        The adjoint of :meth:`fill_halo` (same shapes and ``width``): each halo
        cell's value is added to the interior cell of the neighbour (corners:
        the diagonal neighbour) that owns it, and the returned halo is zero.
        Painting into a haloed block then calling this gives the painted local
        block. Differentiable; its adjoint is :meth:`fill_halo`.
        """
        lo, hi = self._check_width(width)
        self._check_trailing(field, self.halo_shape(width), "field", "add_halo")
        field = self._add_axis(field, 1, -2, lo, hi)
        return self._add_axis(field, 0, -3, lo, hi)

    def _check_width(self, width):
        if isinstance(width, int):
            lo = hi = width
        else:
            try:
                lo, hi = (int(w) for w in width)
            except (TypeError, ValueError):
                raise ValueError(f"halo `width` must be an int or a pair (lo, hi), got {width!r}") from None
        smallest = min(min(self._real_x), min(self._real_y))
        if lo < 0 or hi < 0 or max(lo, hi) > smallest:
            raise ValueError(
                f"halo `width` ({lo}, {hi}) must be non-negative and at most the smallest block size "
                f"{smallest} along x and y (a halo must come from one neighbour)"
            )
        return lo, hi

    def _exchange_neighbours(self, axis, to_left, to_right):
        """Send ``to_left`` to the previous rank and ``to_right`` to the next (periodic).

        Returns ``(from_right, from_left)``: what the next rank sent left and
        what the previous rank sent right. One all-to-all carries both, with
        empty blocks for every other peer.
        """
        grid_axis = self._axes[axis]
        size, me = grid_axis.size, grid_axis.rank
        if size == 1:
            return to_left, to_right
        left, right = (me - 1) % size, (me + 1) % size
        send_counts, receive_counts = [0] * size, [0] * size
        send_counts[left] += to_left.numel()
        send_counts[right] += to_right.numel()
        # Neighbours share every dimension but the exchanged one; peer blocks hold
        # [piece for its left, piece for its right], so with two ranks (left ==
        # right) the block from the peer is [my "from right", my "from left"].
        receive_counts[right] += to_left.numel()
        receive_counts[left] += to_right.numel()
        pieces = [None] * size
        pieces[left] = [to_left.reshape(-1)]
        if right == left:
            pieces[left].append(to_right.reshape(-1))
        else:
            pieces[right] = [to_right.reshape(-1)]
        send = torch.cat([piece for peer in pieces if peer for piece in peer])
        received = all_to_all(send, send_counts, receive_counts, grid_axis.name)
        start_right = sum(receive_counts[:right])
        from_right = received.narrow(0, start_right, to_left.numel()).view(to_left.shape)
        start_left = sum(receive_counts[:left]) + (to_left.numel() if left == right else 0)
        from_left = received.narrow(0, start_left, to_right.numel()).view(to_right.shape)
        return from_right, from_left

    def _fill_axis(self, field, axis, dim, lo, hi):
        n = field.shape[dim] - lo - hi
        interior = field.narrow(dim, lo, n)
        from_right, from_left = self._exchange_neighbours(
            axis, interior.narrow(dim, 0, hi).contiguous(), interior.narrow(dim, n - lo, lo).contiguous()
        )
        return torch.cat([from_left, interior, from_right], dim)

    def _add_axis(self, field, axis, dim, lo, hi):
        n = field.shape[dim] - lo - hi
        interior = field.narrow(dim, lo, n)
        from_right, from_left = self._exchange_neighbours(
            axis, field.narrow(dim, 0, lo).contiguous(), field.narrow(dim, lo + n, hi).contiguous()
        )
        # The next rank's low halo lands on my last `lo` planes, the previous
        # rank's high halo on my first `hi` planes.
        interior = interior + _pad_along(from_right, dim, n - lo, 0) + _pad_along(from_left, dim, 0, n - hi)
        zeros_lo = field.new_zeros(_replace(field.shape, dim, lo))
        zeros_hi = field.new_zeros(_replace(field.shape, dim, hi))
        return torch.cat([zeros_lo, interior, zeros_hi], dim)

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


def _replace(shape, dim, value):
    shape = list(shape)
    shape[dim] = value
    return shape


def _pad_along(t, dim, before, after):
    """Zero-pad ``t`` along a negative ``dim`` (F.pad counts from the last dimension)."""
    pad = [0, 0] * (-dim - 1) + [before, after]
    return F.pad(t, pad)
