"""Block layout arithmetic of a mesh split over a ``(P0, P1)`` process grid.

Pure integer bookkeeping, no communication. The global mesh ``(nx, ny, nz)`` is
split along x over grid axis 0 and along y over grid axis 1; z is never split.
Uneven sizes are allowed: the first ``n % P`` blocks hold one extra plane.

Real space, rank ``(r0, r1)``: ``x in [ox, ox + lx)``, ``y in [oy, oy + ly)``, all z.
Fourier space (the *transposed* layout the forward FFT leaves):
``kx`` whole, ``ky`` block ``r0`` of ``ny`` over ``P0``, ``kz`` block ``r1`` of
``nz // 2 + 1`` over ``P1``.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["split_sizes", "split_offsets", "BlockLayout", "balanced_grid"]


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` consecutive blocks of ``n`` planes: the first ``n % parts`` get one more."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def split_offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each block: the exclusive prefix sums of ``sizes``."""
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


def balanced_grid(world_size: int, shapes: Sequence[Sequence[int]] = (), reach=0) -> tuple[int, int]:
    """The most square ``(P0, P1)`` with ``P0 * P1 == world_size`` and ``P0 >= P1``.

    Slabs (``P1 = 1``) for a prime world size; ``(2, 2)`` for 4, ``(4, 2)`` for 8.

    With ``shapes`` (global meshes, e.g. the particle grid and the force mesh), the most
    square grid that can split every one of them: each rank owning at least one plane of
    every block and, along a split axis, at least ``reach`` planes (a paint stencil's
    reach; one int for every mesh, or one per mesh); the grids are tried from the most square, ``P0 >= P1`` before ``P0 < P1``
    (``(4, 1)`` for 4 ranks and a mesh with ``ny = 1``). When none fits, the most square
    one, whose construction then says why.
    """
    world_size = int(world_size)
    if world_size < 1:
        raise ValueError(f"the world size must be positive, got {world_size}")
    pairs = [(world_size // d, d) for d in range(1, world_size + 1) if world_size % d == 0]
    # most square first; of two equally square grids, P0 >= P1 first
    pairs.sort(key=lambda p: (max(p) / min(p), p[0] < p[1]))
    reaches = [int(reach)] * len(shapes) if isinstance(reach, int) else [int(r) for r in reach]
    for p0, p1 in pairs:
        fits = True
        for shape, reach in zip(shapes, reaches):
            try:
                layout = BlockLayout(shape, (p0, p1))
            except ValueError:
                fits = False
                break
            for parts, sizes in ((p0, layout.real_x), (p1, layout.real_y)):
                if parts > 1 and min(sizes) < reach:
                    fits = False
        if fits:
            return p0, p1
    return pairs[0]


class BlockLayout:
    """Where every rank's real and Fourier blocks lie, for one global shape and grid.

    Args:
        global_shape: ``(nx, ny, nz)``.
        grid_shape: ``(P0, P1)``.
    """

    def __init__(self, global_shape: Sequence[int], grid_shape: Sequence[int]):
        nx, ny, nz = (int(n) for n in global_shape)
        p0, p1 = (int(p) for p in grid_shape)
        nzc = nz // 2 + 1
        for what, n, p in (("nx", nx, p0), ("ny", ny, p1), ("ny", ny, p0), ("nz // 2 + 1", nzc, p1)):
            if n < p:
                raise ValueError(
                    f"PencilDecomposition: mesh {(nx, ny, nz)} is too small for the {p0} x {p1} process grid: "
                    f"{what} = {n} must be at least {p} so that every rank owns at least one plane; "
                    "use a larger mesh or fewer ranks along that grid axis"
                )
        self.global_shape = (nx, ny, nz)
        self.grid_shape = (p0, p1)
        self.fourier_shape = (nx, ny, nzc)
        self.real_x = split_sizes(nx, p0)
        self.real_y = split_sizes(ny, p1)
        self.fourier_y = split_sizes(ny, p0)
        self.fourier_z = split_sizes(nzc, p1)

    def check_coords(self, coords) -> tuple[int, int]:
        r0, r1 = (int(c) for c in coords)
        p0, p1 = self.grid_shape
        if not (0 <= r0 < p0 and 0 <= r1 < p1):
            raise ValueError(f"PencilDecomposition: grid coordinates {tuple(coords)} outside the {p0} x {p1} grid")
        return r0, r1

    def real_block(self, coords) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``(shape, offset)`` of the real-space block at grid ``coords``."""
        r0, r1 = self.check_coords(coords)
        shape = (self.real_x[r0], self.real_y[r1], self.global_shape[2])
        offset = (split_offsets(self.real_x)[r0], split_offsets(self.real_y)[r1], 0)
        return shape, offset

    def fourier_block(self, coords) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``(shape, offset)`` of the Fourier-space block (transposed layout) at grid ``coords``."""
        r0, r1 = self.check_coords(coords)
        shape = (self.global_shape[0], self.fourier_y[r0], self.fourier_z[r1])
        offset = (0, split_offsets(self.fourier_y)[r0], split_offsets(self.fourier_z)[r1])
        return shape, offset

    def owner(self, index: torch.Tensor, axis: int) -> torch.Tensor:
        """Grid coordinate along grid ``axis`` (0: x, 1: y) owning global plane ``index``.

        ``index``: integer tensor of planes in ``[0, n)``. Returns a tensor of the same
        shape with values in ``[0, P)``.
        """
        sizes = self.real_x if axis == 0 else self.real_y
        if len(sizes) == 1:
            return torch.zeros_like(index)
        # Block r starts at offsets[r]; the owner is the last block starting at or before index.
        starts = torch.tensor(split_offsets(sizes)[1:], dtype=index.dtype, device=index.device)
        return torch.bucketize(index, starts, right=True)
