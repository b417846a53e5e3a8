"""Friends-of-friends (FoF) halos of a particle snapshot, on one device or a process grid.

Two particles are *friends* when their periodic (minimum-image) distance is at most
``b = linking_length * (V / N)^(1/3)`` (``V`` the box volume, ``N`` the number of
particles of one batch member over all ranks); a FoF group is a connected component of
the friendship graph. :func:`friends_of_friends` labels every particle with its group's
smallest particle id (``-1`` for an empty slot or a group smaller than
``min_members``), exactly: the components of the graph "distance <= b", the distances
computed in float64 from the positions as given.

Method (torch only, on whatever device the positions are):

- a cell list with ``floor(L_i / b)`` cells per axis (cells at least ``b`` wide, at
  least 3 per axis, so ``b`` may be at most a third of the shortest side); particles are
  sorted by cell and only occupied cells are kept (no dense cell array);
- candidate pairs come from each occupied cell and its 13 forward neighbours (a half
  shell, so each pair of cells once), generated ``chunk_size`` at a time from one
  global pair index, so memory stays bounded however clustered the particles are
  (one cell of ``n`` particles makes ``n^2`` candidates: time grows, memory does not);
- the linked pairs of a chunk are merged into a forest by min-label hooking
  (``scatter_reduce(amin)``: each root points to the smallest root linked to it) with
  pointer jumping, until every pair of the chunk has one root; the root of a group is
  its smallest node, and the group's label is the smallest id over its members.

Memory: about ``400 B`` per particle (positions in float64, the cell order, the pairs of
neighbouring occupied cells, the forest) plus about ``100 B`` per candidate pair of a
chunk (``chunk_size`` pairs, default ``2^20``: about 100 MB). Measured on 64^3 evolved
particles: a peak of 96 MB above the input with ``chunk_size=2**16``, 189 MB with the
default (benchmarks/RESULTS.md, section 12).

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
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .mesh import as_box_size

__all__ = ["HaloCatalog", "friends_of_friends", "halo_catalog", "find_halos", "linking_distance"]

DEFAULT_CHUNK_SIZE = 1 << 20
# Hubble units: the critical density today is 27.7536627e10 (Msun/h) / (Mpc/h)^3.
CRITICAL_DENSITY_MSUN = 27.7536627e10
_NO_LABEL = torch.iinfo(torch.int64).max
# The 13 forward neighbours of a cell and the cell itself: each unordered pair of
# neighbouring cells is visited once (3 or more cells per axis make them distinct).
_HALF_SHELL = [(0, 0, 0)] + [(i, j, k) for i in (-1, 0, 1) for j in (-1, 0, 1) for k in (-1, 0, 1)
                             if (i, j, k) > (0, 0, 0)]


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


def _particles(function, positions, ids, distributed):
    """``positions`` as ``(B, N, 3)``, ``ids`` as ``(B, N)`` int64 (default ``arange``),
    whether the input had no batch axis; ValueError naming the bad argument."""
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
    finite = torch.isfinite(positions.detach()).all(-1) | ~valid
    if not bool(finite.all()):
        raise ValueError(f"{function}: `positions` must be finite, got {int((~finite).sum())} particles with NaN or "
                         "inf coordinates")
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


def _local_groups(points: torch.Tensor, member: torch.Tensor, box, b: float, chunk_size: int) -> torch.Tensor:
    """The groups of ``K`` points (``(K, 3)`` float64 Mpc/h, ``member``: batch index of
    each; points of different members are never friends): ``(K,)`` int64, the smallest
    index of each point's group."""
    count = points.shape[0]
    device = points.device
    parent = torch.arange(count, device=device)
    if count < 2:
        return parent
    cells = [int(math.floor(length / b)) for length in box]
    columns, coords = [], []
    for axis, length in enumerate(box):
        x = points[:, axis]
        x = x - length * torch.floor(x / length)
        columns.append(x)
        coords.append(torch.floor(x * (cells[axis] / length)).to(torch.int64).clamp_(0, cells[axis] - 1))
    key = ((member * cells[0] + coords[0]) * cells[1] + coords[1]) * cells[2] + coords[2]
    key, order = torch.sort(key)
    columns = [x.index_select(0, order) for x in columns]
    cell_keys, occupancy = torch.unique_consecutive(key, return_counts=True)
    first = torch.cumsum(occupancy, 0) - occupancy
    at_first = order.index_select(0, first)
    cell_member = member.index_select(0, at_first)
    cell_coords = [c.index_select(0, at_first) for c in coords]
    # Every pair of neighbouring occupied cells, and how many candidate pairs it holds:
    # a cell with itself (if it holds two or more), then with its forward neighbours.
    crowded = _indices(occupancy > 1)
    cell_a, cell_b = [crowded], [crowded]
    for offset in _HALF_SHELL[1:]:
        wanted = cell_member
        for axis in range(3):
            shifted = cell_coords[axis] + offset[axis]
            if offset[axis] > 0:
                shifted = torch.where(shifted == cells[axis], 0, shifted)
            elif offset[axis] < 0:
                shifted = torch.where(shifted < 0, cells[axis] - 1, shifted)
            wanted = wanted * cells[axis] + shifted
        where = torch.searchsorted(cell_keys, wanted).clamp_(max=cell_keys.numel() - 1)
        found = _indices(cell_keys.index_select(0, where) == wanted)
        cell_a.append(found)
        cell_b.append(where.index_select(0, found))
    cell_a, cell_b = torch.cat(cell_a), torch.cat(cell_b)
    first_a, first_b = first.index_select(0, cell_a), first.index_select(0, cell_b)
    width_b = occupancy.index_select(0, cell_b)
    same = cell_a == cell_b
    sizes = occupancy.index_select(0, cell_a) * width_b
    ends = torch.cumsum(sizes, 0)
    total = int(ends[-1]) if ends.numel() else 0
    starts = ends - sizes
    b2 = float(b) ** 2
    for low in range(0, total, chunk_size):
        pair = torch.arange(low, min(low + chunk_size, total), device=device)
        which = torch.searchsorted(ends, pair, right=True)
        within = pair - starts.index_select(0, which)
        width = width_b.index_select(0, which)
        i = first_a.index_select(0, which) + torch.div(within, width, rounding_mode="floor")
        j = first_b.index_select(0, which) + torch.remainder(within, width)
        keep = _indices(~same.index_select(0, which) | (i < j))
        i, j = i.index_select(0, keep), j.index_select(0, keep)
        distance2 = None
        for axis, length in enumerate(box):
            d = columns[axis].index_select(0, i) - columns[axis].index_select(0, j)
            d = d - length * torch.round(d * (1.0 / length))
            distance2 = d * d if distance2 is None else distance2 + d * d
        linked = _indices(distance2 <= b2)
        _union(parent, i.index_select(0, linked), j.index_select(0, linked))
    # Every node to its root (pointer jumping until nothing changes).
    while True:
        up = parent.index_select(0, parent)
        if torch.equal(up, parent):
            break
        parent = up
    # Back from the cell order to the points' order.
    return torch.empty_like(parent).index_copy_(0, order, order.index_select(0, parent))


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
        positions, ids, unbatched = _particles(function, positions, ids, distributed)
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
        positions, ids, unbatched = _particles(function, positions, ids, distributed)
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
    if not isinstance(state, SimulationState):
        raise ValueError(f"{function}: `state` must be a torchpm.SimulationState (what the simulation returns), got "
                         f"{type(state).__name__}")
    if isinstance(state, MeshUnitsState):
        state = sim.to_physical(state.positions, state.momenta, state.a, state.ids)
    mesh = sim.force_mesh
    ids = state.ids
    labels = friends_of_friends(state.positions, sim.box_size, linking_length, n_particles=sim.n_total, ids=ids,
                                min_members=min_members, mesh=mesh, chunk_size=chunk_size)
    omega_m = sim.cosmology.Omega_m
    particle_mass = omega_m.to(state.positions.dtype) * (CRITICAL_DENSITY_MSUN * math.prod(sim.box_size) / sim.n_total)
    velocities = state.momenta * (100.0 / float(state.a))
    catalog = halo_catalog(state.positions, labels, sim.box_size, particle_mass=particle_mass, velocities=velocities,
                           ids=ids, min_members=min_members, mesh=mesh)
    return (catalog, labels) if return_labels else catalog
