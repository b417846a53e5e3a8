"""Friends-of-friends (FoF) halos of a particle snapshot, on one device or a process grid.

Two particles are *friends* when their periodic (minimum-image) distance is at most
``b = linking_length * (V / N)^(1/3)`` (``V`` the box volume, ``N`` the number of
particles of one batch member over all ranks); a FoF group is a connected component of
the friendship graph. :func:`friends_of_friends` labels every particle with its group's
smallest particle id (``-1`` for an empty slot or a group smaller than
``min_members``), exactly: the components of the graph "distance <= b", the distances
computed in float64 from the positions as given.

Method (torch only, on whatever device the positions are; benchmarks/RESULTS.md,
section 15, has the measurements behind these choices):

- a cell list with ``floor(L_i / b)`` cells per axis (cells at least ``b`` wide, at
  least 3 per axis, so ``b`` may be at most a third of the shortest side; wider cells
  when ``b`` is so small next to the mean separation that there would be more than 128
  cells per particle); particles are sorted by cell;
- the 13 forward neighbours of each occupied cell (a half shell, so each pair of cells
  once) are read from a dense table of cell numbers that covers a slab of x-planes at a
  time (at most 32 entries per particle), padded in z with the periodic images so that
  a cell's 3 neighbours along z are consecutive: gathers, no search;
- the pairs of neighbouring cells are linked in 5 rounds (z, y, diagonal y, x, the other
  x neighbours); from the second on, a pair of cells whose particles are already all in
  one group is skipped (most pairs inside a halo). The candidate particle pairs of the
  remaining cells are expanded from a running count (``repeat_interleave``),
  ``chunk_size`` at a time, so memory stays bounded however clustered the
  particles are (one cell of ``n`` particles makes ``n (n - 1) / 2`` candidates: time
  grows, memory does not);
- distances are first computed in float32; a pair is decided there when its squared
  distance is clear of ``b^2`` by more than the float32 rounding can move it (a bound
  from the box size), and otherwise in float64, as before;
- the linked pairs are merged into a forest by min-label hooking
  (``scatter_reduce(amin)``: each root points to the smallest root linked to it) with
  pointer jumping, until every pair has one root; the root of a group is its smallest
  node, and the group's label is the smallest id over its members.

Few, large torch operations (about 3000 per call at 64^3 particles): on a CPU whose
cores are shared, each parallel operation may wait for a descheduled thread.

Memory: about 400 B per particle (positions in float64 and float32, the cell order, the
cell table, the pairs of neighbouring occupied cells, the forest) plus about 100 B per
candidate pair of a chunk (``chunk_size`` pairs, default ``2^20``: about 100 MB);
measured peaks are in benchmarks/RESULTS.md, section 15.

Process grid (``mesh`` a distributed :class:`~torchpm.distributed.PencilDecomposition`,
e.g. ``sim.force_mesh``): each rank holds some particles (empty slots have id ``-1``).
A particle is copied (a *ghost*) to every other rank whose block, widened by ``b`` along
the split axes x and y, contains it (one migration with explicit destinations, so a
particle may be a ghost of several ranks); each rank finds the groups of its own
particles and ghosts once, then the ranks exchange labels between each particle and
its ghosts (the migration plan's ``exchange`` and ``gather``), taking the smallest
label on each local group, until an all-reduced "changed" flag is 0. Every friendship
lies inside some rank's particles and ghosts (the rank owning one of the two
positions), so the labels equal the one-device labels for the same particles. Extra
memory on a rank: its ghosts (about a fraction ``2 b / w`` of its particles per split
axis, ``w`` the block's width) and a ``(B, n, P)`` bool mask choosing them (``P`` ranks).
Each round of the exchange is one pass of the plan each way and one all-reduce; a
group's label crosses up to two block faces per round.

:func:`halo_catalog` turns labels into a catalogue (members, mass, centre of mass with
the periodic wrap handled, mean velocity), sorted by mass; on a process grid the
per-halo sums are all-reduced so every rank holds the whole catalogue (the replicated
convention of :func:`torchpm.analysis.power_spectrum`: a catalogue is a few numbers per
halo, small next to the particles, and every rank can then sort and use it alike).
:func:`find_halos` does both for a :class:`~torchpm.Simulation`'s state.
:func:`spherical_overdensity` (and :func:`spherical_overdensity_masses` for a run's
catalogue) gives ``M_Delta`` and ``R_Delta`` about given centres, and
:func:`mass_function` / :func:`mass_function_theory` the measured and fitted mass
functions.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .distributed.particles import duplicate_ids_error, route_rows
from .mesh import as_box_size

__all__ = ["HaloCatalog", "friends_of_friends", "halo_catalog", "find_halos", "linking_distance", "MassFunction",
           "mass_function", "mass_function_theory", "MASS_FUNCTION_MODELS", "SphericalOverdensity",
           "spherical_overdensity", "spherical_overdensity_masses"]

DEFAULT_CHUNK_SIZE = 1 << 20
# Positions may be this many box lengths from the box (wrapped into it in float64, a
# coordinate then keeps about 1e-10 of a box length).
_IMAGES = 1e6
# Hubble units: the critical density today is 27.7536627e10 (Msun/h) / (Mpc/h)^3.
CRITICAL_DENSITY_MSUN = 27.7536627e10
_NO_LABEL = torch.iinfo(torch.int64).max
# The cell table (cell number by cell position) covers a slab of x-planes at a time, at
# most this many entries per point (int32: 128 B per point); and the cell grid has at most
# about this many cells per point (see _cell_grid).
_TABLE_ENTRIES_PER_POINT = 32
_CELLS_PER_POINT = 128
# The cell table is filled and read for slabs of about this many occupied cells (larger
# slabs: fewer operations; smaller: work arrays that stay in the cache).
_SLAB_CELLS = 1 << 18
# The candidate pairs' index arithmetic is int32 (half the memory traffic) while every
# point index and every block's pair count is below this; int64 otherwise (two crowded
# neighbouring cells of 46 341 points each hold 2^31 pairs).
_INT32_LIMIT = 2**31


class HaloCatalog(NamedTuple):
    """FoF halos of each batch member, heaviest first (ties: smaller label first).

    Members with fewer halos than the longest list are padded: label ``-1``, members 0,
    mass 0, position and velocity 0.

    Attributes:
        labels: ``(B, H)`` int64, the group label (its smallest particle id).
        members: ``(B, H)`` int64, the number of particles.
        masses: ``(B, H)`` the sum of the member masses (the unit of ``particle_mass``).
        positions: ``(B, H, 3)`` centre of mass in Mpc/h, wrapped into the box; each
            member counts at its periodic image nearest to the group's smallest-id member.
        velocities: ``(B, H, 3)`` mass-weighted mean velocity, or None without velocities.
    """

    labels: torch.Tensor
    members: torch.Tensor
    masses: torch.Tensor
    positions: torch.Tensor
    velocities: torch.Tensor | None


def linking_distance(box_size, n_particles: int, linking_length: float = 0.2) -> float:
    """``b = linking_length * (V / n_particles)^(1/3)`` in Mpc/h."""
    box = as_box_size(box_size)
    return float(linking_length) * (math.prod(box) / int(n_particles)) ** (1.0 / 3.0)


# ----------------------------------------------------------------------------- checks


def _is_grid(mesh) -> bool:
    return mesh is not None and not getattr(mesh, "is_local", True)


def _positive_int(value, name, function) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{function}: `{name}` must be a positive integer, got {value!r}")
    return int(value)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _particles(function, positions, ids, distributed, box):
    """``positions`` as ``(B, N, 3)``, ``ids`` as ``(B, N)`` int64 (default ``arange``),
    whether the input had no batch axis; ValueError naming the bad argument. Positions
    may lie outside the box (they are wrapped), but within ``_IMAGES`` boxes of it: far
    beyond, wrapping them in float64 loses the digits that decide a link."""
    if not isinstance(positions, torch.Tensor) or not positions.is_floating_point() \
            or positions.dim() not in (2, 3) or positions.shape[-1] != 3:
        raise ValueError(f"{function}: `positions` must be a floating-point tensor of shape (B, N, 3) or (N, 3) "
                         f"in Mpc/h, got {_describe(positions)}")
    unbatched = positions.dim() == 2
    if unbatched:
        positions = positions.unsqueeze(0)
    if ids is None:
        if distributed:
            raise ValueError(f"{function}: on a process grid pass `ids` (each particle's id, unique over the ranks; "
                             "-1 for an empty slot), e.g. the state's ids")
        ids = torch.arange(positions.shape[1], device=positions.device).expand(positions.shape[0], -1)
    else:
        expected = tuple(positions.shape[:2])[unbatched:]
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or tuple(ids.shape) != expected:
            raise ValueError(f"{function}: `ids` must be an int64 tensor of shape {expected} (one per particle), "
                             f"got {_describe(ids)}")
        if ids.device != positions.device:
            raise ValueError(f"{function}: `ids` must be on the positions' device {positions.device}, got {ids.device}")
        if unbatched:
            ids = ids.unsqueeze(0)
    valid = ids >= 0
    # one pass settles the usual case (NaN compares false, inf is beyond reach)
    reach = torch.tensor(box, dtype=positions.dtype, device=positions.device) * _IMAGES
    if bool(((positions.detach().abs() <= reach).all(-1) | ~valid).all()):
        return positions, ids, unbatched
    finite = torch.isfinite(positions.detach()).all(-1) | ~valid
    if not bool(finite.all()):
        raise ValueError(f"{function}: `positions` must be finite, got {int((~finite).sum())} particles with NaN or "
                         "inf coordinates")
    far = (positions.detach().abs() > reach).any(-1) & valid
    if bool(far.any()):
        raise ValueError(f"{function}: `positions` must lie within {_IMAGES:g} box lengths of the box (Mpc/h; they "
                         f"are wrapped into it), got {int(far.sum())} particles beyond, e.g. "
                         f"{positions.detach()[far][0].tolist()}")
    return positions, ids, unbatched


def _check_unique_ids(function, ids):
    """ValueError when a batch member holds an id twice (on this rank)."""
    if ids.shape[1] < 2:
        return
    ordered = torch.sort(ids, dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(repeated.any()):
        member = int(repeated.any(1).nonzero()[0])
        value = int(ordered[member, 1:][repeated[member]][0])
        raise ValueError(f"{function}: `ids` must be unique within each batch member, got id {value} twice in "
                         f"member {member}")


# ------------------------------------------------------------------- local components


def _indices(mask: torch.Tensor) -> torch.Tensor:
    # (index_select with these is several times faster on the CPU than boolean indexing)
    return torch.nonzero(mask).reshape(-1)


def _find(parent: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """Roots of ``nodes`` in the forest ``parent``; points the nodes at them (path
    compression for the nodes asked)."""
    roots = parent.index_select(0, nodes)
    while True:
        up = parent.index_select(0, roots)
        if torch.equal(up, roots):
            break
        roots = up
    parent.index_copy_(0, nodes, roots)
    return roots


def _union(parent: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """Merge the trees of each pair ``(left[k], right[k])``: min-label hooking, each
    root pointed at the smallest root it is linked to (``parent[x] <= x`` throughout, so
    a tree's root is its smallest node), repeated until every pair has one root."""
    while left.numel():
        left, right = _find(parent, left), _find(parent, right)
        apart = _indices(left != right)
        if not apart.numel():
            break
        left, right = left.index_select(0, apart), right.index_select(0, apart)
        high, low = torch.maximum(left, right), torch.minimum(left, right)
        parent.scatter_reduce_(0, high, low, reduce="amin")


def _cell_grid(box, b: float, count: int, per_point: float = _CELLS_PER_POINT, least: int = 3) -> list[int]:
    """Cells per axis: at least ``b`` wide (so friends are in the same or neighbouring
    cells), at least ``least`` (FoF's 3: a cell's 26 neighbours are distinct), and at
    most about ``per_point`` per point in all (wider cells when ``b`` is tiny next to the
    mean separation: more candidate pairs, but no table of mostly empty cells)."""
    width = max(float(b), (math.prod(box) / (per_point * max(count, 1))) ** (1.0 / 3.0))
    # floor(L / b) >= 3 up to rounding (b <= L / 3 is checked); 3 cells per axis are
    # all neighbours of each other, so a cell a hair narrower than b is still safe.
    return [max(least, int(math.floor(length / width))) for length in box]


def _wrap_index(index: torch.Tensor, step: int, size: int) -> torch.Tensor:
    """``(index + step) mod size`` for ``step`` in -1, 0, 1 and ``0 <= index < size``."""
    if step > 0:
        return torch.where(index == size - 1, 0, index + 1)
    if step < 0:
        return torch.where(index == 0, size - 1, index - 1)
    return index


# The 13 forward neighbours (dx, dy, dz) of a cell (each unordered pair of neighbouring
# cells once), in the rounds in which their pairs of cells are linked. Linking in rounds
# lets a later round skip the pairs of cells whose points are all in one group already
# (most pairs inside a halo): first along z, then y, then x, so that each round's pairs
# mostly join what the earlier rounds made.
_ROUNDS = [[(0, 0, 1)], [(0, 1, 0)], [(0, 1, -1), (0, 1, 1)], [(1, 0, 0)],
           [(1, dy, dz) for dy in (-1, 0, 1) for dz in (-1, 0, 1) if (dy, dz) != (0, 0)]]


class _CellList:
    """Points sorted by cell (member, x, y, z), the occupied cells, and a dense table of
    cell numbers for a slab of x-planes at a time (see :meth:`neighbours`)."""

    def __init__(self, points: torch.Tensor, member: torch.Tensor, box, b: float):
        count = points.shape[0]
        device = points.device
        self.cells = nx, ny, nz = _cell_grid(box, b, count)
        lengths = torch.tensor(box, dtype=torch.float64, device=device)
        inside = torch.cat([points.amin(0) >= 0, points.amax(0) < lengths])
        # (x - L floor(x / L) is x itself for 0 <= x < L: skip the passes)
        wrapped = points if bool(inside.all()) else points - lengths * torch.floor(points / lengths)
        scale = torch.tensor([n / length for n, length in zip(self.cells, box)], dtype=torch.float64, device=device)
        coords = torch.floor(wrapped * scale).to(torch.int64)
        # (a coordinate that wrapped to exactly L after rounding belongs to the last cell)
        coords = torch.minimum(coords.clamp_(min=0), torch.tensor([n - 1 for n in self.cells], device=device))
        key = ((member * nx + coords[:, 0]) * ny + coords[:, 1]) * nz + coords[:, 2]
        self.planes = planes = (int(member.max()) + 1) * nx
        if planes * ny * nz < 2**31:
            key = key.to(torch.int32)  # sorts faster
        key, self.order = torch.sort(key)
        self.wrapped = wrapped.index_select(0, self.order)
        boundary = key[1:] != key[:-1]
        self.first = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), _indices(boundary) + 1])
        self.occupancy = torch.diff(self.first, append=torch.tensor([count], device=device))
        self.point_cell = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(boundary, 0)])
        cell_key = key.index_select(0, self.first).to(torch.int64)
        self.cell_z = torch.remainder(cell_key, nz)
        self.cell_y = torch.remainder(torch.div(cell_key, nz, rounding_mode="floor"), ny)
        self.cell_plane = torch.div(cell_key, ny * nz, rounding_mode="floor")
        self.plane_start = torch.searchsorted(self.cell_plane, torch.arange(planes + 1, device=device)).tolist()
        # The table: cell number + 1 (0: empty) at (slot, y, z + 1); slots 0..span-1 for a
        # slab's planes, `span` for the plane after it, `span + 1` for the first plane of
        # its member (the x-wrap); z padded with the periodic images of the end cells, so
        # that the 3 neighbours of a cell along z are 3 consecutive entries.
        self.row = nz + 2
        area = ny * self.row
        self.span = max(1, max(_TABLE_ENTRIES_PER_POINT * count, 3 * area) // area - 2)
        self.slabs = list(self._slabs(_SLAB_CELLS))
        planes_per_slab = max(high - low for low, high in self.slabs)
        self.table = torch.zeros((planes_per_slab + 2) * area, dtype=torch.int32, device=device)
        self.span = planes_per_slab
        self.index_dtype = torch.int32 if self.table.numel() < 2**31 else torch.int64
        offsets = [offset for group in _ROUNDS for offset in group]
        self.offset_dx, self.offset_dy, self.offset_dz = (
            torch.tensor(axis, device=device) for axis in zip(*offsets))
        self.offset_dz = self.offset_dz.to(self.index_dtype).unsqueeze(1)
        # each round's first offset, in the (offset, cell) order of the lookups
        self.round_start = torch.tensor([0] + [len(group) for group in _ROUNDS], device=device).cumsum(0)

    def _slabs(self, cells_per_slab: int):
        """``(low_plane, high_plane)`` of consecutive slabs of at most ``span`` planes,
        each with about ``cells_per_slab`` occupied cells (at least one plane)."""
        start, planes = self.plane_start, self.planes
        low = 0
        while low < planes:
            high = low + 1
            while high < planes and high - low < self.span and start[high + 1] - start[low] <= cells_per_slab:
                high += 1
            yield low, high
            low = high

    def neighbours(self, low_plane: int, high_plane: int):
        """The pairs ``(a, b)`` of occupied cells with ``a`` in the slab of planes
        ``[low_plane, high_plane)`` and ``b`` one of its forward neighbours: for each round
        of ``_ROUNDS``, two int64 tensors of cell numbers."""
        device = self.table.device
        nx, ny, nz = self.cells
        row, span, start = self.row, self.span, self.plane_start
        low_cell, high_cell = start[low_plane], start[high_plane]
        next_end = start[min(high_plane + 1, self.planes)]
        wrap_plane = (low_plane // nx) * nx
        wrap_low = wrap_high = 0
        if wrap_plane < low_plane and high_plane >= wrap_plane + nx:  # the slab holds its member's last plane
            wrap_low, wrap_high = start[wrap_plane], start[wrap_plane + 1]
        filled = torch.cat([torch.arange(low_cell, next_end, device=device),
                            torch.arange(wrap_low, wrap_high, device=device)])
        fill_plane, fill_z = self.cell_plane.index_select(0, filled), self.cell_z.index_select(0, filled)
        slot = torch.where(fill_plane >= low_plane, fill_plane - low_plane, span + 1)
        where = (slot * ny + self.cell_y.index_select(0, filled)) * row + fill_z + 1
        # the periodic images in z: the first cells again after the last, the last before the first
        low_z, high_z = _indices(fill_z == 0), _indices(fill_z == nz - 1)
        where = torch.cat([where, where.index_select(0, low_z) + nz, where.index_select(0, high_z) - nz])
        number = (filled + 1).to(torch.int32)
        self.table.index_copy_(0, where, torch.cat([number, number.index_select(0, low_z),
                                                    number.index_select(0, high_z)]))
        # The table position of each forward neighbour of each cell of the slab: (13, n).
        n = high_cell - low_cell
        own = self.cell_plane[low_cell:high_cell]
        ahead = torch.where(torch.remainder(own, nx) == nx - 1, own - (nx - 1), own + 1)
        slots = torch.stack([own - low_plane, torch.where(ahead >= low_plane, ahead - low_plane, span + 1)])
        y = self.cell_y[low_cell:high_cell]
        ys = torch.stack([_wrap_index(y, step, ny) for step in (-1, 0, 1)])
        columns = (slots.to(self.index_dtype) * ny).index_select(0, self.offset_dx) \
            + ys.to(self.index_dtype).index_select(0, self.offset_dy + 1)
        wanted = columns * row + (self.cell_z[low_cell:high_cell].to(self.index_dtype) + 1) + self.offset_dz
        hits = self.table.index_select(0, wanted.view(-1))
        self.table.index_fill_(0, where, 0)
        found = _indices(hits)  # ordered by offset, so by round
        bounds = torch.searchsorted(found, self.round_start * n).tolist()
        cell = torch.remainder(found, n) + low_cell
        other = hits.index_select(0, found).to(torch.int64) - 1
        return [(cell[bounds[r]:bounds[r + 1]], other[bounds[r]:bounds[r + 1]]) for r in range(len(_ROUNDS))]


def _local_groups(points: torch.Tensor, member: torch.Tensor, box, b: float, chunk_size: int) -> torch.Tensor:
    """The groups of ``K`` points (``(K, 3)`` float64 Mpc/h, ``member``: batch index of
    each; points of different members are never friends): ``(K,)`` int64, the smallest
    index of each point's group.

    Points are sorted by cell (member, x, y, z); the pairs of neighbouring occupied cells
    come from a dense table of cells, a slab of x-planes at a time
    (:meth:`_CellList.neighbours`); their candidate point pairs are tested and the friends
    merged into a forest in rounds, each round skipping the pairs of cells already wholly
    in one group."""
    count = points.shape[0]
    device = points.device
    parent = torch.arange(count, device=device)
    if count < 2:
        return parent
    grid = _CellList(points, member, box, b)
    first, occupancy, point_cell = grid.first, grid.occupancy, grid.point_cell
    rounds = [([], []) for _ in _ROUNDS]
    for low_plane, high_plane in grid.slabs:
        if grid.plane_start[low_plane] == grid.plane_start[high_plane]:
            continue
        for lists, pairs in zip(rounds, grid.neighbours(low_plane, high_plane)):
            for store, values in zip(lists, pairs):
                store.append(values)
    lengths = torch.tensor(box, dtype=torch.float64, device=device)
    link = dict(lengths=lengths, inverse_lengths=1.0 / lengths, b2=float(b) ** 2,
                chunk_size=chunk_size, near=_float32_bounds(box, b))
    wrapped = (grid.wrapped, grid.wrapped.to(torch.float32))
    for r, (cell_a, cell_b) in enumerate(rounds):
        cell_a, cell_b = torch.cat(cell_a), torch.cat(cell_b)
        if r > 0:
            parent = _flatten(parent)
            # Skip the pairs of cells all of whose points are in one and the same group.
            cell_root = parent.index_select(0, first)
            uniform = torch.ones_like(cell_root, dtype=torch.bool)
            uniform[point_cell.index_select(0, _indices(parent != cell_root.index_select(0, point_cell)))] = False
            needed = _indices(~(uniform.index_select(0, cell_a) & uniform.index_select(0, cell_b)
                                & (cell_root.index_select(0, cell_a) == cell_root.index_select(0, cell_b))))
            cell_a, cell_b = cell_a.index_select(0, needed), cell_b.index_select(0, needed)
        blocks = [first.index_select(0, cell_a), occupancy.index_select(0, cell_a),
                  first.index_select(0, cell_b), occupancy.index_select(0, cell_b)]
        if r == 0:
            # and each point of a crowded cell against the points after it in its cell
            crowded = _indices(occupancy.index_select(0, point_cell) > 1)
            after = (first + occupancy).index_select(0, point_cell.index_select(0, crowded)) - crowded - 1
            blocks = [torch.cat(pair) for pair in zip([crowded, torch.ones_like(crowded), crowded + 1, after], blocks)]
        _link_blocks(parent, wrapped, *blocks, **link)
    parent = _flatten(parent)
    # Back from the cell order to the points' order.
    order = grid.order
    return torch.empty_like(parent).index_copy_(0, order, order.index_select(0, parent))


def _flatten(parent: torch.Tensor) -> torch.Tensor:
    """Every node of the forest pointed at its root (pointer jumping until nothing changes)."""
    while True:
        up = parent.index_select(0, parent)
        if torch.equal(up, parent):
            return parent
        parent = up


def _link_blocks(parent, wrapped, first_a, width_a, first_b, width_b, *, near, lengths, inverse_lengths, b2,
                 chunk_size) -> None:
    """Test the point pairs ``(i, j)``, ``i`` in ``first_a[k] + [0, width_a[k])`` and ``j``
    in ``first_b[k] + [0, width_b[k])``, ``chunk_size`` at a time, and merge the friends'
    trees.

    ``wrapped``: the points in float64 and in float32; ``near``: the float32 squared
    distances below which a pair is surely linked and above which it surely is not
    (:func:`_float32_bounds`); the pairs in between are decided in float64, as
    ``d_x^2 + d_y^2 + d_z^2 <= b^2`` from the float64 minimum-image differences."""
    device = parent.device
    points, points32 = wrapped
    surely, maybe = near
    lengths32, inverse_lengths32 = lengths.float(), inverse_lengths.float()
    sizes = width_a * width_b
    ends = torch.cumsum(sizes, 0)
    total = int(ends[-1]) if ends.numel() else 0
    starts = ends - sizes
    index_dtype = torch.int32
    if parent.numel() >= _INT32_LIMIT or (sizes.numel() and int(sizes.max()) >= _INT32_LIMIT):
        index_dtype = torch.int64
    first_a, first_b, width_b = (t.to(index_dtype) for t in (first_a, first_b, width_b))
    for low in range(0, total, chunk_size):
        high = min(low + chunk_size, total)
        if low == 0 and high == total:
            lower, upper = 0, ends.numel()
        else:
            lower, upper = torch.searchsorted(ends, torch.tensor([low, high - 1], device=device), right=True).tolist()
            upper += 1
        counts = ends[lower:upper].clamp(max=high) - starts[lower:upper].clamp(min=low)
        which = torch.repeat_interleave(torch.arange(lower, upper, dtype=torch.int32, device=device), counts,
                                        output_size=high - low)
        within = (torch.arange(low, high, device=device) - starts.index_select(0, which)).to(index_dtype)
        width = width_b.index_select(0, which)
        row = torch.div(within, width, rounding_mode="floor")
        i = first_a.index_select(0, which) + row
        j = first_b.index_select(0, which) + (within - row * width)
        d = points32.index_select(0, i) - points32.index_select(0, j)
        d = d - lengths32 * torch.round(d * inverse_lengths32)  # the minimum image
        d = d * d
        d = d[:, 0] + d[:, 1] + d[:, 2]
        linked = [_indices(d <= surely)]
        unsure = _indices((d > surely) & (d <= maybe))
        if unsure.numel():
            i_unsure, j_unsure = i.index_select(0, unsure), j.index_select(0, unsure)
            d = points.index_select(0, i_unsure) - points.index_select(0, j_unsure)
            d = d - lengths * torch.round(d * inverse_lengths)
            d = d * d
            linked.append(unsure.index_select(0, _indices(d[:, 0] + d[:, 1] + d[:, 2] <= b2)))
        linked = torch.cat(linked)
        _union(parent, i.index_select(0, linked).to(torch.int64), j.index_select(0, linked).to(torch.int64))


def _float32_bounds(box, b: float) -> tuple[float, float]:
    """``(surely, maybe)``: a pair whose float32 squared distance (from the float32
    rounding of float64 coordinates in ``[0, L]``, minimum image and sum of squares in
    float32) is at most ``surely`` has a float64 squared distance below ``b^2``; one above
    ``maybe`` has one above ``b^2``.

    Each coordinate difference in float32 is within ``e = 6 * 2^-24 * L`` of the exact
    one (rounding of both coordinates, of the difference, of ``L`` and of the image
    shift), and the sum of 3 squares within a relative ``5 * 2^-24``; along the
    threshold ``|d_x| + |d_y| + |d_z| <= sqrt(3) b``, so the squared distance moves by
    at most ``2 sqrt(3) e b + 3 e^2`` plus the relative rounding. The factors
    ``1 -+ 1e-5`` cover the relative terms and the rounding of the bounds to float32
    with a wide margin."""
    e = 6.0 * 2.0**-24 * max(box)
    spread = 3.5 * e * b + 3.0 * e * e
    return (b * b - spread) * (1 - 1e-5), (b * b + spread) * (1 + 1e-5)


def _row_index(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Where each ``(member, label)`` row of ``rows`` sits in ``table`` (distinct rows,
    sorted as ``torch.unique(dim=0)`` sorts them; every row of ``rows`` is in it)."""
    labels = torch.unique(table[:, 1])
    def key(pairs):
        return pairs[:, 0] * labels.numel() + torch.searchsorted(labels, pairs[:, 1].contiguous())
    return torch.searchsorted(key(table), key(rows))


def _group_minimum(values: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
    """Each node's smallest ``values`` over its group."""
    smallest = torch.full_like(values, _NO_LABEL).scatter_reduce_(0, roots, values, reduce="amin")
    return smallest[roots]


# ------------------------------------------------------------------------ the grid


def _all_gather_rows(rows: torch.Tensor, mesh) -> torch.Tensor:
    """Every rank's ``(n_rank, C)`` int64 rows concatenated (rank order), on every rank."""
    from .distributed.groups import all_gather_grid

    counts = mesh.grid.all_gather_counts([rows.shape[0]], device=rows.device).reshape(-1)
    width = int(counts.max())
    padded = torch.full((width, rows.shape[1]), -1, dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    valid = torch.zeros(width, dtype=torch.bool, device=rows.device)
    valid[: rows.shape[0]] = True
    tensor = all_gather_grid(torch.cat([padded, valid.to(rows.dtype).unsqueeze(1)], 1), mesh.groups, dim=0)
    return tensor[tensor[:, -1] == 1][:, :-1]


def _ghost_destinations(points: torch.Tensor, valid: torch.Tensor, mesh, box, b: float):
    """``(member, slot, rank)`` of every copy to send: each valid particle to every other
    rank whose block, widened by ``b`` (and a margin) along x and y, holds it."""
    grid_shape = mesh.grid_shape
    reach = b * (1 + 1e-6) + 1e-12 * max(box)
    masks = []
    for axis in (0, 1):
        parts = grid_shape[axis]
        length = box[axis]
        n = mesh.global_shape[axis]
        bounds = []
        for r in range(parts):
            coords = (r, 0) if axis == 0 else (0, r)
            shape, offset = mesh.real_block(coords)
            bounds.append((offset[axis] * length / n, (offset[axis] + shape[axis]) * length / n))
        low = torch.tensor([lo for lo, _ in bounds], dtype=torch.float64, device=points.device)
        high = torch.tensor([hi for _, hi in bounds], dtype=torch.float64, device=points.device)
        x = points[..., axis:axis + 1]
        x = x - length * torch.floor(x / length)
        inside = (x >= low) & (x < high)
        below = torch.remainder(low - x, length)   # distance up to the block's lower face
        above = torch.remainder(x - high, length)  # distance down from its upper face
        masks.append(inside | (below <= reach) | (above <= reach))
    near = masks[0].unsqueeze(-1) & masks[1].unsqueeze(-2)  # (B, n, P0, P1)
    near = near.reshape(*valid.shape, mesh.grid.size) & valid.unsqueeze(-1)
    near[..., mesh.grid.rank] = False
    return torch.nonzero(near).unbind(1)


def _grid_labels(points, ids, mesh, box, b, chunk_size):
    """Labels (smallest id of each group) of this rank's ``(B, n)`` particles on a grid."""
    batch, count = ids.shape
    device = ids.device
    valid = ids >= 0
    member, slot, rank = _ghost_destinations(points, valid, mesh, box, b)
    copies = torch.bincount(member, minlength=batch)
    width = int(copies.max()) if member.numel() else 0
    column = torch.arange(member.numel(), device=device) - (torch.cumsum(copies, 0) - copies)[member]
    copy_ids = torch.full((batch, width), -1, dtype=torch.int64, device=device)
    copy_ids[member, column] = ids[member, slot]
    destination = torch.zeros((batch, width), dtype=torch.int64, device=device)
    destination[member, column] = rank
    copy_points = torch.zeros((batch, width, 3), dtype=torch.float64, device=device)
    copy_points[member, column] = points[member, slot]
    # The migration routes by `destination`; its positions (mesh cells) only place the arrivals.
    shape = torch.tensor(mesh.global_shape, dtype=torch.float64, device=device)
    lengths = torch.tensor(box, dtype=torch.float64, device=device)
    cells = torch.remainder(copy_points * (shape / lengths), shape)
    plan, _, ghost_ids, ghost_points = mesh.migrate(cells, copy_ids, copy_points, destination=destination)
    plan._grid = None  # (the rounds below exchange tensors fixed here: no agreement all-reduce per round)
    ghosts = ghost_ids.shape[1]
    # Nodes: this rank's particles, then its ghosts, member by member.
    all_ids = torch.cat([ids, ghost_ids], 1)
    all_points = torch.cat([points, ghost_points], 1)
    nodes = torch.nonzero((all_ids >= 0).reshape(-1)).reshape(-1)
    node_member = nodes // (count + ghosts)
    roots = _local_groups(all_points.reshape(-1, 3)[nodes], node_member, box, b, chunk_size)
    position = torch.full((batch * (count + ghosts),), -1, dtype=torch.int64, device=device)
    position[nodes] = torch.arange(nodes.numel(), device=device)
    position = position.view(batch, count + ghosts)
    own_node, ghost_node = position[:, :count], position[:, count:]
    copy_node = torch.full((batch, width), -1, dtype=torch.int64, device=device)
    copy_node[member, column] = own_node[member, slot]
    labels = _group_minimum(all_ids.reshape(-1)[nodes], roots)
    ghost_valid, copy_valid = ghost_node >= 0, copy_node >= 0
    while True:
        before = labels.clone()
        # This rank's particles' labels to their ghosts, the groups' minima, and back.
        sent = torch.where(copy_valid, labels[copy_node.clamp(min=0)], -1)
        arrived = plan.exchange(sent, fill=-1)
        index = ghost_node[ghost_valid]
        labels[index] = torch.minimum(labels[index], arrived[ghost_valid])
        labels = _group_minimum(labels, roots)
        returned = plan.gather(torch.where(ghost_valid, labels[ghost_node.clamp(min=0)], _NO_LABEL), fill=_NO_LABEL)
        labels.scatter_reduce_(0, copy_node[copy_valid], returned[copy_valid], reduce="amin")
        labels = _group_minimum(labels, roots)
        changed = torch.tensor([int(not torch.equal(labels, before))], dtype=torch.int64, device=device)
        if int(mesh.all_reduce(changed, "max")) == 0:
            break
    result = torch.full((batch, count), -1, dtype=torch.int64, device=device)
    result[valid] = labels[own_node[valid]]
    # Groups some of whose members or friends are on other ranks: the labels of this
    # rank's particles that were copied out and of the ghosts it received.
    shared = torch.zeros_like(valid)
    shared[member, slot] = True
    ghost_rows = torch.stack([ghost_valid.nonzero()[:, 0], labels[ghost_node[ghost_valid]]], 1)
    return result, shared, ghost_rows


def _apply_min_members(labels, min_members, mesh=None, shared=None, ghost_rows=None):
    """``labels`` with groups of fewer than ``min_members`` particles (over the grid) set
    to -1. On a grid, ``shared``: this rank's particles that were copied out;
    ``ghost_rows``: ``(member, label)`` of the ghosts it received. Only a group with such
    a member or ghost here can have members on other ranks: their counts are summed over
    the grid (one all-gather of those groups' rows), the others are counted here."""
    if min_members <= 1:
        return labels
    batch = labels.shape[0]
    device = labels.device
    per_member = []
    rows = []
    for m in range(batch):
        row = labels[m]
        valid = row >= 0
        unique, inverse, counts = torch.unique(row[valid], return_inverse=True, return_counts=True)
        touching = None
        if shared is not None:
            ghost_labels = ghost_rows[ghost_rows[:, 0] == m, 1]
            touching = torch.isin(unique, row[valid & shared[m]]) | torch.isin(unique, ghost_labels)
            rows.append(torch.stack([torch.full_like(unique[touching], m), unique[touching], counts[touching]], 1))
        per_member.append((valid, unique, inverse, counts, touching))
    if shared is not None:
        everyone = _all_gather_rows(torch.cat(rows) if rows else torch.zeros((0, 3), dtype=torch.int64,
                                                                            device=device), mesh)
    result = labels.clone()
    for m, (valid, unique, inverse, counts, touching) in enumerate(per_member):
        if touching is not None and bool(touching.any()):
            mine = everyone[everyone[:, 0] == m]
            keys, where = torch.unique(mine[:, 1], return_inverse=True)
            totals = torch.zeros_like(keys).index_add_(0, where, mine[:, 2])
            counts = counts.clone()
            counts[touching] = totals[torch.searchsorted(keys, unique[touching])]
        small = counts[inverse] < min_members
        result[m, valid] = torch.where(small, -1, labels[m, valid])
    return result


# ------------------------------------------------------------------------ public API


def friends_of_friends(
    positions: torch.Tensor,
    box_size,
    linking_length: float = 0.2,
    *,
    n_particles: int | None = None,
    ids: torch.Tensor | None = None,
    min_members: int = 1,
    mesh=None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Friends-of-friends group labels of particles in a periodic box.

    Args:
        positions: ``(B, N, 3)`` or ``(N, 3)`` comoving positions in Mpc/h (any values:
            the box is periodic). Not differentiated (the labels are integers).
        box_size: the box (Mpc/h), a number or 3 sides.
        linking_length: in units of the mean inter-particle separation
            ``(V / n_particles)^(1/3)``; must be positive and give a linking distance
            ``b`` of at most a third of the shortest side (the cell list needs 3 cells
            per axis; :func:`linking_distance` computes ``b``).
        n_particles: particles per batch member over all ranks (e.g. ``sim.n_total``);
            default: the particles given (ids >= 0), summed over the grid, which must be
            the same for every batch member.
        ids: ``(B, N)`` (or ``(N,)``) int64 particle ids, unique within a batch member
            over all ranks, ``-1`` (any negative) for an empty slot. Default on one device
            ``arange(N)``; required on a process grid.
        min_members: groups with fewer particles (over all ranks) are labelled -1.
        mesh: a process grid's mesh (``sim.force_mesh``): each rank passes the particles
            it holds; collective. None or a 1 x 1 mesh: one device.
        chunk_size: candidate pairs examined at a time (memory about 100 B each, on top
            of about 400 B per particle).

    Returns:
        ``(B, N)`` (or ``(N,)``) int64: each particle's group label, the smallest id in
        its group (so a label is the id of one of its members, and a lone particle's
        label is its own id); ``-1`` for empty slots and groups under ``min_members``.
        On a grid each rank gets the labels of the particles it passed, equal to the
        one-device labels of the same particles.
    """
    function = "friends_of_friends"
    distributed = _is_grid(mesh)
    error, values = None, []
    try:
        box = as_box_size(box_size)
        if isinstance(linking_length, bool) or not isinstance(linking_length, numbers.Real) \
                or not (math.isfinite(linking_length) and linking_length > 0):
            raise ValueError(f"{function}: `linking_length` must be a positive number (in units of the mean "
                             f"inter-particle separation), got {linking_length!r}")
        if n_particles is not None:
            n_particles = _positive_int(n_particles, "n_particles", function)
        min_members = _positive_int(min_members, "min_members", function)
        chunk_size = _positive_int(chunk_size, "chunk_size", function)
        positions, ids, unbatched = _particles(function, positions, ids, distributed, box)
        _check_unique_ids(function, ids)
        values = [("`box_size`", box), ("`linking_length`", float(linking_length)),
                  ("`n_particles`", n_particles), ("`min_members`", min_members),
                  ("batch size (dim 0 of `positions`)", int(positions.shape[0]))]
    except ValueError as exc:
        if not distributed:
            raise
        error = str(exc)
    if distributed:
        mesh.agree(function, values, error)
        # (each rank's ids are unique: two ranks holding one id made wrong groups silently)
        mesh.raise_together(duplicate_ids_error(function, ids, mesh.grid), operation=f"{function} (ids)")
    valid = ids >= 0
    if n_particles is None:
        given = valid.sum(1)
        if distributed:
            given = mesh.all_reduce(given, "sum")
        given = given.tolist()
        if len(set(given)) != 1 or given[0] < 1:
            raise ValueError(f"{function}: the batch members hold {given} particles; pass `n_particles` (the number "
                             "per member that sets the mean separation)")
        n_particles = given[0]
    b = linking_distance(box, n_particles, linking_length)
    if 3 * b > min(box) * (1 + 1e-12):
        raise ValueError(f"{function}: `linking_length` {linking_length!r} makes the linking distance b = {b:.6g} "
                         f"Mpc/h; it must be at most a third of the shortest box side ({min(box) / 3:.6g} Mpc/h) so "
                         "that the cell list has 3 cells per axis")
    points = positions.detach().to(torch.float64)
    if distributed:
        labels, shared, ghost_rows = _grid_labels(points, ids, mesh, box, b, chunk_size)
        labels = _apply_min_members(labels, min_members, mesh, shared, ghost_rows)
    else:
        nodes = torch.nonzero(valid.reshape(-1)).reshape(-1)
        roots = _local_groups(points.reshape(-1, 3)[nodes], nodes // ids.shape[1], box, b, chunk_size)
        labels = torch.full_like(ids, -1)
        labels[valid] = _group_minimum(ids.reshape(-1)[nodes], roots)
        labels = _apply_min_members(labels, min_members, mesh)
    return labels[0] if unbatched else labels


def halo_catalog(
    positions: torch.Tensor,
    labels: torch.Tensor,
    box_size,
    *,
    particle_mass=1.0,
    velocities: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    min_members: int = 1,
    mesh=None,
) -> HaloCatalog:
    """Members, mass, centre of mass and mean velocity of each labelled group.

    Args:
        positions: ``(B, N, 3)`` or ``(N, 3)`` in Mpc/h (any values: periodic box).
        labels: ``(B, N)`` (or ``(N,)``) int64 group labels, ``-1`` for no group (as
            :func:`friends_of_friends` returns).
        box_size: the box (Mpc/h), a number or 3 sides.
        particle_mass: a number, a scalar tensor, or ``(B, N)`` per-particle masses
            (any unit: the catalogue's masses are in it).
        velocities: optional ``(B, N, 3)`` (any unit, e.g. km/s).
        ids: ``(B, N)`` int64 ids (default ``arange(N)`` on one device; required on a
            grid): the centre is found around each group's smallest-id member.
        min_members: leave out groups with fewer particles (over all ranks).
        mesh: a process grid's mesh: each rank passes its particles and gets the whole
            catalogue (the per-halo sums are all-reduced). Collective.

    The centre of mass counts each member at the periodic image nearest to the group's
    smallest-id member, so a halo across a box face gets its true centre (wrapped into
    ``[0, L)``), for groups smaller than half the box. Differentiable in ``positions``,
    ``velocities`` and ``particle_mass`` for fixed membership.

    Returns:
        :class:`HaloCatalog`, heaviest halo first (without the batch axis when the
        positions had none).
    """
    function = "halo_catalog"
    distributed = _is_grid(mesh)
    error, values = None, []
    try:
        box = as_box_size(box_size)
        min_members = _positive_int(min_members, "min_members", function)
        positions, ids, unbatched = _particles(function, positions, ids, distributed, box)
        shape = tuple(positions.shape[:2])
        if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 \
                or tuple(labels.shape) != shape[unbatched:]:
            raise ValueError(f"{function}: `labels` must be an int64 tensor of shape {shape[unbatched:]} (one per "
                             f"particle), got {_describe(labels)}")
        labels = labels.unsqueeze(0) if unbatched else labels
        if bool((labels < -1).any()):
            raise ValueError(f"{function}: `labels` must be >= 0 (a group) or -1 (none), got {int(labels.min())}")
        if bool(((labels >= 0) & (ids < 0)).any()):
            raise ValueError(f"{function}: empty slots (ids < 0) must have label -1")
        if velocities is not None:
            if not isinstance(velocities, torch.Tensor) or not velocities.is_floating_point() \
                    or tuple(velocities.shape) != shape[unbatched:] + (3,):
                raise ValueError(f"{function}: `velocities` must be a floating-point tensor of shape "
                                 f"{shape[unbatched:] + (3,)} like the positions, got {_describe(velocities)}")
            velocities = velocities.unsqueeze(0) if unbatched else velocities
            bad = ~torch.isfinite(velocities.detach()).all(-1) & (labels >= 0)
            if bool(bad.any()):
                raise ValueError(f"{function}: `velocities` must be finite, got {int(bad.sum())} members with NaN or "
                                 "inf components")
        if isinstance(particle_mass, torch.Tensor):
            if particle_mass.dim() == 0:
                mass = particle_mass.to(device=positions.device, dtype=positions.dtype).expand(shape)
            elif tuple(particle_mass.shape) == shape[unbatched:]:
                mass = (particle_mass.unsqueeze(0) if unbatched else particle_mass).to(device=positions.device,
                                                                                       dtype=positions.dtype)
            else:
                raise ValueError(f"{function}: `particle_mass` must be a number, a scalar tensor or a tensor of shape "
                                 f"{shape[unbatched:]}, got {_describe(particle_mass)}")
            if not bool(torch.isfinite(mass.detach()).all()) or bool((mass.detach() <= 0).any()):
                raise ValueError(f"{function}: `particle_mass` must be positive and finite")
        elif isinstance(particle_mass, bool) or not isinstance(particle_mass, numbers.Real) \
                or not (math.isfinite(particle_mass) and particle_mass > 0):
            raise ValueError(f"{function}: `particle_mass` must be a positive number or tensor, got {particle_mass!r}")
        else:
            mass = torch.full(shape, float(particle_mass), dtype=positions.dtype, device=positions.device)
        values = [("`box_size`", box), ("`min_members`", min_members), ("batch size (dim 0 of `positions`)", shape[0]),
                  ("dtype of `positions`", str(positions.dtype)), ("`velocities` given", velocities is not None)]
    except ValueError as exc:
        if not distributed:
            raise
        error = str(exc)
    if distributed:
        mesh.agree(function, values, error)
    batch, device, dtype = shape[0], positions.device, positions.dtype

    def reduce(tensor, op="sum"):
        return mesh.all_reduce(tensor, op) if distributed else tensor

    # The groups over all ranks, the same list on every rank: (member, label) sorted.
    valid = labels >= 0
    member = torch.arange(batch, device=device).unsqueeze(1).expand(shape)
    pairs = torch.stack([member[valid], labels[valid]], 1)
    local = torch.unique(pairs, dim=0)
    groups = torch.unique(_all_gather_rows(local, mesh), dim=0) if distributed else local
    index = _row_index(groups, pairs)
    count = groups.shape[0]
    members = reduce(torch.zeros(count, dtype=torch.int64, device=device).index_add_(
        0, index, torch.ones_like(index)))
    first = reduce(torch.full((count,), _NO_LABEL, dtype=torch.int64, device=device).scatter_reduce_(
        0, index, ids[valid], reduce="amin"), "min")
    # The smallest-id member's position: the reference for the periodic images.
    x = positions[valid]
    is_first = ids[valid] == first[index]
    reference = reduce(torch.zeros((count, 3), dtype=dtype, device=device).index_add_(
        0, index[is_first], x.detach()[is_first]))
    lengths = torch.tensor(box, dtype=dtype, device=device)
    offset = x - reference[index]
    offset = offset - lengths * torch.round(offset.detach() / lengths)
    m = mass[valid]
    total = reduce(torch.zeros(count, dtype=dtype, device=device).index_add(0, index, m))
    moment = reduce(torch.zeros((count, 3), dtype=dtype, device=device).index_add(0, index, m.unsqueeze(1) * offset))
    centre = reference + moment / total.unsqueeze(1)
    centre = centre - lengths * torch.floor(centre.detach() / lengths)
    velocity = None
    if velocities is not None:
        momentum = reduce(torch.zeros((count, 3), dtype=velocities.dtype, device=device).index_add(
            0, index, m.to(velocities.dtype).unsqueeze(1) * velocities[valid]))
        velocity = momentum / total.to(velocities.dtype).unsqueeze(1)
    # Per batch member, heaviest first (a stable sort keeps smaller labels first in ties).
    keep = members >= min_members
    lists = []
    for b in range(batch):
        rows = torch.nonzero(keep & (groups[:, 0] == b)).reshape(-1)
        order = torch.argsort(total.detach()[rows], descending=True, stable=True)
        lists.append(rows[order])
    width = max((len(rows) for rows in lists), default=0)
    fields = [groups[:, 1], members, total, centre] + ([velocity] if velocity is not None else [])
    padded = []
    for position, field in enumerate(fields):
        fill = -1 if position == 0 else 0  # labels: -1 in the padding
        rows = [torch.cat([field[r], field.new_full((width - len(r), *field.shape[1:]), fill)]) for r in lists]
        padded.append(torch.stack(rows) if rows else field.new_zeros((0, width, *field.shape[1:])))
    if velocity is None:
        padded.append(None)
    if unbatched:
        padded = [None if p is None else p[0] for p in padded]
    return HaloCatalog(*padded)


def simulation_particle_mass(sim) -> torch.Tensor:
    """A :class:`~torchpm.Simulation`'s particle mass in Msun/h: ``27.7536627e10 Omega_m V / N``
    (a tensor, differentiable in the cosmology's ``Omega_m``)."""
    return sim.cosmology.Omega_m * (CRITICAL_DENSITY_MSUN * math.prod(sim.box_size) / sim.n_total)


def find_halos(sim, state, *, linking_length: float = 0.2, min_members: int = 20,
               chunk_size: int = DEFAULT_CHUNK_SIZE, return_labels: bool = False):
    """FoF halos of a :class:`~torchpm.Simulation`'s state: ``halos = find_halos(sim, state)``.

    Links the state's particles with ``linking_length`` times the mean separation
    ``(V / sim.n_total)^(1/3)`` (:func:`friends_of_friends`) and returns their
    :class:`HaloCatalog` (:func:`halo_catalog`) with masses in Msun/h (particle mass
    ``27.7536627e10 Omega_m V / N``, differentiable in the cosmology's ``Omega_m``),
    centres in Mpc/h and mean peculiar velocities in km/s (``100 p / a``). On a process
    grid (``Simulation(..., grid=...)``) every rank passes its own state and gets the
    whole catalogue; collective.

    Args:
        sim: the :class:`~torchpm.Simulation` that made ``state``.
        state: a :class:`~torchpm.SimulationState` (Mpc/h; a state in mesh units is
            converted).
        linking_length: in units of the mean inter-particle separation.
        min_members: smallest halo kept (particles).
        chunk_size: see :func:`friends_of_friends`.
        return_labels: also return the ``(B, N)`` per-particle labels (-1 outside halos).

    Returns:
        The :class:`HaloCatalog`, or ``(catalog, labels)`` with ``return_labels``.
    """
    from .simulation import MeshUnitsState, Simulation, SimulationState

    function = "find_halos"
    if not isinstance(sim, Simulation):
        raise ValueError(f"{function}: `sim` must be a torchpm.Simulation, got {type(sim).__name__}")
    error = None
    if not isinstance(state, SimulationState):
        error = (f"{function}: `state` must be a torchpm.SimulationState (what the simulation returns), got "
                 f"{type(state).__name__}")
    sim.force_mesh.agree(function, [], error)  # (on a grid every rank raises; on one device, here)
    if isinstance(state, MeshUnitsState):
        state = sim.to_physical(state.positions, state.momenta, state.a, state.ids)
    mesh = sim.force_mesh
    ids = state.ids
    labels = friends_of_friends(state.positions, sim.box_size, linking_length, n_particles=sim.n_total, ids=ids,
                                min_members=min_members, mesh=mesh, chunk_size=chunk_size)
    particle_mass = simulation_particle_mass(sim).to(state.positions.dtype)
    velocities = state.momenta * (100.0 / float(state.a))
    catalog = halo_catalog(state.positions, labels, sim.box_size, particle_mass=particle_mass, velocities=velocities,
                           ids=ids, min_members=min_members, mesh=mesh)
    return (catalog, labels) if return_labels else catalog


# ----------------------------------------------------------------------------
# Spherical-overdensity masses about given centres.


class SphericalOverdensity(NamedTuple):
    """Spherical-overdensity masses (:func:`spherical_overdensity`), one per centre.

    Attributes:
        masses: ``(B, H)`` ``M = n m`` (the unit of ``particle_mass``): the mass of the
            largest sphere about the centre, inside its search radius, whose mean
            density is at least the threshold; 0 for a masked centre or where no
            sphere about it reaches the threshold.
        radii: ``(B, H)`` in Mpc/h, ``(3 M / (4 pi density))^(1/3)``: the radius at
            which the ``n`` enclosed particles' mean density equals the threshold.
        members: ``(B, H)`` int64, ``n``: the particles inside ``radii``.
    """

    masses: torch.Tensor
    radii: torch.Tensor
    members: torch.Tensor


def _cell_table(points, box, lengths, width):
    """``(order, starts, counts, cells)``: ``points`` sorted by cells at least ``width``
    wide (and no more cells than points; 1 or 2 along an axis shorter than 3 widths)."""
    cells = _cell_grid(box, width, points.shape[0], per_point=1.0, least=1)
    n = torch.tensor(cells, device=points.device)
    cell = torch.minimum((points / lengths * n).floor().long(), n - 1)
    key = (cell[:, 0] * cells[1] + cell[:, 1]) * cells[2] + cell[:, 2]
    counts = torch.bincount(key, minlength=math.prod(cells))
    return torch.argsort(key), torch.cumsum(counts, 0) - counts, counts, cells


def _neighbour_cells(centres, lengths, cells):
    """``(H, M)`` the cells about each centre's (27, or every cell along an axis of fewer
    than 3): with cells at least ``r`` wide they hold every point within ``r``."""
    device = centres.device
    n = torch.tensor(cells, device=device)
    home = torch.minimum((centres / lengths * n).floor().long(), n - 1)
    offsets = [torch.tensor((-1, 0, 1) if c >= 3 else tuple(range(c)), device=device) for c in cells]
    grid = torch.meshgrid(*offsets, indexing="ij")
    near = []
    for axis, o in enumerate(grid):
        base = home[:, axis:axis + 1] if cells[axis] >= 3 else torch.zeros_like(home[:, axis:axis + 1])
        near.append(torch.remainder(base + o.reshape(1, -1), cells[axis]))
    return (near[0] * cells[1] + near[1]) * cells[2] + near[2]


def _sphere_candidates(points, centres, search, lengths, table, keys):
    """``(centre, distance)`` of every point within ``search[c]`` of centre ``c``
    (periodic in the box ``lengths``; ``keys`` the centres' neighbour cells in ``table``)."""
    order, starts, counts, _ = table
    device = points.device
    per_pair = counts[keys].reshape(-1)
    pair_of = torch.repeat_interleave(torch.arange(per_pair.numel(), device=device), per_pair)
    within = torch.arange(pair_of.numel(), device=device) - (torch.cumsum(per_pair, 0) - per_pair)[pair_of]
    particle = order[starts[keys.reshape(-1)][pair_of] + within]
    centre = pair_of // keys.shape[1]
    offset = points[particle] - centres[centre]
    offset = offset - lengths * torch.round(offset / lengths)
    distance = torch.linalg.vector_norm(offset, dim=1)
    keep = distance <= search[centre]
    return centre[keep], distance[keep]


def _radius_argument(radius, shape, device, function):
    """``radius`` (a positive number, or a tensor of ``shape`` or broadcastable to it) as a
    float64 ``shape`` tensor."""
    if isinstance(radius, torch.Tensor):
        try:
            values = torch.broadcast_to(radius.detach().to(device=device, dtype=torch.float64), shape)
        except RuntimeError:
            raise ValueError(f"{function}: `radius` must be a positive number or a tensor broadcastable to "
                             f"{tuple(shape)} (one per centre), got {_describe(radius)}") from None
    elif isinstance(radius, bool) or not isinstance(radius, numbers.Real):
        raise ValueError(f"{function}: `radius` must be a positive number of Mpc/h or a tensor, got {radius!r}")
    else:
        values = torch.full(shape, float(radius), dtype=torch.float64, device=device)
    if not bool((torch.isfinite(values) & (values > 0)).all()):
        raise ValueError(f"{function}: `radius` must be positive and finite (Mpc/h)")
    return values


def _replicated_check(function, mesh, centres, valid):
    """Every rank of the grid has the same centres and mask (else every rank raises:
    different masks would make the ranks run different collectives)."""
    weights = torch.arange(1, centres.numel() + 1, dtype=torch.float64, device=centres.device)
    masked = torch.where(valid.unsqueeze(-1), centres.detach().double(), 0.0)
    check = torch.stack([(masked.reshape(-1) * weights).sum(), masked.sum(),
                         (valid.reshape(-1).double() * weights[: valid.numel()]).sum(), valid.sum().double()])
    low, high = mesh.all_reduce(check.clone(), "min"), mesh.all_reduce(check.clone(), "max")
    if not torch.equal(low, high):
        raise ValueError(f"{function}: `centres` and `valid` must be the same on every rank of the grid (every rank "
                         "measures every centre)")


def _to_measuring_rank(centre, distance, mesh):
    """The ``(centre, distance)`` candidates of every rank, each sent to the rank that
    measures its centre (centre index modulo the grid's ranks): what a rank holds
    afterwards is every candidate of its centres."""
    rows = route_rows(torch.stack([centre, distance.view(torch.int64)], 1), centre % mesh.grid.size, mesh.grid)
    return rows[:, 0], rows[:, 1].contiguous().view(torch.float64)


def spherical_overdensity(
    positions: torch.Tensor,
    centres: torch.Tensor,
    box_size,
    density,
    *,
    radius,
    particle_mass=1.0,
    ids: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    mesh=None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> SphericalOverdensity:
    """Spherical-overdensity masses about ``centres``: the largest sphere about each
    centre, inside its search radius, whose mean density is at least ``density``.

    With the particles at distances ``r_1 <= r_2 <= ...`` from a centre, ``n`` is the
    last ``k`` with ``k m >= density * 4/3 pi r_k^3`` (0 if none) among the particles
    within the search radius: mass ``M = n m``, radius ``R = (3 M / (4 pi
    density))^(1/3)`` (``r_n <= R < r_{n+1}``), the usual ``M_Delta`` of ``density =
    Delta rho_ref`` (:func:`spherical_overdensity_masses` takes Delta and the reference
    for a run). The outermost such sphere, not the first one grown from the centre: the
    few particles nearest a centre (a centre of mass, a softened core) decide nothing.
    The search radius is ``radius``, doubled for a centre while its sphere is still open
    there (the next particle beyond it would still be above the threshold), up to half
    the box's shortest side, where an open sphere is an error. Exact for the particles
    as given: distances in float64, every particle within the search radius found
    through a cell table.

    Args:
        positions: ``(B, N, 3)`` or ``(N, 3)`` in Mpc/h (periodic box).
        centres: ``(B, H, 3)`` or ``(H, 3)`` in Mpc/h, e.g. ``HaloCatalog.positions``
            (FoF centres of mass); the same on every rank of a grid.
        box_size: the box (Mpc/h), a number or 3 sides.
        density: the threshold, in the unit of ``particle_mass`` per (Mpc/h)^3
            (comoving), a positive number or scalar tensor (gradients flow into the radii).
        radius: the search radius in Mpc/h, a number or a tensor with one per centre
            (``spherical_overdensity_masses`` takes twice the radius of a sphere of the
            FoF mass at the threshold).
        particle_mass: a positive number or scalar tensor (the masses' unit).
        ids: ``(B, N)`` int64, ``-1`` for an empty slot (default: every slot a particle;
            required on a grid).
        valid: optional ``(B, H)`` bool, the centres to measure (e.g.
            ``catalog.labels >= 0``); the others get 0.
        mesh: a process grid's mesh: each rank passes its particles and the same
            centres and gets every centre's result. Collective. Each rank finds the
            candidates among its own particles and sends them to the rank that measures
            their centre (centres are dealt out round robin), which sorts them: a rank
            holds and sorts about ``1/ranks`` of the candidates.
        chunk_size: candidate pairs handled at a time (over all ranks).

    Returns:
        :class:`SphericalOverdensity` (without the batch axis when the centres had none).
        Not differentiable in the positions (a count); the radii are in ``density`` and
        ``particle_mass``.
    """
    function = "spherical_overdensity"
    distributed = _is_grid(mesh)
    error, values = None, []
    try:
        box = as_box_size(box_size)
        positions, ids, _ = _particles(function, positions, ids, distributed, box)
        batch = positions.shape[0]
        if not isinstance(centres, torch.Tensor) or not centres.is_floating_point() \
                or centres.dim() not in (2, 3) or centres.shape[-1] != 3:
            raise ValueError(f"{function}: `centres` must be a floating-point tensor of shape (B, H, 3) or (H, 3) in "
                             f"Mpc/h, got {_describe(centres)}")
        unbatched = centres.dim() == 2
        centres = centres.unsqueeze(0) if unbatched else centres
        if centres.shape[0] != batch:
            raise ValueError(f"{function}: `centres` must have the positions' batch size {batch}, got "
                             f"{centres.shape[0]}")
        if centres.device != positions.device:
            raise ValueError(f"{function}: `centres` must be on the positions' device {positions.device}, got "
                             f"{centres.device}")
        shape = tuple(centres.shape[:2])
        if valid is None:
            valid = torch.ones(shape, dtype=torch.bool, device=centres.device)
        elif not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool \
                or tuple(valid.shape) != shape[unbatched:]:
            raise ValueError(f"{function}: `valid` must be a bool tensor of shape {shape[unbatched:]} (one per "
                             f"centre), got {_describe(valid)}")
        else:
            valid = (valid.unsqueeze(0) if unbatched else valid).to(centres.device)
        if not bool(torch.isfinite(centres.detach())[valid].all()):
            raise ValueError(f"{function}: `centres` must be finite")
        for name, value in (("density", density), ("particle_mass", particle_mass)):
            if isinstance(value, torch.Tensor):
                if value.dim() != 0 or not value.is_floating_point() or not (
                        float(value.detach()) > 0 and math.isfinite(float(value.detach()))):
                    raise ValueError(f"{function}: `{name}` must be a positive finite number or scalar tensor, got "
                                     f"{_describe(value)}")
            elif isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"{function}: `{name}` must be a positive finite number or scalar tensor, got "
                                 f"{value!r}")
        threshold = float(density.detach()) if isinstance(density, torch.Tensor) else float(density)
        mass = float(particle_mass.detach()) if isinstance(particle_mass, torch.Tensor) else float(particle_mass)
        search_radii = _radius_argument(radius, shape, centres.device, function)
        chunk_size = _positive_int(chunk_size, "chunk_size", function)
        values = [("`box_size`", box), ("`density`", threshold), ("`particle_mass`", mass),
                  ("batch size", batch), ("`centres` shape", shape), ("dtype of `positions`", str(positions.dtype))]
    except ValueError as exc:
        if not distributed:
            raise
        error = str(exc)
    if distributed:
        mesh.agree(function, values, error)
        _replicated_check(function, mesh, torch.cat([centres.detach().double(), search_radii.unsqueeze(-1)], -1),
                          valid)
    device = positions.device
    limit = 0.5 * min(box)
    lengths = torch.tensor(box, dtype=torch.float64, device=device)
    volume = 4.0 / 3.0 * math.pi
    counts_out = torch.zeros(shape, dtype=torch.int64, device=device)
    for b in range(batch):
        points = positions[b].detach().double()[ids[b] >= 0]
        points = points - lengths * torch.floor(points / lengths)
        rows = torch.nonzero(valid[b]).reshape(-1)
        middle = centres[b].detach().double()[rows]
        middle = middle - lengths * torch.floor(middle / lengths)
        search = search_radii[b][rows].clamp(max=limit)
        pending = torch.arange(rows.numel(), device=device)
        while pending.numel():  # (the same on every rank: decided by the gathered candidates)
            table = _cell_table(points, box, lengths, float(search[pending].max()))
            keys = _neighbour_cells(middle[pending], lengths, table[3])
            per_centre = table[2][keys].sum(1)
            if distributed:
                per_centre = mesh.all_reduce(per_centre, "sum")
            # centres in groups of about ``chunk_size`` candidates over all ranks (at least one)
            ends = torch.searchsorted(torch.cumsum(per_centre, 0), torch.arange(
                chunk_size, int(per_centre.sum()) + chunk_size, chunk_size, device=device), right=True)
            bounds = sorted({0, pending.numel(), *(min(max(int(e), 1), pending.numel()) for e in ends.tolist())})
            closed_all = torch.zeros(pending.numel(), dtype=torch.bool, device=device)
            for low, high in zip(bounds[:-1], bounds[1:]):
                group = pending[low:high]
                centre, distance = _sphere_candidates(points, middle[group], search[group], lengths, table,
                                                      keys[low:high])
                if distributed:  # each centre's candidates to the one rank that measures it
                    centre, distance = _to_measuring_rank(centre, distance, mesh)
                # by centre, then distance
                by_distance = torch.argsort(distance)
                by_centre = by_distance[torch.argsort(centre[by_distance], stable=True)]
                centre, distance = centre[by_centre], distance[by_centre]
                total = torch.bincount(centre, minlength=group.numel())
                rank = torch.arange(centre.numel(), device=device) - (torch.cumsum(total, 0) - total)[centre] + 1
                above = rank.double() * mass >= threshold * volume * distance**3
                last = torch.zeros(group.numel(), dtype=torch.int64, device=device)
                last.scatter_reduce_(0, centre[above], rank[above], reduce="amax")
                if distributed:  # (zero where another rank measured the centre)
                    total, last = mesh.all_reduce(torch.stack([total, last]), "sum").unbind(0)
                # open: the next particle, beyond the search radius, could still be above
                closed = (total + 1).double() * mass < threshold * volume * search[group] ** 3
                counts_out[b, rows[group[closed]]] = last[closed]
                closed_all[low:high] = closed
            pending = pending[~closed_all]
            if pending.numel() and bool((search[pending] >= limit).any()):
                raise ValueError(
                    f"{function}: {int((search[pending] >= limit).sum())} sphere(s) of batch member {b} are still "
                    f"open at half the box's shortest side ({limit:g} Mpc/h): the mean density about their "
                    f"centres stays above `density` = {threshold:g} out to there (a threshold below the box's "
                    "mean density?)")
            search[pending] = (2.0 * search[pending]).clamp(max=limit)
    masses = counts_out.to(positions.dtype) * torch.as_tensor(particle_mass, dtype=positions.dtype, device=device)
    volume_at = 3.0 * masses / (4.0 * math.pi * torch.as_tensor(density, dtype=positions.dtype, device=device))
    empty = counts_out == 0  # (no infinite slope of the cube root at 0 in the gradients)
    radii = torch.where(empty, 0.0, torch.where(empty, 1.0, volume_at) ** (1.0 / 3.0))
    result = SphericalOverdensity(masses, radii, counts_out)
    return SphericalOverdensity(*(t[0] for t in result)) if unbatched else result


def spherical_overdensity_masses(sim, state, catalog: HaloCatalog, *, delta: float = 200.0,
                                 reference: str = "mean", chunk_size: int = DEFAULT_CHUNK_SIZE) -> SphericalOverdensity:
    """``M_Delta`` and ``R_Delta`` about each halo of ``catalog`` (e.g. :func:`find_halos`'
    of the same state): :func:`spherical_overdensity` with ``density = delta *
    rho_ref`` for the run's particles, masses in Msun/h and radii in comoving Mpc/h.

    ``reference="mean"``: the mean matter density, ``Omega_m rho_crit,0`` (comoving,
    the same at every ``a``: ``M_200m`` for ``delta=200``); ``"critical"``: the critical
    density at the state's ``a``, ``rho_crit,0 E(a)^2 a^3`` in comoving units
    (``M_200c``). Centres are the catalogue's (FoF centres of mass), each searched out to
    twice the radius of a sphere of its FoF mass at the threshold (further while its
    sphere is open there); padded entries get 0. On a process grid every rank passes its
    own state and the (replicated) catalogue and gets every halo's values; collective.
    """
    from .simulation import MeshUnitsState, Simulation, SimulationState

    function = "spherical_overdensity_masses"
    if not isinstance(sim, Simulation):
        raise ValueError(f"{function}: `sim` must be a torchpm.Simulation, got {type(sim).__name__}")
    error = None
    if not isinstance(state, SimulationState):
        error = f"{function}: `state` must be a torchpm.SimulationState, got {type(state).__name__}"
    elif not isinstance(catalog, HaloCatalog):
        error = f"{function}: `catalog` must be a HaloCatalog (find_halos), got {type(catalog).__name__}"
    elif isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not (math.isfinite(delta) and delta > 0):
        error = f"{function}: `delta` must be a positive number, got {delta!r}"
    elif not isinstance(reference, str) or reference not in ("mean", "critical"):
        error = f"{function}: `reference` must be 'mean' or 'critical', got {reference!r}"
    # (other thresholds on other ranks would mix two definitions of the masses)
    sim.force_mesh.agree(function, [("`delta`", None if error else float(delta)),
                                    ("`reference`", None if error else reference)], error)
    if isinstance(state, MeshUnitsState):
        state = sim.to_physical(state.positions, state.momenta, state.a, state.ids)
    cosmology = sim.cosmology
    if reference == "mean":
        rho = cosmology.Omega_m * CRITICAL_DENSITY_MSUN
    else:
        a = torch.as_tensor(float(state.a), dtype=torch.float64, device=cosmology.Omega_m.device)
        rho = CRITICAL_DENSITY_MSUN * cosmology.E(a) ** 2 * a**3
    unbatched = catalog.positions.dim() == 2
    centres = catalog.positions.to(state.positions.dtype)
    valid = catalog.labels >= 0
    threshold = (delta * rho).to(state.positions.dtype)
    particle_mass = simulation_particle_mass(sim).to(state.positions.dtype)
    # twice the radius of a sphere of the FoF mass at the threshold (at least one particle's)
    fof = torch.where(valid, catalog.masses.detach().double(), 0.0).clamp_min(float(particle_mass))
    radius = 2.0 * (3.0 * fof / (4.0 * math.pi * float(threshold))) ** (1.0 / 3.0)
    result = spherical_overdensity(
        state.positions, centres.unsqueeze(0) if unbatched else centres, sim.box_size, threshold,
        radius=radius.unsqueeze(0) if unbatched else radius, particle_mass=particle_mass, ids=state.ids,
        valid=valid.unsqueeze(0) if unbatched else valid, mesh=sim.force_mesh, chunk_size=chunk_size)
    return SphericalOverdensity(*(t[0] for t in result)) if unbatched else result


# ----------------------------------------------------------------------------
# The halo mass function: measured, and the fits of the literature.


class MassFunction(NamedTuple):
    """Halo mass function ``dn/dln M`` in mass bins. ``mass``: ``(n_bins,)`` the bins'
    geometric centres in Msun/h; ``dn_dlnM``: ``(n_bins,)`` or ``(B, n_bins)`` in
    (h/Mpc)^3; ``error``: its Poisson error ``sqrt(counts) / (V dln M)``; ``counts``: halos
    per bin (like ``dn_dlnM``); ``edges``: ``(n_bins + 1,)`` in Msun/h."""

    mass: torch.Tensor
    dn_dlnM: torch.Tensor
    error: torch.Tensor
    counts: torch.Tensor
    edges: torch.Tensor


def mass_function(masses, box_size, *, bins=None) -> MassFunction:
    """The mass function of a halo catalogue: halos per unit volume and ``ln M``.

    Args:
        masses: a :class:`HaloCatalog` (its ``masses``), or halo masses ``(H,)`` or ``(B,
            H)`` in Msun/h; entries of 0 (a catalogue's padding) are not halos.
        box_size: the periodic box's side(s) in Mpc/h.
        bins: None (five per decade, from the smallest halo mass of all members to past
            the largest), a number of log-spaced bins over that range, or increasing
            positive edges in Msun/h.

    Returns:
        :class:`MassFunction` (not differentiable: it counts).
    """
    function = "mass_function"
    if isinstance(masses, HaloCatalog):
        masses = masses.masses
    if not isinstance(masses, torch.Tensor) or masses.dim() not in (1, 2) or not masses.is_floating_point():
        raise ValueError(f"{function}: `masses` must be a HaloCatalog or a real (H,) or (B, H) tensor of masses in "
                         f"Msun/h, got {_describe(masses)}")
    masses = masses.detach().to(torch.float64)
    if not bool(torch.isfinite(masses).all()) or bool((masses < 0).any()):
        raise ValueError(f"{function}: `masses` must be finite and not negative (0 marks padding)")
    single = masses.dim() == 1
    batched = masses.unsqueeze(0) if single else masses
    volume = math.prod(as_box_size(box_size))
    halos = batched[batched > 0]
    if bins is None or (isinstance(bins, numbers.Integral) and not isinstance(bins, bool)):
        if bins is not None and int(bins) < 1:
            raise ValueError(f"{function}: `bins` must be a positive number of bins or increasing edges, got {bins}")
        if halos.numel() == 0:
            raise ValueError(f"{function}: no halo (every mass is 0): pass `bins` as edges to count none")
        smallest, largest = float(halos.min()), float(halos.max())
        low = math.log10(smallest)
        high = max(math.log10(largest) + 1e-9, low + 0.2)  # (equal masses: one 0.2 dex range)
        count = max(1, math.ceil((high - low) * 5)) if bins is None else int(bins)
        edges = torch.logspace(low, high if bins is not None else low + count / 5, count + 1, dtype=torch.float64)
        # (10^log10(m) may round above m: the smallest halo must be in the first bin, the largest in the last)
        edges[0] = min(float(edges[0]), smallest)
        edges[-1] = max(float(edges[-1]), largest * (1 + 1e-12))
    else:
        from .analysis import _edges_argument

        try:
            edges = _edges_argument(bins, "Msun/h", None, least=math.ulp(0.0))  # (positive)
        except ValueError as exc:
            raise ValueError(f"{function}: {exc}") from None
    edges = edges.to(batched.device)
    n_bins = edges.numel() - 1
    index = torch.bucketize(batched, edges, right=True) - 1
    inside = (batched > 0) & (index >= 0) & (index < n_bins)
    index = torch.where(inside, index, torch.full_like(index, n_bins))
    counts = torch.zeros(batched.shape[0], n_bins + 1, dtype=torch.float64, device=batched.device)
    counts = counts.scatter_add_(1, index, inside.to(torch.float64))[:, :n_bins]
    width = torch.log(edges[1:] / edges[:-1])
    dn = counts / (volume * width)
    error = counts.sqrt() / (volume * width)
    centres = torch.sqrt(edges[1:] * edges[:-1])
    if single:
        dn, error, counts = dn[0], error[0], counts[0]
    return MassFunction(centres, dn, error, counts, edges)


# Collapse threshold of linear theory, 3/20 (12 pi)^(2/3).
DELTA_C = 0.15 * (12.0 * math.pi) ** (2.0 / 3.0)


def _press74(sigma):
    nu = DELTA_C / sigma
    return math.sqrt(2.0 / math.pi) * nu * torch.exp(-0.5 * nu**2)


def _sheth99(sigma):
    a, p, amplitude = 0.707, 0.3, 0.3222
    nu2 = a * (DELTA_C / sigma) ** 2
    return amplitude * math.sqrt(2.0 / math.pi) * (1.0 + nu2 ** (-p)) * torch.sqrt(nu2) * torch.exp(-0.5 * nu2)


def _jenkins01(sigma):
    return 0.315 * torch.exp(-torch.abs(torch.log(1.0 / sigma) + 0.61) ** 3.8)


def _watson13(sigma):
    amplitude, alpha, beta, gamma = 0.282, 2.163, 1.406, 1.210
    return amplitude * ((beta / sigma) ** alpha + 1.0) * torch.exp(-gamma / sigma**2)


# The multiplicity functions f(sigma) of dn/dln M = f(sigma) rho_m / M |dln sigma / dln M|.
MASS_FUNCTION_MODELS = {
    "press74": _press74,      # Press & Schechter 1974
    "sheth99": _sheth99,      # Sheth & Tormen 1999
    "jenkins01": _jenkins01,  # Jenkins et al. 2001, FoF b = 0.2 (fit for -1.2 < ln 1/sigma < 1.05)
    "watson13": _watson13,    # Watson et al. 2013, FoF b = 0.2, universal form
}


def mass_function_theory(mass, cosmology, a: float = 1.0, *, model: str = "watson13", power=None) -> torch.Tensor:
    """``dn/dln M`` in (h/Mpc)^3 of a fit of the literature at masses ``mass`` (Msun/h)::

        dn/dln M = f(sigma) rho_m / M |dln sigma / dln M|,   rho_m = 27.7536627e10 Omega_m

    with ``sigma(M, a) = D1(a) sigma(R)`` the rms linear overdensity in spheres of ``R =
    (3 M / (4 pi rho_m))^(1/3)`` (the linear power at ``a = 1`` integrated with Simpson's
    rule in ``ln k`` over 1e-5 to 100 h/Mpc, further for spheres under 3 Mpc/h, or over a
    power table's own range, as :func:`torchpm.cosmology.sigma_r`; the derivative by
    central differences) and ``f`` one of :data:`MASS_FUNCTION_MODELS`:
    ``"press74"``, ``"sheth99"`` (Sheth & Tormen), ``"jenkins01"`` and ``"watson13"``
    (FoF halos of linking length 0.2, as :func:`find_halos` finds by default).
    Differentiable in the cosmology's parameters.

    Args:
        mass: halo masses in Msun/h (tensor or sequence, > 0).
        cosmology: a :class:`~torchpm.Cosmology`.
        a: the scale factor.
        model: the multiplicity function's name.
        power: the linear power at ``a = 1``, a callable of ``k`` (h/Mpc) (e.g.
            ``sim.linear_power``); default :func:`torchpm.cosmology.linear_power` of ``cosmology``.
    """
    from .cosmology import _log_k_grid, _simpson, _top_hat, linear_power

    function = "mass_function_theory"
    if model not in MASS_FUNCTION_MODELS:
        raise ValueError(f"{function}: `model` must be one of {', '.join(MASS_FUNCTION_MODELS)}, got {model!r}")
    if not callable(getattr(cosmology, "growth", None)):
        raise TypeError(f"{function}: `cosmology` must be a torchpm.Cosmology, got {type(cosmology).__name__}")
    mass = torch.as_tensor(mass, dtype=torch.float64)
    if mass.numel() == 0:
        raise ValueError(f"{function}: `mass` must hold at least one mass (Msun/h), got shape {tuple(mass.shape)}")
    if not bool(torch.isfinite(mass).all()) or bool((mass <= 0).any()):
        raise ValueError(f"{function}: `mass` must hold finite masses > 0 (Msun/h)")
    if isinstance(a, bool) or not isinstance(a, numbers.Real) or not 0 < a <= 1:
        raise ValueError(f"{function}: `a` must be a scale factor in (0, 1], got {a!r}")
    from .cosmology import PowerTable

    device = cosmology.Omega_m.device
    rho = CRITICAL_DENSITY_MSUN * cosmology.Omega_m
    flat = mass.reshape(-1).to(device)
    radius = (3.0 * flat / (4.0 * math.pi * rho)) ** (1.0 / 3.0)
    # k from 1e-5 to 100 h/Mpc, or to 300 / R for the smallest spheres (below 1e9 Msun/h);
    # a power table over its own range.
    k_min, k_max = 1e-5, max(100.0, 300.0 / float(radius.detach().min()))
    if isinstance(power, PowerTable):
        k_min, k_max = power.k_range
    decades = math.log10(k_max / k_min)
    k = _log_k_grid(device, k_min, k_max, 2 * math.ceil(decades * 4096 / 14) + 1)  # (odd: Simpson)
    values = torch.as_tensor(linear_power(k, cosmology) if power is None else power(k), dtype=torch.float64)
    if values.shape != k.shape or not bool(torch.isfinite(values.detach()).all()):
        raise ValueError(f"{function}: `power` must return one finite value per wavenumber (shape {tuple(k.shape)}), "
                         f"got shape {tuple(values.shape)}" + (" with NaN or infinite values"
                                                               if values.shape == k.shape else ""))
    integrand = k**3 * values.to(device) / (2.0 * math.pi**2)
    step = 1e-4  # (in ln R)
    shifts = torch.exp(torch.tensor([-step, 0.0, step], dtype=torch.float64, device=device))
    sigmas = []
    for start in range(0, flat.numel(), 256):  # (temporaries of 3 x 256 x len(k))
        radii = radius[start:start + 256].unsqueeze(-1) * shifts
        sigmas.append(torch.sqrt(_simpson(integrand * _top_hat(k * radii.unsqueeze(-1)) ** 2, torch.log(k))))
    sigma = torch.cat(sigmas)
    dln_sigma_dln_m = (torch.log(sigma[:, 2]) - torch.log(sigma[:, 0])) / (2 * step) / 3.0
    sigma_a = sigma[:, 1] * cosmology.growth(float(a)).D1
    result = MASS_FUNCTION_MODELS[model](sigma_a) * rho / flat * dln_sigma_dln_m.abs()
    return result.reshape(mass.shape).to(mass.device)
