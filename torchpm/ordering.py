"""Particles kept in spatial order.

Paint and readout visit the mesh at each particle's position. In the order the
simulation leaves the particles (Lagrangian order, and on a process grid the
arrival order of each migration) neighbours in memory drift apart in space as
structure forms, and every particle's stencil becomes a fresh cache miss. Sorting
the particles by the mesh row they lie in keeps the mesh lines a particle needs
in cache for the next one.

:func:`spatial_order` is the permutation: a stable counting sort by the ``(x, y)``
row of the block (``nx * ny`` bins, so the histogram is small whatever the mesh),
ids ascending within a row. The order is thus a function of the particles'
positions and ids only, not of the order they came in: a run resumed at a step
where the uninterrupted run sorted paints in the same order, bit for bit.
:func:`permute` applies it to any per-particle tensors; it is a gather, whose
backward is the scatter of the gradients back to the original slots, so gradients
flow through a sort unchanged. :func:`restore_id_order` undoes the sorting on one
device, where the particles are returned in the C order of the particle grid.

:class:`torchpm.Simulation` sorts after the LPT (at the start of every
integration) and after the migration of every ``sort_every``-th step.
"""

from __future__ import annotations

import torch

from .ops._arguments import MAX_AXIS, format_list, particle_ids, particle_positions, row_permutation
from .ops._autograd import register_autograd as _register_autograd

__all__ = ["spatial_order", "spatial_order_reference", "permute", "sort_particles", "restore_id_order"]

# Coordinates beyond this magnitude (cells) get the last bin, like NaN and Inf.
_MAX_KEY_COORDINATE = 2.0**52


def _block_rows(mesh):
    """``(shape, offset, period)`` of the local block's (x, y) rows."""
    return (list(mesh.local_real_shape[:2]), list(mesh.local_real_offset[:2]), list(mesh.global_shape[:2]))


def spatial_order(positions: torch.Tensor, ids: torch.Tensor, mesh) -> torch.Tensor:
    """The permutation that puts each batch member's particles in spatial order.

    Args:
        positions: ``(B, N, 3)`` in cells of ``mesh`` (wrapped or not).
        ids: ``(B, N)`` int64 particle ids, unique per batch member; ``-1`` marks an
            empty slot.
        mesh: the :class:`torchpm.mesh.Mesh` the particles are painted on (its local
            block is binned).

    Returns:
        ``(B, N)`` int64: ``order[b, k]`` is the slot of the ``k``-th particle of member
        ``b`` in the order (x row, y row, id). Empty slots and particles with a
        non-finite position come last (they are kept; the force calculation reports
        bad positions).
    """
    shape, offset, period = _block_rows(mesh)
    return torch.ops.torchpm._spatial_order(positions.detach(), ids, shape, offset, period)


def _rows(positions, ids, shape, offset, period) -> torch.Tensor:
    """``(B, N)`` int64: each particle's (x, y) row of the block, ``shape[0] * shape[1]``
    (the last) for empty slots and non-finite or huge positions."""
    shape_t = torch.tensor(shape, dtype=torch.int64, device=positions.device)
    offset_t = torch.tensor(offset, dtype=torch.int64, device=positions.device)
    period_t = torch.tensor(period, dtype=torch.int64, device=positions.device)
    x = positions[..., :2].detach().to(torch.float64)
    usable = (x.abs() < _MAX_KEY_COORDINATE).all(-1) & (ids >= 0)
    cell = torch.where(usable.unsqueeze(-1), x, 0.0).floor().to(torch.int64) - offset_t
    cell = torch.minimum(cell.remainder(period_t), shape_t - 1)
    return torch.where(usable, cell[..., 0] * shape_t[1] + cell[..., 1], shape[0] * shape[1])


def spatial_order_reference(positions, ids, shape, offset, period) -> torch.Tensor:
    """Pure-torch twin of ``torch.ops.torchpm._spatial_order`` (the test oracle): two
    stable sorts, by id, then by row."""
    row = _rows(positions, ids, shape, offset, period)
    by_id = torch.argsort(ids, dim=1, stable=True)
    return by_id.gather(1, torch.argsort(row.gather(1, by_id), dim=1, stable=True))


def _spatial_order_one_key(positions, ids, shape, offset, period) -> torch.Tensor:
    """The order of :func:`spatial_order_reference` with one stable sort of the int64 key
    ``row * span + id - low`` (``low``, ``low + span - 1`` the smallest and largest id: one
    host sync) where the key fits in int64; else, and while a CUDA graph is captured (no
    sync allowed), the two sorts. Equal keys are empty slots of one id only, kept in slot
    order by the stable sort as the two sorts keep them."""
    if ids.numel() == 0 or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return spatial_order_reference(positions, ids, shape, offset, period)
    low, top = torch.stack([ids.min(), ids.max()]).tolist()
    span = top - low + 1
    if span > torch.iinfo(torch.int64).max // (shape[0] * shape[1] + 1):
        return spatial_order_reference(positions, ids, shape, offset, period)
    key = _rows(positions, ids, shape, offset, period) * span + (ids - low)
    return torch.argsort(key, dim=1, stable=True)


def _spatial_order_fake(positions, ids, shape, offset, period):
    return ids.new_empty(positions.shape[:2])


def _spatial_order_device(positions, ids, shape, offset, period):
    """The CUDA kernel: the CPU op's argument checks (same messages), then the pure-torch twin."""
    op = "torchpm._spatial_order"
    particle_positions(op, positions)
    shape, offset, period = list(shape), list(offset), list(period)
    if not len(shape) == len(offset) == len(period) == 2:
        raise ValueError(f"{op}: `shape`, `offset` and `period` must have 2 entries (x and y), got {format_list(shape)}, "
                         f"{format_list(offset)}, {format_list(period)}.")
    if not all(0 < value <= MAX_AXIS for value in shape + period):
        raise ValueError(f"{op}: `shape` and `period` must be positive mesh sizes, got {format_list(shape)} and "
                         f"{format_list(period)}.")
    particle_ids(op, ids, positions)
    return _spatial_order_one_key(positions, ids, shape, offset, period)


torch.library.register_fake("torchpm::_spatial_order")(_spatial_order_fake)
# The CUDA build has no kernel of its own: sorting is what GPUs do well.
torch.library.register_kernel("torchpm::_spatial_order", "cuda")(_spatial_order_device)


def _rows_fake(input, order):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _flat_index(order):
    batch, n = order.shape
    return (order + (torch.arange(batch, device=order.device) * n).unsqueeze(1)).reshape(-1)


def _gather_rows_device(input, order):
    row_permutation("torchpm._gather_rows", input, order)
    batch, n = order.shape
    return input.reshape(batch * n, -1).index_select(0, _flat_index(order)).view(input.shape)


def _scatter_rows_device(input, order):
    row_permutation("torchpm._scatter_rows", input, order)
    batch, n = order.shape
    rows = input.reshape(batch * n, -1)
    return torch.zeros_like(rows).index_copy_(0, _flat_index(order), rows).view(input.shape)


def _gather_rows_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _gather_rows_backward(ctx, grad):
    (order,) = ctx.saved_tensors
    return torch.ops.torchpm._scatter_rows(grad, order), None


def _scatter_rows_backward(ctx, grad):
    (order,) = ctx.saved_tensors
    return torch.ops.torchpm._gather_rows(grad, order), None


for _name, _device_kernel, _backward in (
    ("_gather_rows", _gather_rows_device, _gather_rows_backward),
    ("_scatter_rows", _scatter_rows_device, _scatter_rows_backward),
):
    torch.library.register_fake(f"torchpm::{_name}")(_rows_fake)
    torch.library.register_kernel(f"torchpm::{_name}", "cuda")(_device_kernel)
    _register_autograd(f"torchpm::{_name}", _backward, setup_context=_gather_rows_setup)


def permute(order: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensor[b, order[b]]`` for each ``(B, N, ...)`` tensor (``(B, N)`` permutation).

    A gather of whole rows (``torch.ops.torchpm._gather_rows``, a copy per row of
    the 12 or 24 bytes of a particle instead of a generic index kernel);
    differentiable, its backward scatters the gradients back to the slots they
    came from (``_scatter_rows``). A tensor broadcast along the batch (stride 0,
    like ``arange(N).expand(B, -1)``) is gathered per member too.
    """
    for tensor in tensors:
        if tensor.shape[:2] != order.shape:
            raise ValueError(
                f"permute: a per-particle tensor must start with {tuple(order.shape)}, got {tuple(tensor.shape)}"
            )
    return tuple(torch.ops.torchpm._gather_rows(tensor, order) for tensor in tensors)


def sort_particles(mesh, positions: torch.Tensor, ids: torch.Tensor, *attributes: torch.Tensor):
    """``(positions, ids, *attributes)`` permuted into :func:`spatial_order`."""
    return permute(spatial_order(positions, ids, mesh), positions, ids, *attributes)


def restore_id_order(positions: torch.Tensor, ids: torch.Tensor, *attributes: torch.Tensor):
    """On one device (``ids`` of each member a permutation of ``0 .. N-1``): the particles
    back in id order, ``(positions, ids, *attributes)``."""
    batch, n = ids.shape
    slots = torch.arange(n, device=ids.device).expand(batch, n)
    inverse = torch.empty_like(ids).scatter_(1, ids, slots)
    return permute(inverse, positions, ids, *attributes)
