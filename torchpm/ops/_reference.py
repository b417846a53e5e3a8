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


def _stencil(positions, shape, offset, periodic, op):
    """Lower / upper node indices (B, N, 3) and fractions (B, N, 3)."""
    if not torch.isfinite(positions).all() or (positions.abs() >= _MAX_ABS_POSITION).any():
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
    batch = positions.shape[0]
    lo, hi, frac = _stencil(positions, shape, tuple(offset), periodic, "cic_readout_reference")
    index, weight = _corners(lo, hi, frac, shape)
    channels_mesh = mesh if mesh.dim() == 5 else mesh.unsqueeze(1)
    flat = channels_mesh.reshape(batch, channels_mesh.shape[1], -1)  # (B, C, cells)
    # gathered[k, b, c, n] = flat[b, c, index[k, b, n]]
    gathered = torch.stack(
        [torch.gather(flat, 2, index[k].unsqueeze(1).expand(-1, flat.shape[1], -1)) for k in range(8)]
    )
    values = (gathered * weight.unsqueeze(2)).sum(0).transpose(1, 2)  # (B, N, C)
    return values if mesh.dim() == 5 else values.squeeze(-1)
