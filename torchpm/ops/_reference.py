"""Pure-torch cloud-in-cell paint and readout.

These are the twins of the C++/CUDA kernels: the oracle the tests compare
against and the deterministic path taken on CUDA under
``torch.use_deterministic_algorithms(True)``. They are built from ``floor``,
``index_put_(accumulate=True)`` and gathers, so torch's own autograd
differentiates them. Semantics (geometry, errors) match :mod:`torchpm.ops.cic`.
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


def _stencil(positions, shape, offset, periodic, op, check=True):
    """Lower / upper node indices (B, N, 3) and fractions (B, N, 3)."""
    if check and (not torch.isfinite(positions).all() or (positions.abs() >= _MAX_ABS_POSITION).any()):
        raise ValueError(f"{op}: `positions` contains non-finite values or values beyond 2^40 cells")
    floor = torch.floor(positions)
    frac = positions - floor
    lo = floor.long() - torch.tensor(offset, device=positions.device)
    hi = lo + 1
    n = torch.tensor(shape, device=positions.device)
    for d in range(3):
        if periodic[d]:
            lo[..., d] = lo[..., d] % shape[d]
            hi[..., d] = hi[..., d] % shape[d]
    if not check:
        return lo, hi, frac
    blocked = torch.tensor([not p for p in periodic], device=positions.device)
    outside = ((lo < 0) | (hi >= n)) & blocked
    count = int(outside.any(-1).sum())
    if count:
        raise ValueError(f"{op}: {count} particles have a CIC stencil outside the block")
    return lo, hi, frac


def _corners(lo, hi, frac, shape):
    """Linear indices (8, B, N) and weights (8, B, N) of the 2x2x2 nodes."""
    _, ny, nz = shape
    indices, weights = [], []
    for a in (0, 1):
        for b in (0, 1):
            for c in (0, 1):
                i = (hi if a else lo)[..., 0]
                j = (hi if b else lo)[..., 1]
                k = (hi if c else lo)[..., 2]
                wx = frac[..., 0] if a else 1 - frac[..., 0]
                wy = frac[..., 1] if b else 1 - frac[..., 1]
                wz = frac[..., 2] if c else 1 - frac[..., 2]
                indices.append((i * ny + j) * nz + k)
                weights.append(wx * wy * wz)
    return torch.stack(indices), torch.stack(weights)


def _gather_corners(mesh, index):
    """Mesh values at the 8 corners: mesh (B, [C,] nx, ny, nz), index (8, B, N) -> (8, B, C, N)."""
    channels_mesh = mesh if mesh.dim() == 5 else mesh.unsqueeze(1)
    batch, channels = channels_mesh.shape[:2]
    flat = channels_mesh.reshape(batch, channels, -1)
    return torch.stack([torch.gather(flat, 2, index[k].unsqueeze(1).expand(-1, channels, -1)) for k in range(8)])


def cic_paint_reference(
    positions: torch.Tensor,
    weights: torch.Tensor | None,
    shape: Sequence[int],
    offset: Sequence[int] = (0, 0, 0),
    periodic=True,
) -> torch.Tensor:
    """Pure-torch :func:`torchpm.ops.cic_paint` (same arguments and result)."""
    shape = tuple(int(s) for s in shape)
    periodic = _as_periodic(periodic)
    batch, count, _ = positions.shape
    lo, hi, frac = _stencil(positions, shape, tuple(offset), periodic, "cic_paint_reference")
    index, weight = _corners(lo, hi, frac, shape)
    cells = shape[0] * shape[1] * shape[2]
    if weights is None:
        values = positions.new_ones(batch, count, 1)
    else:
        values = weights if weights.dim() == 3 else weights.unsqueeze(-1)
    channels = values.shape[-1]
    contribution = weight.unsqueeze(-1) * values.unsqueeze(0)  # (8, B, N, C)
    batch_offset = torch.arange(batch, device=positions.device).view(1, batch, 1) * cells
    flat_index = (index + batch_offset).reshape(-1)
    mesh = positions.new_zeros(batch * cells, channels)
    mesh = mesh.index_put((flat_index,), contribution.reshape(-1, channels), accumulate=True)
    mesh = mesh.view(batch, *shape, channels).movedim(-1, 1)
    if weights is None or weights.dim() == 2:
        mesh = mesh.squeeze(1)
    return mesh.contiguous()


def cic_readout_reference(
    mesh: torch.Tensor,
    positions: torch.Tensor,
    offset: Sequence[int] = (0, 0, 0),
    periodic=True,
) -> torch.Tensor:
    """Pure-torch :func:`torchpm.ops.cic_readout` (same arguments and result)."""
    periodic = _as_periodic(periodic)
    shape = tuple(mesh.shape[-3:])
    lo, hi, frac = _stencil(positions, shape, tuple(offset), periodic, "cic_readout_reference")
    index, weight = _corners(lo, hi, frac, shape)
    gathered = _gather_corners(mesh, index)  # (8, B, C, N)
    values = (gathered * weight.unsqueeze(2)).sum(0).transpose(1, 2)  # (B, N, C)
    return values if mesh.dim() == 5 else values.squeeze(-1)


def cic_position_gradient_reference(
    mesh: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor | None,
    offset: Sequence[int] = (0, 0, 0),
    periodic=True,
) -> torch.Tensor:
    """Pure-torch ``torch.ops.torchpm._cic_position_gradient``.

    Returns ``(B, N, 3)``: ``d/dx_p sum_c values[p, c] * readout(mesh, x)[p, c]``,
    built from differentiable torch ops, so it can itself be differentiated (the
    second derivatives of the trilinear weights are non-zero across axes).
    Positions are not validated: it serves the backward of an op that already
    validated them, and must stay traceable without data-dependent branches.
    """
    periodic = _as_periodic(periodic)
    shape = tuple(mesh.shape[-3:])
    batch = positions.shape[0]
    lo, hi, _ = _stencil(positions.detach(), shape, tuple(offset), periodic, "cic_position_gradient_reference", check=False)
    frac = positions - torch.floor(positions.detach())
    index, _ = _corners(lo, hi, frac, shape)
    if values is None:
        v = positions.new_ones(batch, positions.shape[1], 1)
    else:
        v = values if values.dim() == 3 else values.unsqueeze(-1)
    # sum over channels of value * mesh at each corner: (8, B, N)
    weighted = (_gather_corners(mesh, index) * v.transpose(1, 2).unsqueeze(0)).sum(2)
    gradient = torch.zeros_like(positions)
    corners = [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]  # the order of _corners
    for k, corner in enumerate(corners):
        u = [frac[..., d] if corner[d] else 1 - frac[..., d] for d in range(3)]
        sign = [1.0 if corner[d] else -1.0 for d in range(3)]
        dw = torch.stack([sign[0] * u[1] * u[2], u[0] * sign[1] * u[2], u[0] * u[1] * sign[2]], -1)
        gradient = gradient + weighted[k].unsqueeze(-1) * dw
    return gradient
