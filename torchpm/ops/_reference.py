"""Pure-torch mass assignment (NGP, CIC, TSC, PCS): paint, readout, position gradient.

These are the twins of the C++/CUDA kernels: the oracle the tests compare
against, and what second derivatives through a position gradient
differentiate. They are built from ``floor``,
``index_put_(accumulate=True)`` and gathers, so torch's own autograd
differentiates them. Semantics (stencil convention, geometry, errors) match
:mod:`torchpm.ops.mass_assignment`; ``order`` is the stencil width 1..4.
"""

from __future__ import annotations

from typing import Sequence

import torch

_MAX_ABS_POSITION = 2.0**40


def _as_periodic(periodic) -> tuple[bool, bool, bool]:
    if isinstance(periodic, bool):
        return (periodic,) * 3
    periodic = tuple(bool(p) for p in periodic)
    if len(periodic) != 3:
        raise ValueError(f"`periodic` must be a bool or 3 bools, got {periodic!r}")
    return periodic


def bspline_weights(t: torch.Tensor, order: int, derivative: bool = False) -> list[torch.Tensor]:
    """The ``order`` weights (or their derivatives in ``t``) of the nodes
    ``first .. first + order - 1`` for ``t = x + 1 - order/2 - first`` in [0, 1)."""
    u = 1 - t
    if order == 1:
        return [torch.zeros_like(t) if derivative else torch.ones_like(t)]
    if order == 2:
        return [-torch.ones_like(t), torch.ones_like(t)] if derivative else [u, t]
    if order == 3:
        if derivative:
            return [-u, 1 - 2 * t, t]
        return [0.5 * u * u, 0.75 - (t - 0.5) ** 2, 0.5 * t * t]
    if order == 4:
        if derivative:
            return [-0.5 * u * u, t * (1.5 * t - 2), u * (2 - 1.5 * u), 0.5 * t * t]
        return [u**3 / 6, (4 - 6 * t**2 + 3 * t**3) / 6, (4 - 6 * u**2 + 3 * u**3) / 6, t**3 / 6]
    raise ValueError(f"`order` must be 1 (NGP), 2 (CIC), 3 (TSC) or 4 (PCS), got {order!r}")


def _stencil(positions, shape, offset, periodic, order, op, check=True):
    """Per axis node indices (B, N, 3, p) and the fraction t (B, N, 3) of the stencil.

    ``t`` is differentiable in ``positions`` (the floor is taken of detached values)."""
    if check and (not torch.isfinite(positions).all() or (positions.abs() >= _MAX_ABS_POSITION).any()):
        raise ValueError(f"{op}: `positions` contains non-finite values or values beyond 2^40 cells")
    shifted = positions + (1 - order / 2)
    first = torch.floor(shifted.detach())
    t = shifted - first
    node = first.long() - torch.tensor(offset, device=positions.device)
    nodes = node.unsqueeze(-1) + torch.arange(order, device=positions.device)  # (B, N, 3, p)
    n = torch.tensor(shape, device=positions.device).view(3, 1)
    for d in range(3):
        if periodic[d]:
            nodes[..., d, :] = nodes[..., d, :] % shape[d]
    if check:
        blocked = torch.tensor([not p for p in periodic], device=positions.device).view(3, 1)
        outside = ((nodes < 0) | (nodes >= n)) & blocked
        count = int(outside.flatten(-2).any(-1).sum())
        if count:
            raise ValueError(f"{op}: {count} particles have a stencil of order {order} outside the block")
    return nodes, t


def _flat_index(nodes, shape):
    """Linear indices (B, N, p^3) of the p x p x p nodes, x slowest."""
    _, ny, nz = shape
    ix, iy, iz = nodes[..., 0, :], nodes[..., 1, :], nodes[..., 2, :]
    index = (ix[..., :, None, None] * ny + iy[..., None, :, None]) * nz + iz[..., None, None, :]
    return index.flatten(-3)


def _weights(t, order, derivative_axis=None):
    """Products of the per-axis weights (B, N, p^3); with ``derivative_axis = d`` the
    weight of axis d is replaced by its derivative."""
    per_axis = []
    for d in range(3):
        w = bspline_weights(t[..., d], order, derivative=(d == derivative_axis))
        per_axis.append(torch.stack(w, -1))
    wx, wy, wz = per_axis
    return (wx[..., :, None, None] * wy[..., None, :, None] * wz[..., None, None, :]).flatten(-3)


def _gather(mesh, index):
    """Mesh values at the nodes: mesh (B, [C,] nx, ny, nz), index (B, N, K) -> (B, C, N, K)."""
    channels_mesh = mesh if mesh.dim() == 5 else mesh.unsqueeze(1)
    batch, channels = channels_mesh.shape[:2]
    flat = channels_mesh.flatten(2)  # not reshape(..., -1): ambiguous for an empty batch
    count, nodes = index.shape[1:]
    gathered = torch.gather(flat, 2, index.flatten(1).unsqueeze(1).expand(-1, channels, -1))
    return gathered.view(batch, channels, count, nodes)


def paint_reference(
    positions: torch.Tensor,
    weights: torch.Tensor | None,
    shape: Sequence[int],
    offset: Sequence[int] = (0, 0, 0),
    periodic=True,
    order: int = 2,
) -> torch.Tensor:
    """Pure-torch :func:`torchpm.ops.paint` (same arguments, ``order`` as 1..4)."""
    shape = tuple(int(s) for s in shape)
    periodic = _as_periodic(periodic)
    batch, count, _ = positions.shape
    nodes, t = _stencil(positions, shape, tuple(offset), periodic, order, "paint_reference")
    index = _flat_index(nodes, shape)  # (B, N, K)
    weight = _weights(t, order)  # (B, N, K)
    cells = shape[0] * shape[1] * shape[2]
    if weights is None:
        values = positions.new_ones(batch, count, 1)
    else:
        values = weights if weights.dim() == 3 else weights.unsqueeze(-1)
    channels = values.shape[-1]
    contribution = weight.unsqueeze(-1) * values.unsqueeze(2)  # (B, N, K, C)
    batch_offset = torch.arange(batch, device=positions.device).view(batch, 1, 1) * cells
    flat_index = (index + batch_offset).reshape(-1)
    mesh = positions.new_zeros(batch * cells, channels)
    mesh = mesh.index_put((flat_index,), contribution.reshape(-1, channels), accumulate=True)
    mesh = mesh.view(batch, *shape, channels).movedim(-1, 1)
    if weights is None or weights.dim() == 2:
        mesh = mesh.squeeze(1)
    return mesh.contiguous()


def readout_reference(
    mesh: torch.Tensor,
    positions: torch.Tensor,
    offset: Sequence[int] = (0, 0, 0),
    periodic=True,
    order: int = 2,
) -> torch.Tensor:
    """Pure-torch :func:`torchpm.ops.readout` (same arguments, ``order`` as 1..4)."""
    periodic = _as_periodic(periodic)
    shape = tuple(mesh.shape[-3:])
    nodes, t = _stencil(positions, shape, tuple(offset), periodic, order, "readout_reference")
    index = _flat_index(nodes, shape)
    weight = _weights(t, order)
    values = (_gather(mesh, index) * weight.unsqueeze(1)).sum(-1).transpose(1, 2)  # (B, N, C)
    return values if mesh.dim() == 5 else values.squeeze(-1)


def position_gradient_reference(
    mesh: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor | None,
    offset: Sequence[int] = (0, 0, 0),
    periodic=True,
    order: int = 2,
) -> torch.Tensor:
    """Pure-torch ``torch.ops.torchpm._position_gradient``.

    Returns ``(B, N, 3)``: ``d/dx_p sum_c values[p, c] * readout(mesh, x)[p, c]``,
    built from differentiable torch ops, so it can itself be differentiated (the
    second derivatives of the separable weights are non-zero across axes).
    Positions are not validated: it serves the backward of an op that already
    validated them, and must stay traceable without data-dependent branches.
    """
    periodic = _as_periodic(periodic)
    shape = tuple(mesh.shape[-3:])
    batch = positions.shape[0]
    nodes, t = _stencil(positions, shape, tuple(offset), periodic, order, "position_gradient_reference", check=False)
    index = _flat_index(nodes, shape)
    if values is None:
        v = positions.new_ones(batch, positions.shape[1], 1)
    else:
        v = values if values.dim() == 3 else values.unsqueeze(-1)
    # sum over channels of value * mesh at each node: (B, N, K)
    weighted = (_gather(mesh, index) * v.transpose(1, 2).unsqueeze(-1)).sum(1)
    return torch.stack([(weighted * _weights(t, order, derivative_axis=d)).sum(-1) for d in range(3)], -1)


def cic_paint_reference(positions, weights, shape, offset=(0, 0, 0), periodic=True):
    """:func:`paint_reference` of order 2 (CIC)."""
    return paint_reference(positions, weights, shape, offset, periodic, 2)


def cic_readout_reference(mesh, positions, offset=(0, 0, 0), periodic=True):
    """:func:`readout_reference` of order 2 (CIC)."""
    return readout_reference(mesh, positions, offset, periodic, 2)


def cic_position_gradient_reference(mesh, positions, values, offset=(0, 0, 0), periodic=True):
    """:func:`position_gradient_reference` of order 2 (CIC)."""
    return position_gradient_reference(mesh, positions, values, offset, periodic, 2)
