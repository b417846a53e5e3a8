"""Periodic halo exchange along the split axes x and y.

A haloed block is the local real block with ``lo`` extra planes below and ``hi``
above along x (and its own pair along y); global index ``i`` of the block sits at
padded index ``i - offset + lo``. z is never split and has no halo.

``fill_halo`` copies the neighbours' edge planes into my halo (x first, then y
carrying the x halo along, so corners come from the diagonal neighbour);
``add_halo`` adds my halo into the neighbours' edge planes and zeroes it (y first,
then x). Each is the other's adjoint, and both are differentiable with
collective backwards. Axes of grid size 1 wrap onto themselves.
"""

from __future__ import annotations

import torch

from ._ops import all_to_all
from .groups import GridAxis

__all__ = ["fill_halo", "add_halo", "exchange_neighbours"]


def exchange_neighbours(grid_axis: GridAxis, to_left: torch.Tensor, to_right: torch.Tensor):
    """Send ``to_left`` to the previous rank and ``to_right`` to the next (periodic).

    Returns ``(from_right, from_left)``: what the next rank sent left and what the
    previous rank sent right. One all-to-all carries both, with empty blocks for
    every other peer.
    """
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


def _fill_axis(field, grid_axis, dim, lo, hi):
    """Fill the halo of ``field`` along ``dim`` in place."""
    if lo == 0 and hi == 0:
        return field
    n = field.shape[dim] - lo - hi
    interior = field.narrow(dim, lo, n)
    from_right, from_left = exchange_neighbours(
        grid_axis, interior.narrow(dim, 0, hi).contiguous(), interior.narrow(dim, n - lo, lo).contiguous()
    )
    field.narrow(dim, 0, lo).copy_(from_left)
    field.narrow(dim, lo + n, hi).copy_(from_right)
    return field


def _add_axis(field, grid_axis, dim, lo, hi):
    """Add the halo of ``field`` along ``dim`` into the neighbours and zero it, in place."""
    if lo == 0 and hi == 0:
        return field
    n = field.shape[dim] - lo - hi
    from_right, from_left = exchange_neighbours(
        grid_axis, field.narrow(dim, 0, lo).contiguous(), field.narrow(dim, lo + n, hi).contiguous()
    )
    if grid_axis.size == 1:
        # The "received" planes are views of this very halo: read them before zeroing it.
        from_right, from_left = from_right.clone(), from_left.clone()
    # The next rank's low halo lands on my last `lo` planes, the previous
    # rank's high halo on my first `hi` planes.
    field.narrow(dim, lo + n - lo, lo).add_(from_right)
    field.narrow(dim, lo, hi).add_(from_left)
    field.narrow(dim, 0, lo).zero_()
    field.narrow(dim, lo + n, hi).zero_()
    return field


def _exchange(field, widths, axes, add: bool):
    """The halo exchange, in place on ``field``: the add (y, then x) or the fill (x, then y)."""
    (lo_x, hi_x), (lo_y, hi_y) = widths
    if add:
        field = _add_axis(field, axes[1], -2, lo_y, hi_y)
        return _add_axis(field, axes[0], -3, lo_x, hi_x)
    field = _fill_axis(field, axes[0], -3, lo_x, hi_x)
    return _fill_axis(field, axes[1], -2, lo_y, hi_y)


class _Halo(torch.autograd.Function):
    """:func:`fill_halo` or :func:`add_halo`; the backward of each is the other one
    itself, so the gradient is the adjoint bit for bit (and differentiable again)."""

    @staticmethod
    def forward(field, widths, axes, inplace, add):
        return _exchange(field if inplace else field.clone(), widths, axes, add)

    @staticmethod
    def setup_context(ctx, inputs, output):
        field, widths, axes, inplace, add = inputs
        ctx.widths, ctx.axes, ctx.add = widths, axes, add
        if inplace:
            ctx.mark_dirty(field)

    @staticmethod
    def backward(ctx, grad):
        adjoint = fill_halo if ctx.add else add_halo
        return adjoint(grad, ctx.widths, ctx.axes), None, None, None, None

    @staticmethod
    def vmap(info, in_dims, field, widths, axes, inplace, add):
        # (torch.func.vmap, e.g. jacrev's pull-backs) the exchange acts on the last three
        # dimensions: a vmapped one goes in front, with the batch
        if in_dims[0] is None:
            return _Halo.apply(field, widths, axes, False, add), None
        return _Halo.apply(field.movedim(in_dims[0], 0), widths, axes, False, add), 0


def _no_halo(widths) -> bool:
    return not any(lo or hi for lo, hi in widths)


def _writable(field: torch.Tensor, inplace: bool) -> bool:
    """Whether ``field`` may be written in place: when allowed, except for a view that
    records gradients (autograd forbids writing into, e.g., a custom op's view output)."""
    return inplace and not (field._is_view() and field.requires_grad and torch.is_grad_enabled())


def fill_halo(field: torch.Tensor, widths, axes, inplace: bool = False) -> torch.Tensor:
    """Fill the halo of ``field`` (``(..., lx + lo_x + hi_x, ly + lo_y + hi_y, nz)``) from the
    periodic neighbours; ``widths = ((lo_x, hi_x), (lo_y, hi_y))``. The input halo is ignored.

    Returns a new tensor (one copy of ``field``), or with ``inplace`` writes the halo
    of ``field`` itself (a tensor of the caller's own). The exchange itself touches
    only halo planes. Differentiable; the backward is :func:`add_halo`."""
    if _no_halo(widths):
        return field
    return _Halo.apply(field, widths, axes, _writable(field, inplace), False)


def add_halo(field: torch.Tensor, widths, axes, inplace: bool = False) -> torch.Tensor:
    """Add the halo of ``field`` into the neighbours' blocks; the returned halo is zero.
    The adjoint of :func:`fill_halo` with the same ``widths``; ``inplace`` as there;
    the backward is :func:`fill_halo`."""
    if _no_halo(widths):
        return field
    return _Halo.apply(field, widths, axes, _writable(field, inplace), True)
