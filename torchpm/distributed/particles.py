"""Particle migration: every particle moves to the rank that owns its position.

Layout of the particles of one rank: tensors ``(B, n, ...)`` with an int64 ``ids``
tensor ``(B, n)``; a slot whose id is ``-1`` is empty (padding). Batch members hold
different numbers of particles on a rank once particles move, so each rank pads
every member to its largest count ``n`` (padding positions sit at the block's
lower corner, padding momenta and attributes are 0, and painting gives padding
zero mass). A single device never pads.

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

import torch

from ._ops import all_to_all
from .groups import GridAxis, GridGroups
from .layout import BlockLayout

__all__ = ["MigrationPlan", "migrate", "debug_checks"]

_DEBUG = os.environ.get("TORCHPM_DEBUG_MIGRATION", "0").lower() not in ("", "0", "false", "no")


def debug_checks(enabled: bool | None = None) -> bool:
    """Get (and with ``enabled``, set) whether every migration all-reduces and checks the
    particle count of every batch member before and after (also ``TORCHPM_DEBUG_MIGRATION=1``)."""
    global _DEBUG
    if enabled is not None:
        _DEBUG = bool(enabled)
    return _DEBUG


class _Stage:
    """One uneven all-to-all of particles over one grid axis."""

    def __init__(self, grid_axis: GridAxis, batch, count_in, count_out, send_index, target,
                 send_counts, receive_counts):
        self.grid_axis = grid_axis
        self.batch = batch
        self.count_in = count_in  # slots per member before
        self.count_out = count_out  # slots per member after
        self.send_index = send_index  # flat (b * count_in + i) of every particle sent, in send order
        self.target = target  # flat (b * count_out + j) of every particle received, in receive order
        self.send_counts = send_counts  # particles to each peer
        self.receive_counts = receive_counts  # particles from each peer

    def forward(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        features = tuple(tensor.shape[2:])
        width = math.prod(features)
        flat = tensor.reshape(self.batch * self.count_in, width).index_select(0, self.send_index)
        received = all_to_all(
            flat.reshape(-1), [c * width for c in self.send_counts], [c * width for c in self.receive_counts],
            self.grid_axis.name,
        ).view(-1, width)
        out = tensor.new_full((self.batch * self.count_out, width), fill)
        out = out.index_copy(0, self.target, received)
        return out.view(self.batch, self.count_out, *features)

    def backward(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        features = tuple(tensor.shape[2:])
        width = math.prod(features)
        flat = tensor.reshape(self.batch * self.count_out, width).index_select(0, self.target)
        received = all_to_all(
            flat.reshape(-1), [c * width for c in self.receive_counts], [c * width for c in self.send_counts],
            self.grid_axis.name,
        ).view(-1, width)
        out = tensor.new_full((self.batch * self.count_in, width), fill)
        out = out.index_copy(0, self.send_index, received)
        return out.view(self.batch, self.count_in, *features)


class MigrationPlan:
    """Who moves where in one migration: apply it to any per-particle tensor.

    Attributes:
        count_in, count_out: slots per batch member before and after.
        padding: ``(B, count_out)`` bool, True for empty slots after the migration.
    """

    def __init__(self, stages, count_in, count_out, padding):
        self.stages = stages
        self.count_in = count_in
        self.count_out = count_out
        self.padding = padding

    def exchange(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        """Move ``(B, count_in, ...)`` per-particle values with their particles:
        ``(B, count_out, ...)``, ``fill`` in empty slots. Collective; differentiable."""
        self._check(tensor, self.count_in, "exchange")
        for stage in self.stages:
            tensor = stage.forward(tensor, fill)
        return tensor

    def gather(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        """The reverse path: ``(B, count_out, ...)`` values back to the slots the
        particles came from, ``(B, count_in, ...)``. The adjoint of :meth:`exchange`."""
        self._check(tensor, self.count_out, "gather")
        for stage in reversed(self.stages):
            tensor = stage.backward(tensor, fill)
        return tensor

    def _check(self, tensor, count, method):
        batch = self.padding.shape[0]
        if tensor.dim() < 2 or tensor.shape[0] != batch or tensor.shape[1] != count:
            raise ValueError(
                f"MigrationPlan.{method}: expected a per-particle tensor of shape ({batch}, {count}, ...), "
                f"got {tuple(tensor.shape)}"
            )


def _wrap(positions: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Positions wrapped into ``[0, n)`` along the split axes (the owner is defined there)."""
    if layout.grid_shape == (1, 1):
        return positions
    columns = []
    for axis in range(3):
        column = positions[..., axis]
        if axis < 2 and layout.grid_shape[axis] > 1:
            n = layout.global_shape[axis]
            column = torch.remainder(column, n)
            # remainder may round a tiny negative value up to exactly n in float32.
            column = torch.where(column >= n, column - n, column)
        columns.append(column)
    return torch.stack(columns, dim=-1)


def _stable_order(key: torch.Tensor, keys: int) -> torch.Tensor:
    """Indices that sort ``key`` (values in ``[0, keys]``) stably.

    With few distinct keys (peers x batch members) one pass per key with ``nonzero``
    is O(n) each and several times faster than a comparison sort of every particle."""
    if keys > 32:
        return torch.argsort(key, stable=True)
    return torch.cat([torch.nonzero(key == value).reshape(-1) for value in range(keys + 1)])


def _status_error(table, grid: GridGroups, capacity, what):
    """The error message of a failed status table ``(ranks, 3)``: (non-finite, member, count)."""
    lines = []
    for rank, (bad, member, count) in enumerate(table.tolist()):
        coords = divmod(rank, grid.shape[1])
        if bad:
            lines.append(f"rank {rank} (grid {coords}) holds {bad} particle(s) with NaN or infinite positions")
        elif member >= 0:
            lines.append(
                f"rank {rank} (grid {coords}) would hold {count} particles of batch member {member}, more "
                f"than the capacity {capacity}"
            )
    advice = (
        " Raise `particle_capacity` (or set it to None to let buffers grow as needed)."
        if any(row[1] >= 0 for row in table.tolist()) else
        " The simulation has diverged or was given non-finite input; check the time steps and the initial conditions."
    )
    return f"particle migration ({what}) failed: " + "; ".join(lines) + "." + advice


def migrate(layout: BlockLayout, grid: GridGroups, positions: torch.Tensor, ids: torch.Tensor, *,
            capacity: int | None = None, corner=(0.0, 0.0, 0.0), destination: torch.Tensor | None = None):
    """Move particles to the ranks that own their positions.

    Args:
        layout, grid: the decomposition's block layout and process grid.
        positions: ``(B, n, 3)`` global mesh-cell units (any float dtype).
        ids: ``(B, n)`` int64, ``-1`` for empty slots.
        capacity: most slots per batch member a rank may hold afterwards (None: no limit).
        corner: position given to empty slots (a point inside this rank's block).
        destination: optional ``(B, n)`` int64 grid rank ``r0 * P1 + r1`` to send each
            particle to, instead of the owner of its position (e.g. to bring values
            back to where they started).

    Returns:
        ``(plan, positions, ids)``: the plan, and the wrapped, moved positions and ids
        ``(B, count_out, ...)``. Collective over the grid.
    """
    positions = _wrap(positions, layout)
    batch, count = ids.shape
    stages = []
    first = True
    for axis in (0, 1):
        grid_axis = grid.axes[axis]
        if grid_axis.size == 1:
            continue
        size = grid_axis.size
        valid = ids >= 0
        plane = torch.floor(positions[..., axis].detach())
        finite = torch.isfinite(plane)
        # A non-finite coordinate makes the sum of the three non-finite (one pass, not three).
        bad = int((valid & ~torch.isfinite(positions.detach().sum(-1))).sum()) if first else 0
        plane = torch.where(finite, plane, torch.zeros_like(plane)).to(torch.int64)
        plane = plane.clamp_(0, layout.global_shape[axis] - 1)  # only non-finite positions are affected
        if destination is None:
            target_coords = layout.owner(plane, axis)
        else:
            target_coords = destination // grid.shape[1] if axis == 0 else destination % grid.shape[1]
        member = torch.arange(batch, device=ids.device).unsqueeze(1).expand(batch, count)
        key = torch.where(valid, target_coords * batch + member, torch.full_like(target_coords, size * batch))
        key = key.reshape(-1)
        order = _stable_order(key, size * batch)
        counts = torch.bincount(key, minlength=size * batch + 1)[: size * batch].view(size, batch)
        received = all_to_all(counts.reshape(-1).contiguous(), [batch] * size, [batch] * size, grid_axis.name)
        received = received.view(size, batch)
        per_member = received.sum(0)
        count_out = int(per_member.max()) if batch else 0
        # Fail together: every rank reports (non-finite, overflowing member, its count).
        status = torch.tensor([bad, -1, 0], dtype=torch.int64)
        if capacity is not None and count_out > capacity:
            worst = int(torch.argmax(per_member))
            status = torch.tensor([0, worst, count_out], dtype=torch.int64)
        table = torch.zeros(grid.size, 3, dtype=torch.int64, device=ids.device)
        table[:, 1] = -1
        table[grid.rank] = status.to(ids.device)
        table = _reduce_status(table, grid)
        if bool((table[:, 0] > 0).any()) or bool((table[:, 1] >= 0).any()):
            raise RuntimeError(_status_error(table.cpu(), grid, capacity, f"along grid axis {axis}"))
        send_total = int(counts.sum())
        send_index = order[:send_total]
        receive_lengths = received.reshape(-1)
        row_start = torch.cumsum(received, 0) - received  # start of source q within member b's row
        segment_start = (torch.arange(batch, device=ids.device) * count_out).unsqueeze(0) + row_start
        segment_begin = torch.cumsum(receive_lengths, 0) - receive_lengths
        total = int(receive_lengths.sum())
        target = torch.repeat_interleave(segment_start.reshape(-1) - segment_begin, receive_lengths)
        target = target + torch.arange(total, device=ids.device)
        stage = _Stage(grid_axis, batch, count, count_out, send_index, target,
                       counts.sum(1).tolist(), received.sum(1).tolist())
        stages.append(stage)
        positions = stage.forward(positions)
        ids = stage.forward(ids.unsqueeze(-1), fill=-1).squeeze(-1)
        if destination is not None:
            destination = stage.forward(destination.unsqueeze(-1), fill=-1).squeeze(-1)
        count = count_out
        first = False
    # Without split axes nothing moves; the (periodic) mass-assignment ops reject
    # non-finite positions themselves.
    padding = ids < 0
    if stages and bool(padding.any()):
        fill = torch.tensor(corner, dtype=positions.dtype, device=positions.device)
        positions = torch.where(padding.unsqueeze(-1), fill, positions)
    count_in = stages[0].count_in if stages else ids.shape[1]
    return MigrationPlan(stages, count_in, ids.shape[1], padding), positions, ids


def _reduce_status(table, grid: GridGroups):
    """Sum of the per-rank status rows (each rank fills its own; others hold 0 / -1)."""
    offset = table.clone()
    offset[:, 1] += 1  # -1 (no overflow) becomes 0 so that sums keep the one real entry
    offset = grid.all_reduce(offset, "sum")
    offset[:, 1] -= 1
    return offset
