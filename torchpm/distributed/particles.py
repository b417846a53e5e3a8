"""Particle migration: every particle moves to the rank that owns its position.

Layout of the particles of one rank: tensors ``(B, n, ...)`` with an int64 ``ids``
tensor ``(B, n)``; a slot whose id is ``-1`` is empty (padding). Batch members hold
different numbers of particles on a rank once particles move, so each rank pads
every member to its largest count ``n`` (padding positions sit at the centre of a
neighbouring slot's cell, padding momenta and attributes are 0, and painting gives
padding zero mass). A single device never pads.

Particles that stay keep their slot: only the particles that leave are selected,
sent and written into the slots that are free after the exchange (the slots of the
particles that left and earlier padding, then new slots at the end: when a member
outgrows its slots they grow by 1/64 more than needed, so that a rank gaining
particles step after step does not grow at every step). Per split grid axis this is
one exchange of counts and one uneven all-to-all carrying every per-particle tensor at
once (positions, momenta, ids and any attribute, packed side by side), so a step
costs O(particles that move) in selection and communication, plus one copy of each
per-particle tensor that the caller does not let it overwrite (``overwrite``: the
simulation's step lets it write into its freshly drifted positions and momenta, and
``overwrite_ids`` into the ids an earlier migration returned). When
more than a quarter of the slots end up empty, the particles are compacted to the
front.

A :class:`MigrationPlan` is computed once from positions and ids (who goes where)
and then moves any number of per-particle tensors (momenta, user attributes) with
:meth:`MigrationPlan.exchange`; :meth:`MigrationPlan.gather` is the reverse path
and the adjoint of ``exchange``. Both are made of ``index_select`` / ``index_copy``
and the C++ all-to-all, so autograd differentiates them (the backward of an
exchange is the reverse all-to-all).

Routing is by owner, one uneven all-to-all per split grid axis (x over grid axis
0, then y over grid axis 1): a particle that crossed several blocks in one step
still reaches its owner in one migration. Counts are exchanged first, so no
capacity has to be set; an optional ``capacity`` bounds the slots per batch member
on a rank. Any problem (non-finite positions, capacity exceeded) raises on every
rank together, with the rank, the counts and the setting to change.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch

from ..ops._arguments import particle_ids, particle_positions
from ._ops import all_to_all
from .groups import GridAxis, GridGroups, eager
from .layout import BlockLayout, split_offsets

__all__ = ["MigrationPlan", "migrate", "debug_checks"]

_DEBUG = os.environ.get("TORCHPM_DEBUG_MIGRATION", "0").lower() not in ("", "0", "false", "no")

# Compact the slots when more than this fraction of them is empty after a migration.
_COMPACT_FRACTION = 0.25
# Slots grow by this fraction more than needed (see _headroom).
_HEADROOM_DIVISOR = 64


def debug_checks(enabled: bool | None = None) -> bool:
    """Get (and with ``enabled``, set) whether every migration all-reduces and checks the
    particle count of every batch member before and after (also ``TORCHPM_DEBUG_MIGRATION=1``)."""
    global _DEBUG
    if enabled is not None:
        _DEBUG = bool(enabled)
    return _DEBUG


# ------------------------------------------------------------------ packing

# dtypes every backend's all-to-all moves (complex ones as pairs of reals, in C++)
_SENT_AS_IS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                         torch.complex128, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool})


_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_signed(tensor: torch.Tensor) -> torch.Tensor:
    """A dtype outside :data:`_SENT_AS_IS` (wider unsigned integers, the float8 types, ...),
    which few torch ops accept (index_copy does not), moved as the signed integer of the
    same bits; one that records gradients is left as it is (a view of the bits would cut them)."""
    if tensor.dtype in _SENT_AS_IS or tensor.requires_grad or tensor.element_size() not in _SIGNED:
        return tensor
    return tensor.view(_SIGNED[tensor.element_size()])


def _carrier(tensors: Sequence[torch.Tensor]):
    """Groups of tensors sent in one all-to-all each: ``[(carrier dtype, [indices])]``.

    Floating tensors of one dtype share a buffer (so the exchange stays differentiable);
    int64 tensors ride along in the first floating buffer, bit for bit (``view(dtype)``),
    which moves only bytes and never does arithmetic on them. int16, which gloo cannot
    send, goes as its bytes (uint8; other dtypes the backends lack come as signed
    integers, see :func:`_as_signed`). Anything else gets its own."""
    groups: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        dtype = tensor.dtype
        if dtype not in _SENT_AS_IS and not tensor.requires_grad:
            dtype = torch.uint8
        groups.setdefault(dtype, []).append(index)
    floating = [d for d in groups if d.is_floating_point and d.itemsize in (4, 8)]
    if floating and torch.int64 in groups:
        groups[floating[0]] = groups[floating[0]] + groups.pop(torch.int64)
    return list(groups.items())


def _bitcast_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(S, w)`` rows reinterpreted as ``dtype`` (same bytes; ``w`` scales with the
    itemsizes). Used only on rows that carry no gradient (ids, destinations)."""
    if rows.dtype == dtype:
        return rows
    # A fresh copy: a column slice of the packed buffer can be contiguous (one row) yet
    # start at an offset that the wider dtype cannot view.
    return rows.detach().clone(memory_format=torch.contiguous_format).view(dtype)


def _fill_rows(count: int, template: torch.Tensor, width: int, fill) -> torch.Tensor:
    """``(count, width)`` rows of ``fill`` (a scalar, or a tensor of ``width`` values)."""
    if isinstance(fill, torch.Tensor):
        return fill.to(dtype=template.dtype, device=template.device).reshape(1, width).expand(count, width)
    return template.new_full((count, width), fill)


def _exchange_rows(rows: list[torch.Tensor], send_counts, receive_counts, group_name) -> list[torch.Tensor]:
    """All-to-all of per-particle rows ``(S, w_i)``: as few collectives as the dtypes allow."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    for dtype, members in _carrier(rows):
        parts = [_bitcast_rows(rows[i], dtype) for i in members]
        widths = [p.shape[1] for p in parts]
        packed = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        width = sum(widths)
        received = all_to_all(
            packed.reshape(-1), [c * width for c in send_counts], [c * width for c in receive_counts], group_name
        ).view(-1, width)
        start = 0
        for i, w in zip(members, widths):
            out[i] = _bitcast_rows(received[:, start:start + w], rows[i].dtype)
            start += w
    return out


# ------------------------------------------------------------------ stages
#
# Every stage moves rows between two slot layouts ``(B, count_from, ...)`` and
# ``(B, count_to, ...)`` (slots are flat indices ``b * count + i``): the rows at
# slots ``pick`` go (through an all-to-all for a _Stage, locally for a _Compaction)
# to slots ``put``, and slots ``clear`` of the result get the fill value. Its
# reverse swaps the roles, so both directions are one function.


def _move(tensors, fills, batch, count_from, count_to, pick, put, clear, keep_base, exchange=None, wrap=None,
          overwrite=None):
    """Moves per-particle ``tensors`` ``(B, count_from, ...)`` to ``(B, count_to, ...)``.

    Rows ``pick`` are selected (``wrap = (axis, n)`` wraps column ``axis`` of the first
    tensor's, the positions', into ``[0, n)``), passed through ``exchange`` (rows ->
    rows) when given, and written to slots ``put``; slots ``clear`` get ``fill``
    (``put`` and ``clear`` may be callables, read after the exchange). With
    ``keep_base`` the other slots keep their rows (the first ``count_to`` of each
    member, ``fill`` beyond ``count_from``); without, they are ``fill``.

    The rows are written into a new tensor (one copy of each input), or, where
    ``overwrite[i]`` is true, into ``tensors[i]`` itself when the slot count does not
    change (no copy; never for a tensor that records gradients). A base made here (a
    grown or a filled one) is always written in place: it has no other user."""
    overwrite = overwrite or [False] * len(tensors)
    dtypes = [tensor.dtype for tensor in tensors]
    flats = []
    for tensor in map(_as_signed, tensors):
        features = tuple(tensor.shape[2:])
        width = math.prod(features)
        flats.append((tensor.reshape(batch * count_from, width), features, width))
    rows = [flat.index_select(0, pick) for flat, _, _ in flats]
    if wrap is not None:
        rows[0] = _wrap_rows(rows[0], *wrap)
    if exchange is not None:
        rows = exchange(rows)
    # A stage decides where arrivals go once their positions have come (see _Placement).
    put = put() if callable(put) else put
    clear = clear() if callable(clear) else clear
    out = []
    for (flat, features, width), moved, fill, mine in zip(flats, rows, fills, overwrite):
        fresh = True
        if not keep_base:
            base = _fill_rows(batch * count_to, flat, width, fill).contiguous()
        elif count_to == count_from:
            base = flat
            fresh = mine and not (torch.is_grad_enabled() and flat.requires_grad)
        else:
            view = flat.reshape(batch, count_from, width)
            if count_to < count_from:
                view = view[:, :count_to]
                fresh = False  # a view of the input
            else:
                extra = _fill_rows(count_to - count_from, view, width, fill).unsqueeze(0).expand(batch, -1, -1)
                view = torch.cat([view, extra], dim=1)
            base = view.reshape(batch * count_to, width)
        index, values = put, moved
        if clear is not None and clear.numel():
            index = torch.cat([put, clear])
            values = torch.cat([moved, _fill_rows(clear.numel(), moved, width, fill)])
        written = base.index_copy_(0, index, values) if fresh else base.index_copy(0, index, values)
        out.append(written.view(batch, count_to, *features))
    # (only where the dtype changed: view(dtype) is not differentiable, even to itself)
    return [tensor if tensor.dtype == dtype else tensor.view(dtype) for tensor, dtype in zip(out, dtypes)]


class _Stage:
    """One uneven all-to-all of the particles that leave, over one grid axis.
    Staying particles keep their slot."""

    def __init__(self, grid_axis: GridAxis, batch, count_in, count_out, send_index, placement, clear_in,
                 send_counts, receive_counts):
        self.grid_axis = grid_axis
        self.batch = batch
        self.count_in = count_in  # slots per member before
        self.count_out = count_out  # slots per member after (>= count_in)
        self.send_index = send_index  # input slot of every particle sent, in send order
        self.placement = placement  # decides target and clear_out at the first exchange
        self.target = None  # output slot of every particle received, in receive order
        self.clear_out = None  # output slots left empty that held data before (set to fill)
        self.empty_out = None  # every output slot left empty, increasing
        self.clear_in = clear_in  # input slots that were empty (given fill on the way back)
        self.send_counts = send_counts  # particles to each peer
        self.receive_counts = receive_counts  # particles from each peer

    def forward_many(self, tensors: Sequence[torch.Tensor], fills: Sequence, wrap=None,
                     overwrite=None) -> list[torch.Tensor]:
        """Move ``(B, count_in, ...)`` tensors; ``wrap = (axis, n)`` wraps the first tensor's
        (the positions') column ``axis`` of the particles that leave into ``[0, n)``;
        ``overwrite[i]``: ``tensors[i]`` may be written in place (see :func:`_move`). The
        first call's first tensor must be the positions: they place the arrivals."""
        def exchange(rows):
            rows = _exchange_rows(rows, self.send_counts, self.receive_counts, self.grid_axis.name)
            if self.target is None:
                self.target, self.clear_out, self.empty_out = self.placement.assign(rows[0].detach())
                self.placement = None
            return rows

        return _move(tensors, fills, self.batch, self.count_in, self.count_out, self.send_index,
                     lambda: self.target, lambda: self.clear_out, True, exchange, wrap, overwrite)

    def backward_many(self, tensors: Sequence[torch.Tensor], fills: Sequence) -> list[torch.Tensor]:
        def exchange(rows):
            return _exchange_rows(rows, self.receive_counts, self.send_counts, self.grid_axis.name)

        if self.target is None:
            raise RuntimeError("a migration stage was reversed before it moved the positions")
        return _move(tensors, fills, self.batch, self.count_out, self.count_in, self.target, self.send_index,
                     self.clear_in, True, exchange)


def _member_ranges(count: int, begin: torch.Tensor, end: int, total: int | None = None) -> torch.Tensor:
    """Flat slots ``b * count + i`` for ``begin[b] <= i < end``, member by member
    (``total``: how many, when known on the host: no device sync for it)."""
    lengths = (end - begin).clamp(min=0)
    member = torch.repeat_interleave(torch.arange(begin.numel(), device=begin.device), lengths,
                                     output_size=total)
    within = torch.arange(member.numel(), device=begin.device) - (torch.cumsum(lengths, 0) - lengths)[member]
    return member * count + begin[member] + within


class _Placement:
    """Which free slot each particle arriving in a stage takes, decided when its
    position has come. Per batch member, the arrivals are sorted by the plane of their
    x coordinate in this rank's block (x: the axis along which the CPU paint measures
    its chunks of consecutive slots), and the free slots by that of their last occupant
    (a leaver's clamped into the block) or, for a slot empty already, by the plane that
    :func:`place_empty_slots` gives it from the occupied slots next to it (never its own
    position: see :func:`_plan_stage`); the arrivals in the lower half of the block
    take the lowest free slots, those in the upper half the highest, and when more
    arrive than slots are free the last ones take new slots at the end. A particle so
    lands among slots whose particles share its planes (the slots keep the lattice's
    order, x first). Taken in arrival order instead, the particles coming in across one
    face filled the slots freed at the other, and after a few steps the CPU paint's
    chunks spanned the whole block and it left its fast path (late-time 128^3 on 2
    ranks: 29 ms per paint instead of 12)."""

    def __init__(self, low, high, count, count_out, holes, hole_x, free, arrivals, received, arriving_host,
                 free_host):
        self.low = int(low)  # the block's x planes: [low, high)
        self.planes = int(high) - int(low)
        self.count = count
        self.count_out = count_out
        self.hole_member = holes // count
        self.hole_slot = holes - self.hole_member * count
        self.hole_key = self._keys(self.hole_member, hole_x)
        self.free = free  # (B,) free slots per member
        self.arrivals = arrivals  # (B,) arrivals per member
        self.received = received  # (sources, B) arrivals by source and member: the receive order
        # The same counts on the host: the sizes of what assign makes, without device syncs.
        self.total = sum(arriving_host)
        self.unused = sum(max(f - a, 0) for a, f in zip(arriving_host, free_host))
        self.grown_unused = sum(count_out - count - max(a - f, 0) for a, f in zip(arriving_host, free_host))

    def _keys(self, member, x):
        """``member * planes + plane`` (int64) of x coordinates: the plane in the block,
        clamped into it (NaN to its first plane). Within a cell the key does not change,
        so neither does the placement when a particle moves a little."""
        plane = torch.nan_to_num(torch.floor(x), nan=float(self.low)).clamp_(self.low, self.low + self.planes - 1)
        return member * self.planes + (plane.to(torch.int64) - self.low)

    def assign(self, positions: torch.Tensor):
        """``(target, clear_out, empty_out)`` for the received position rows ``(S, 3)`` in
        receive order: the output slot of each, the free slots no arrival took, and every
        slot left empty (those and the new slots no arrival took), increasing."""
        device = positions.device
        sources, batch = self.received.shape
        member = torch.repeat_interleave(torch.arange(batch, device=device).repeat(sources),
                                         self.received.reshape(-1), output_size=self.total)
        key = self._keys(member, positions[:, 0])
        order = torch.argsort(key, stable=True)  # by member, then plane; ties in receive order
        by_member = member[order]
        start = torch.cumsum(self.arrivals, 0) - self.arrivals
        rank = torch.arange(order.numel(), device=device) - start[by_member]
        below_middle = (2 * (key - member * self.planes) + 1 < self.planes).to(torch.int64)
        lower = torch.zeros(batch, dtype=torch.int64, device=device).index_add_(0, member, below_middle)
        arriving, free = self.arrivals[by_member], self.free[by_member]
        # Rank among the member's free slots sorted by plane; >= free: a new slot.
        hole = torch.where((rank < lower[by_member]) | (arriving > free), rank, free - arriving + rank)
        hole_order = torch.argsort(self.hole_key, stable=True)
        slots = self.hole_slot[hole_order]
        hole_start = torch.cumsum(self.free, 0) - self.free
        slot = self.count + rank - free
        if slots.numel():
            picked = slots[(hole_start[by_member] + hole).clamp_(0, slots.numel() - 1)]
            slot = torch.where(hole < free, picked, slot)
        target = torch.empty_like(order)
        target[order] = by_member * self.count_out + slot
        # The free slots that no arrival took: those between the two ends.
        owner = self.hole_member[hole_order]
        rank = torch.arange(slots.numel(), device=device) - hole_start[owner]
        arriving, free, below = self.arrivals[owner], self.free[owner], lower[owner]
        used = (arriving >= free) | (rank < below) | (rank >= free - (arriving - below))
        unused = torch.argsort(used.to(torch.int8), stable=True)[: self.unused]  # in hole order
        clear_out = owner[unused] * self.count_out + slots[unused]
        grown = _member_ranges(self.count_out, self.count + (self.arrivals - self.free).clamp(min=0), self.count_out,
                               self.grown_unused)
        return target, clear_out, torch.sort(torch.cat([clear_out, grown])).values


class _Compaction:
    """Local: the occupied slots ``keep`` (in order) move to the front of each member."""

    def __init__(self, batch, count_in, count_out, keep, place, occupied):
        self.batch = batch
        self.count_in = count_in
        self.count_out = count_out
        self.keep = keep  # input slots of the particles, in order
        self.place = place  # their output slots
        self.empty_out = _member_ranges(count_out, occupied, count_out)  # the slots after them

    def forward_many(self, tensors, fills):
        return _move(tensors, fills, self.batch, self.count_in, self.count_out, self.keep, self.place, None, False)

    def backward_many(self, tensors, fills):
        return _move(tensors, fills, self.batch, self.count_out, self.count_in, self.place, self.keep, None, False)


class MigrationPlan:
    """Who moves where in one migration: apply it to any per-particle tensor.

    Attributes:
        count_in, count_out: slots per batch member before and after.
        padding: ``(B, count_out)`` bool, True for empty slots after the migration
            (computed when read: a step that does not read it makes no pass for it).
    """

    def __init__(self, stages, count_in, count_out, ids, grid: GridGroups | None = None):
        self.stages = stages
        self.count_in = count_in
        self.count_out = count_out
        self._ids = ids  # after the migration
        self._grid = grid  # the ranks agree on each call before its all-to-alls (None: not checked)

    @property
    def padding(self) -> torch.Tensor:
        return self._ids < 0

    def masses(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``(B, count_out)`` weights for the paint after the migration: 1 for a particle,
        0 for an empty slot; None when no slot is empty, and on one device (no stage: one
        device never pads). From the last stage's list of empty slots: no pass over the
        ids and no host sync."""
        if not self.stages or not self.stages[-1].empty_out.numel():
            return None
        empty = self.stages[-1].empty_out
        weights = torch.ones(self._ids.numel(), dtype=dtype, device=self._ids.device)
        return weights.index_fill_(0, empty, 0).view(self._ids.shape)

    def exchange(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        """Move ``(B, count_in, ...)`` per-particle values with their particles:
        ``(B, count_out, ...)``, ``fill`` in empty slots. Collective; differentiable."""
        return self.exchange_many([tensor], [fill])[0]

    @eager(local=lambda plan, *args, **kwargs: not plan.stages)
    def exchange_many(self, tensors: Sequence[torch.Tensor], fills: Sequence | None = None) -> list[torch.Tensor]:
        """:meth:`exchange` of several tensors at once, in one all-to-all per stage."""
        tensors = list(tensors)
        fills = [0] * len(tensors) if fills is None else list(fills)
        self._check(tensors, self.count_in, "exchange")
        for stage in self.stages:
            tensors = stage.forward_many(tensors, fills)
        return tensors

    @eager(local=lambda plan, *args, **kwargs: not plan.stages)
    def gather(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        """The reverse path: ``(B, count_out, ...)`` values back to the slots the
        particles came from, ``(B, count_in, ...)``. The adjoint of :meth:`exchange`."""
        self._check([tensor], self.count_out, "gather")
        tensors = [tensor]
        for stage in reversed(self.stages):
            tensors = stage.backward_many(tensors, [fill])
        return tensors[0]

    def _check(self, tensors, count, method):
        """Each tensor ``(B, count, ...)``; on a grid, the ranks agree on the tensors'
        dtypes and per-particle shapes (they set the messages' sizes: ranks that differ
        would abort gloo or read wrong values) and raise one rank's error together."""
        batch = self._ids.shape[0]
        error = None
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or tensor.shape[0] != batch \
                    or tensor.shape[1] != count:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                error = (f"MigrationPlan.{method}: expected a per-particle tensor of shape ({batch}, {count}, ...), "
                         f"got {got}")
                break
        if self._grid is None:
            if error:
                raise ValueError(error)
            return
        self._grid.agree(f"MigrationPlan.{method}", [
            ("number of tensors", len(tensors)),
            ("tensors (dtype, per-particle shape)",
             tuple((str(t.dtype), tuple(t.shape[2:])) if isinstance(t, torch.Tensor) else type(t).__name__
                   for t in tensors))], error)


# ------------------------------------------------------------------ planning

def migration_holes_reference(positions: torch.Tensor, ids: torch.Tensor, axis: int, low: float, high: float):
    """Pure-torch twin of ``torch.ops.torchpm._migration_holes`` (the test oracle, and
    the kernel on CUDA, where each of its passes is one fast kernel): the flat indices,
    increasing, of the empty slots and of the occupied ones whose coordinate ``axis``
    is outside ``[low, high)`` (NaN stays), and the number of occupied slots with a
    non-finite coordinate or one at or beyond +-2^40 cells (0-d int64)."""
    valid = ids >= 0
    column = positions[..., axis].detach()
    leave = valid & ((column < low) | (column >= high))
    holes = torch.nonzero((leave | ~valid).reshape(-1)).reshape(-1)
    non_finite = (valid & ~_within_reach(positions.detach()).all(-1)).sum()
    return holes, non_finite


def _migration_holes_fake(positions, ids, axis, low, high):
    size = torch.library.get_ctx().new_dynamic_size()
    return ids.new_empty(size), ids.new_empty(())


torch.library.register_fake("torchpm::_migration_holes")(_migration_holes_fake)
def _migration_holes_device(positions: torch.Tensor, ids: torch.Tensor, axis: int, low: float, high: float):
    """The CUDA kernel: the CPU op's argument checks (same messages), then the pure-torch twin."""
    op = "torchpm._migration_holes"
    particle_positions(op, positions)
    if not 0 <= axis < 3:
        raise ValueError(f"{op}: expected `axis` 0, 1 or 2, got {axis}.")
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ValueError(f"{op}: expected finite bounds `low` <= `high`, got {low:g} and {high:g}.")
    particle_ids(op, ids, positions)
    return migration_holes_reference(positions, ids, axis, low, high)


torch.library.register_kernel("torchpm::_migration_holes", "cuda")(_migration_holes_device)


def _wrapped_column(column: torch.Tensor, n: int) -> torch.Tensor:
    """``column`` wrapped into ``[0, n)``."""
    wrapped = torch.remainder(column, n)
    # remainder may round a tiny negative value up to exactly n in float32.
    return torch.where(wrapped >= n, wrapped - n, wrapped)


def _wrap_rows(rows: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """Position rows ``(S, 3)`` with column ``axis`` wrapped into ``[0, n)`` (differentiable)."""
    column = _wrapped_column(rows[:, axis], n).unsqueeze(1)
    mask = torch.zeros(1, rows.shape[1], dtype=torch.bool, device=rows.device)
    mask[0, axis] = True
    return torch.where(mask, column, rows)


def _status_error(table, grid: GridGroups, what):
    """The error message of a failed status table ``(ranks, 4)``: (non-finite, member,
    count, that rank's capacity)."""
    lines = []
    for rank, (bad, member, count, capacity) in enumerate(table.tolist()):
        coords = divmod(rank, grid.shape[1])
        if bad:
            lines.append(f"rank {rank} (grid {coords}) holds {bad} particle(s) with NaN or infinite positions, "
                         "or at or beyond +-2^40 cells")
        elif member >= 0:
            lines.append(
                f"rank {rank} (grid {coords}) would hold {count} particles of batch member {member}, more "
                f"than the capacity {capacity}"
            )
    advice = (
        " Raise `particle_capacity` (or set it to None to let buffers grow as needed)."
        if any(row[1] >= 0 for row in table.tolist()) else
        " Either the input was bad (the initial conditions, or a state or snapshot resumed: check it), or the"
        " simulation diverged (check the time steps)."
    )
    return f"particle migration ({what}) failed: " + "; ".join(lines) + "." + advice


def _headroom(count: int, capacity: int | None) -> int:
    """Empty slots added when a member outgrows its slots: 1/64 of them, within
    ``capacity`` (far below the quarter that triggers a compaction)."""
    room = count // _HEADROOM_DIVISOR
    if capacity is not None:
        room = min(room, max(0, capacity - count))
    return room


def _plan_stage(layout: BlockLayout, grid: GridGroups, axis: int, positions, ids, destination, capacity=None,
                corner=(0.0, 0.0, 0.0)):
    """The stage of grid ``axis`` for particles ``positions`` / ``ids`` ``(B, count, ...)``;
    when the slots grow, they grow with headroom (within ``capacity``). ``corner``: the
    position of the empty slots of a member without particles (:func:`place_empty_slots`)."""
    grid_axis = grid.axes[axis]
    size = grid_axis.size
    batch, count = ids.shape
    device = ids.device
    me = grid.coords[axis]
    # Free slots after the particles leave: theirs and earlier padding, in slot order
    # (one pass); the leavers and the earlier padding are split from them.
    non_finite = None
    if destination is None:
        sizes = layout.real_x if axis == 0 else layout.real_y
        low = split_offsets(sizes)[me]
        # NaN compares False both ways: it stays, and the finiteness count reports it.
        holes, non_finite = torch.ops.torchpm._migration_holes(
            positions.detach(), ids, axis, float(low), float(low + sizes[me]))
    else:
        coordinate = destination // grid.shape[1] if axis == 0 else destination % grid.shape[1]
        holes = torch.nonzero(((ids < 0) | (coordinate != me)).reshape(-1)).reshape(-1)
    hole_valid = ids.reshape(-1)[holes] >= 0
    # The leavers, then the earlier padding, each in slot order; their split and the
    # non-finite count in one transfer (one device sync).
    split = torch.argsort(hole_valid.logical_not().to(torch.int8), stable=True)
    counted = torch.stack([hole_valid.sum()] + ([non_finite.reshape(())] if non_finite is not None else [])).tolist()
    leaving = counted[0]
    if non_finite is not None:
        non_finite = counted[1]  # occupied slots with a non-finite position, on the host
    send_flat, clear_in = holes[split[:leaving]], holes[split[leaving:]]
    member = send_flat // count
    if destination is None:
        n = layout.global_shape[axis]
        column = positions.detach().reshape(-1, 3)[send_flat, axis]
        plane = torch.floor(_wrapped_column(column, n))
        peer = layout.owner(plane.to(torch.int64).clamp_(0, n - 1), axis)
    else:
        peer = coordinate.reshape(-1)[send_flat]
    key = peer * batch + member
    order = torch.argsort(key, stable=True)
    send_index = send_flat[order]
    counts = torch.zeros(size * batch, dtype=torch.int64, device=device).index_add_(
        0, key, torch.ones_like(key)).view(size, batch)  # (a bincount without its device sync)
    received = all_to_all(counts.reshape(-1).contiguous(), [batch] * size, [batch] * size, grid_axis.name)
    received = received.view(size, batch)
    arrivals = received.sum(0)  # per member

    # Free slots per member (holes are increasing); then every count the host needs, in
    # one transfer (one device sync).
    free = torch.diff(torch.searchsorted(holes, torch.arange(batch + 1, device=device) * count))
    host = torch.cat([arrivals, free, counts.sum(1), received.sum(1)]).tolist()
    arriving_host, free_host = host[:batch], host[batch:2 * batch]
    send_counts, receive_counts = host[2 * batch:2 * batch + size], host[2 * batch + size:]
    grow = max([0] + [a - f for a, f in zip(arriving_host, free_host)])
    count_out = count + grow
    if grow:
        # Headroom: a rank that gains particles step after step (a collapsing region)
        # would otherwise grow, and copy every per-particle tensor, at every step.
        count_out += _headroom(count_out, capacity)
    x_low = split_offsets(layout.real_x)[grid.coords[0]]
    # The free slots' x, by which the arrivals are placed: a leaver's own; an earlier
    # empty slot's as place_empty_slots would set it now, from the occupied slot next to
    # it. Not its own position: the steps kick and drift the empty slots too after the
    # migration placed them, and a state returned to the user resets them (zero
    # momentum), so a run resumed from it would place the arrivals, and paint, in
    # another order. So no migration reads an empty slot's position or momentum.
    hole_x = positions.detach().reshape(-1, 3)[holes, 0]
    if len(clear_in):
        padding_x = _empty_slot_rows(positions.detach().reshape(-1, 3)[:, :1], count, clear_in, float(corner[0]))
        hole_x = hole_x.masked_scatter(~hole_valid, padding_x.reshape(-1))
    placement = _Placement(x_low, x_low + layout.real_x[grid.coords[0]], count, count_out, holes,
                           hole_x, free, arrivals, received, arriving_host, free_host)
    stage = _Stage(grid_axis, batch, count, count_out, send_index, placement, clear_in, send_counts,
                   receive_counts)
    # Occupied slots per member afterwards, without a pass over the slots.
    occupied = [count - f + a for a, f in zip(arriving_host, free_host)]
    return stage, occupied, non_finite


def _plan_compaction(ids: torch.Tensor, capacity: int | None, occupied: list[int]):
    """A :class:`_Compaction` when more than a quarter of the slots is empty, or when
    compacting brings the slots within ``capacity``; else None. ``occupied``: the
    occupied slots of each member, on the host (no device sync for the decision)."""
    batch, count = ids.shape
    count_out = max(occupied, default=0)
    needed = capacity is not None and count > capacity
    if count_out == count or (count - count_out <= _COMPACT_FRACTION * count and not needed):
        return None
    valid = ids >= 0
    keep = torch.nonzero(valid.reshape(-1)).reshape(-1)
    occupied = torch.tensor(occupied, dtype=torch.int64, device=ids.device)
    member = keep // count
    rank = torch.arange(keep.numel(), device=ids.device) - (torch.cumsum(occupied, 0) - occupied)[member]
    return _Compaction(batch, count, count_out, keep, member * count_out + rank, occupied)


def migrate(layout: BlockLayout, grid: GridGroups, positions: torch.Tensor, ids: torch.Tensor,
            *attributes: torch.Tensor, capacity: int | None = None, corner=(0.0, 0.0, 0.0),
            destination: torch.Tensor | None = None, overwrite: bool = False, overwrite_ids: bool = False,
            check_agreement: bool = False):
    """Move particles to the ranks that own their positions.

    Args:
        layout, grid: the decomposition's block layout and process grid.
        positions: ``(B, n, 3)`` global mesh-cell units, float32 or float64.
        ids: ``(B, n)`` int64, ``-1`` for empty slots.
        attributes: more per-particle tensors ``(B, n, ...)`` moved in the same all-to-alls.
        capacity: most slots per batch member a rank may hold afterwards (None: no limit).
        corner: position given to the empty slots of a member left without particles (a
            point inside this rank's block); the others sit next to their neighbours
            (:func:`place_empty_slots`).
        destination: optional ``(B, n)`` int64 grid rank ``r0 * P1 + r1`` to send each
            particle to, instead of the owner of its position (e.g. to bring values
            back to where they started).
        overwrite: ``positions`` and ``attributes`` are the caller's scratch: the
            migration may write into them instead of copying them (never into a tensor
            that records gradients).
        overwrite_ids: ``ids`` too (a plan returned earlier reads the ids it returned:
            its ``padding`` changes when a later migration writes into them).
        check_agreement: the returned plan's ``exchange`` and ``gather`` check that the
            ranks agree on each call first (the decomposition's setting).

    Returns:
        ``(plan, positions, ids, *attributes)`` ``(B, count_out, ...)``: positions are
        wrapped into ``[0, n)`` along split axes. Collective over the grid.
    """
    bad = None  # occupied slots with a non-finite position, counted by the first stage's pass
    # Only a grid migrates: on one device nothing here touches the host (a CUDA graph
    # may capture the step).
    fill_position = torch.tensor(corner, dtype=positions.dtype, device=positions.device) if grid.size > 1 else None
    stages = []
    count_in = ids.shape[1]
    for axis in (0, 1):
        if grid.axes[axis].size == 1:
            continue
        stage, occupied, non_finite = _plan_stage(layout, grid, axis, positions, ids, destination, capacity,
                                                  corner)
        if bad is None:
            bad = _count_non_finite(positions, ids) if non_finite is None else non_finite
        payload = [positions, ids, *attributes] + ([] if destination is None else [destination])
        fills = [fill_position, -1] + [0] * len(attributes) + ([] if destination is None else [-1])
        # The first stage writes into the caller's tensors only if allowed; a later one
        # into what the earlier stage made.
        mine = [overwrite, overwrite_ids] + [overwrite] * len(attributes) + [False] * (destination is not None)
        if stages:
            mine = [True] * len(payload)
        stages.append(stage)
        positions, ids, *rest = stage.forward_many(payload, fills, wrap=(axis, layout.global_shape[axis]),
                                                   overwrite=mine)
        attributes = tuple(rest[: len(attributes)])
        if destination is not None:
            destination = rest[-1]
    if stages:
        compaction = _plan_compaction(ids, capacity, occupied)
        if compaction is not None:
            stages.append(compaction)
            fills = [fill_position, -1] + [0] * len(attributes)
            positions, ids, *rest = compaction.forward_many([positions, ids, *attributes], fills)
            attributes = tuple(rest)
    count_out = ids.shape[1]
    if stages:
        place_empty_slots(positions, ids, fill_position, stages[-1].empty_out)
        # Fail together: every rank reports (non-finite, overflowing member, its count).
        status = torch.tensor([bad, -1, 0, 0], dtype=torch.int64)
        if capacity is not None and count_out > capacity:
            # `occupied` (per member, from the last stage's counts) is unchanged by a compaction.
            status = torch.tensor([0, occupied.index(max(occupied)), count_out, capacity], dtype=torch.int64)
        table = torch.zeros(grid.size, 4, dtype=torch.int64, device=ids.device)
        table[:, 1] = -1
        table[grid.rank] = status.to(ids.device)
        table = _reduce_status(table, grid)
        if bool((table[:, 0] > 0).any()) or bool((table[:, 1] >= 0).any()):
            raise RuntimeError(_status_error(table.cpu(), grid, "after the exchange"))
    # Empty slots: positions next to their neighbours (place_empty_slots), ids -1, attributes 0.
    plan = MigrationPlan(stages, count_in, count_out, ids, grid if check_agreement and stages else None)
    return (plan, positions, ids, *attributes)


def place_empty_slots(positions: torch.Tensor, ids: torch.Tensor, corner, empty: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Writes the position of every empty slot (``ids < 0``) of ``(B, n, 3)`` contiguous
    ``positions`` in place: the centre of the cell of the nearest occupied slot before
    it in its batch member (after it, for empty slots at the member's start), or
    ``corner`` in a member without particles. ``empty``: the flat indices ``b * n + i``
    of the empty slots, increasing, when known (else found from ``ids``). Returns
    ``positions``.

    Painted with zero weight, an empty slot adds nothing wherever it sits; next to its
    neighbours in slot order it keeps the CPU paint's chunks of consecutive slots
    narrow (its fast path), and a GPU paint does not pile every empty slot onto one
    node. The position depends only on the occupied slots' positions and the layout, so
    a restart that restores the layout (:func:`torchpm.io.restart_state`) restores the
    empty slots as the migration left them; and a migration places the arrivals by the
    same rule applied to the positions it is given, not by where the empty slots have
    drifted since. It carries no gradient."""
    if empty is None:
        empty = torch.nonzero(ids.reshape(-1) < 0).reshape(-1)
    if not empty.numel():
        return positions
    flat = positions.view(-1, 3)
    flat.index_copy_(0, empty, _empty_slot_rows(flat, ids.shape[1], empty, corner))
    return positions


def _empty_slot_rows(flat: torch.Tensor, count: int, empty: torch.Tensor, corner) -> torch.Tensor:
    """The rows :func:`place_empty_slots` gives the empty slots ``empty`` (flat indices
    ``b * count + i``, increasing, every empty slot of the members they are in) of the
    ``(B * count, w)`` rows ``flat``: the cell centre of the nearest occupied slot before
    (else after) in its member, ``corner`` in a member without particles. Read from the
    occupied slots only; writes nothing. With ``w = 1`` (one coordinate column) and a
    scalar ``corner``, that coordinate alone."""
    # Runs of consecutive empty slots within a member.
    slot = empty % count
    first = torch.ones_like(empty, dtype=torch.bool)
    first[1:] = (empty[1:] != empty[:-1] + 1) | (slot[1:] == 0)
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    # Each slot's run start and end, by running max / min of the run boundaries' indices.
    index = torch.arange(empty.numel(), device=empty.device)
    start = empty[torch.cummax(torch.where(first, index, 0), 0).values]
    end_index = torch.where(last, index, empty.numel() - 1).flip(0)
    end = empty[torch.cummin(end_index, 0).values.flip(0)]
    member_start = empty - slot
    after_start = start > member_start
    source = torch.where(after_start, start - 1, end + 1)
    occupied = after_start | (end + 1 < member_start + count)
    rows = torch.floor(flat.detach().index_select(0, torch.where(occupied, source, 0))).add_(0.5)
    if not isinstance(corner, float):  # (a Python float needs no copy to the device)
        corner = torch.as_tensor(corner, dtype=rows.dtype, device=rows.device)
    return torch.where(occupied.unsqueeze(1), rows, corner)


# Beyond this many cells from the origin a coordinate is refused (the paint's limit,
# csrc/torchpm.h kMaxAbsPosition): wrapping a split axis would hide it.
MAX_ABS_POSITION = 2.0**40


def _within_reach(positions: torch.Tensor) -> torch.Tensor:
    """Finite coordinates inside +-2^40 cells (NaN compares false), as the paint takes them."""
    return positions.abs() < MAX_ABS_POSITION


def _count_non_finite(positions: torch.Tensor, ids: torch.Tensor) -> int:
    """Occupied slots (``ids >= 0``) whose position has a NaN or infinite coordinate, or
    one at or beyond +-2^40 cells.

    One contiguous reduction (the smallest and largest coordinate, NaN if any is; about
    0.9 ms for a million particles on 2 CPU threads, a sum 0.4 ms) settles the usual
    case; only a tensor holding such a coordinate (a bad particle, or an empty slot
    holding one) pays for the per-particle count (about 10 ms: a reduction over the 3
    coordinates is slow)."""
    detached = positions.detach()
    if detached.numel() == 0:
        return 0
    low, high = torch.aminmax(detached)
    if bool((low > -MAX_ABS_POSITION) & (high < MAX_ABS_POSITION)):
        return 0
    return int(((ids >= 0) & ~_within_reach(detached).all(-1)).sum())


def _reduce_status(table, grid: GridGroups):
    """Sum of the per-rank status rows (each rank fills its own; others hold 0 / -1)."""
    offset = table.clone()
    offset[:, 1] += 1  # -1 (no overflow) becomes 0 so that sums keep the one real entry
    offset = grid.all_reduce(offset, "sum")
    offset[:, 1] -= 1
    return offset


# ------------------------------------------------------------------ rows routed by rank


def route_rows(rows: torch.Tensor, destination: torch.Tensor, grid: GridGroups) -> torch.Tensor:
    """``(n, w)`` int64 rows of every rank, each sent to grid rank ``destination`` (``(n,)``),
    through one all-to-all per split grid axis (collective): the rows this rank receives."""
    rows = torch.cat([rows, destination.reshape(-1, 1)], 1)
    for axis, grid_axis in enumerate(grid.axes):
        if grid_axis.size == 1:
            continue
        peer = rows[:, -1] // grid.shape[1] if axis == 0 else rows[:, -1] % grid.shape[1]
        rows = rows[torch.argsort(peer, stable=True)]
        sent = torch.bincount(peer, minlength=grid_axis.size)
        received = all_to_all(sent, [1] * grid_axis.size, [1] * grid_axis.size, grid_axis.name)
        rows = _exchange_rows([rows], sent.tolist(), received.tolist(), grid_axis.name)[0]
    return rows[:, :-1]


def duplicate_ids_error(function: str, ids: torch.Tensor, grid: GridGroups, first_member: int = 0) -> str | None:
    """On a grid: the error when an id of a batch member of ``(B, n)`` ``ids`` (``-1``:
    empty) is held by two ranks (each rank's own must be unique already), on the rank
    that finds it (raise it together). Each (member, id) goes to rank ``id % ranks``,
    which looks for pairs (one all-to-all of the valid ids per split grid axis;
    collective). ``first_member``: the batch member the first row of ``ids`` is (named
    in the message)."""
    member, slot = torch.nonzero(ids >= 0, as_tuple=True)
    value = ids[member, slot]
    rows = route_rows(torch.stack([member, value], 1), value % grid.size, grid)
    # (sorted by member, then id: two stable sorts; torch.unique(dim=0) is several times slower)
    order = torch.argsort(rows[:, 1], stable=True)
    ordered = rows[order[torch.argsort(rows[order, 0], stable=True)]]
    repeated = (ordered[1:] == ordered[:-1]).all(1)
    if not bool(repeated.any()):
        return None
    member, value = ordered[1:][repeated][0].tolist()
    return (f"{function}: `ids` must be unique within each batch member over all ranks, got id {value} of member "
            f"{member + first_member} on two ranks")


_ID_PRIME = 2**31 - 1


def id_power_sums(ids: torch.Tensor) -> torch.Tensor:
    """``(4,)`` int64 power sums over ``ids`` (int64, each < 2^32): of the ids, and of their
    squares, cubes and fourth powers mod the prime 2^31 - 1 (exact in int64 for fewer than
    2^32 ids). Two sets of at most 4 ids with the same sums are the same set, up to
    collisions mod the prime (Newton's identities)."""
    x = ids % _ID_PRIME
    x2 = x * x % _ID_PRIME
    x3 = x2 * x % _ID_PRIME
    return torch.stack([ids.sum(), x2.sum(), x3.sum(), (x3 * x % _ID_PRIME).sum()])


def members_not_each_once(ids: torch.Tensor, n_total: int, grid: GridGroups) -> list[int]:
    """The batch members whose ``(B, n)`` ids (``< 0``: an empty slot) over the grid are
    not each of ``0 .. n_total-1`` once, for ids in range that number ``n_total`` per
    member over the grid: one all-reduce of power sums (:func:`id_power_sums`; each rank
    adds its ids' less its share's of ``0 .. n_total-1``, so the totals are 0 when no id is
    held twice). The same list on every rank. Collective."""
    share = id_power_sums(torch.arange(grid.rank, n_total, grid.size, dtype=torch.int64, device=ids.device))
    # (an empty slot as id 0, which adds 0 to every sum)
    sums = torch.stack([id_power_sums(torch.where(row >= 0, row, 0)) for row in ids.to(torch.int64)])
    return [member for member, total in enumerate(grid.all_reduce(sums - share).tolist()) if any(total)]
