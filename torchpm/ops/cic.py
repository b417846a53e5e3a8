"""Cloud-in-cell (CIC) paint and readout as torch custom ops.

The kernels are C++ (CPU, OpenMP) and CUDA, registered under ``torch.ops.torchpm``.
This module gives them fake (meta) kernels for ``torch.compile``, autograd
formulas whose backwards are themselves custom ops, and the public functions
:func:`cic_paint` and :func:`cic_readout` with argument checking.

Geometry. Positions are in mesh-cell units: node ``j`` of the global mesh sits at
``x = j``, and a particle at ``x`` gives weight ``1 - (x - floor(x))`` to node
``floor(x)`` and ``x - floor(x)`` to node ``floor(x) + 1`` along each axis (the
trilinear product over the three axes). A local mesh of shape ``(nx, ny, nz)``
holds global nodes ``offset .. offset + shape - 1``:

* on a *periodic* axis, indices wrap modulo the local size (with ``offset = 0``
  and the full size this is the ordinary periodic mesh);
* on a *block* axis, the particle's two nodes must both lie in the block, that is
  ``offset <= x < offset + n - 1``; a particle outside is an error naming how many
  particles and the worst one. Nothing is ever dropped silently.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _reference

__all__ = ["cic_paint", "cic_readout"]

_ops = torch.ops.torchpm


def _geometry(offset, periodic, op):
    if offset is None:
        offset = (0, 0, 0)
    offset = [int(o) for o in offset]
    if len(offset) != 3:
        raise ValueError(f"{op}: `offset` must have 3 entries, got {offset!r}")
    if isinstance(periodic, bool):
        periodic = [periodic] * 3
    else:
        periodic = [bool(p) for p in periodic]
    if len(periodic) != 3:
        raise ValueError(f"{op}: `periodic` must be a bool or 3 bools, got {periodic!r}")
    return offset, periodic


def _check_shape(shape, op):
    if shape is None:
        raise ValueError(f"{op}: `shape` (nx, ny, nz) of the mesh is required")
    try:
        shape = [int(s) for s in shape]
    except TypeError:
        raise ValueError(f"{op}: `shape` must be 3 positive integers, got {shape!r}") from None
    if len(shape) != 3 or any(s <= 0 for s in shape):
        raise ValueError(f"{op}: `shape` must be 3 positive integers, got {tuple(shape)!r}")
    return shape


def _use_reference(tensor):
    # CUDA paint scatters with atomics; honour deterministic mode with the
    # deterministic pure-torch path (index_put_ with accumulate=True).
    return tensor.is_cuda and torch.are_deterministic_algorithms_enabled()


def cic_paint(
    positions: torch.Tensor,
    weights: torch.Tensor | None = None,
    shape: Sequence[int] | None = None,
    *,
    offset: Sequence[int] | None = None,
    periodic: bool | Sequence[bool] = True,
) -> torch.Tensor:
    """Paint particles onto a mesh with cloud-in-cell weights.

    Args:
        positions: ``(B, N, 3)`` float32 or float64, global mesh-cell units.
        weights: ``(B, N)`` or ``(B, N, C)`` values carried by each particle (same
            dtype and device), or ``None`` for unit mass.
        shape: ``(nx, ny, nz)`` of the (local) mesh.
        offset: global index of the local mesh's node ``(0, 0, 0)``; default 0.
        periodic: per axis (or one bool for all), whether indices wrap modulo
            the local size; a non-periodic axis is a block axis (module docs).

    Returns:
        ``(B, nx, ny, nz)``, or ``(B, C, nx, ny, nz)`` for ``(B, N, C)`` weights.
        The sum of the mesh equals the sum of the weights.

    Differentiable in ``positions`` and ``weights``. On CUDA the kernel adds with
    atomics, so float rounding may differ between runs; under
    ``torch.use_deterministic_algorithms(True)`` a deterministic pure-torch path
    is used instead. The CPU kernel is deterministic and independent of the
    number of threads.
    """
    shape = _check_shape(shape, "cic_paint")
    offset, periodic = _geometry(offset, periodic, "cic_paint")
    if _use_reference(positions):
        return _reference.cic_paint_reference(positions, weights, shape, offset, periodic)
    return _ops.cic_paint(positions, weights, shape, offset, periodic)


def cic_readout(
    mesh: torch.Tensor,
    positions: torch.Tensor,
    *,
    offset: Sequence[int] | None = None,
    periodic: bool | Sequence[bool] = True,
) -> torch.Tensor:
    """Interpolate a mesh at particle positions with cloud-in-cell weights.

    Args:
        mesh: ``(B, nx, ny, nz)`` or ``(B, C, nx, ny, nz)`` (C channels read in
            one pass over the particles, e.g. the 3 force components).
        positions: ``(B, N, 3)``, same dtype and device as ``mesh``.
        offset, periodic: the mesh's place in the global mesh, as in
            :func:`cic_paint`.

    Returns:
        ``(B, N)`` or ``(B, N, C)``.

    Differentiable in ``mesh`` and ``positions``. The adjoint of readout in the
    mesh is paint: ``<paint(x, w), f> = <w, readout(f, x)>``.
    """
    offset, periodic = _geometry(offset, periodic, "cic_readout")
    if _use_reference(positions):
        return _reference.cic_readout_reference(mesh, positions, offset, periodic)
    return _ops.cic_readout(mesh, positions, offset, periodic)


# ----------------------------------------------------------------------------
# Fake kernels: shapes only, for FakeTensor / torch.compile / AOT.


def _fake_check(positions, op):
    if positions.dim() != 3 or positions.shape[2] != 3:
        raise ValueError(f"{op}: expected `positions` of shape (B, N, 3), got {tuple(positions.shape)}")
    if positions.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: expected `positions` to be float32 or float64, got {positions.dtype}")


@torch.library.register_fake("torchpm::cic_paint")
def _paint_fake(positions, weights, shape, offset, periodic):
    _fake_check(positions, "torchpm.cic_paint")
    batch = positions.shape[0]
    if weights is not None and weights.dim() == 3:
        return positions.new_empty(batch, weights.shape[2], *shape)
    return positions.new_empty(batch, *shape)


@torch.library.register_fake("torchpm::cic_readout")
def _readout_fake(mesh, positions, offset, periodic):
    _fake_check(positions, "torchpm.cic_readout")
    batch, count = positions.shape[0], positions.shape[1]
    if mesh.dim() == 5:
        return positions.new_empty(batch, count, mesh.shape[1])
    return positions.new_empty(batch, count)


@torch.library.register_fake("torchpm::_cic_position_gradient")
def _position_gradient_fake(mesh, positions, values, offset, periodic):
    _fake_check(positions, "torchpm._cic_position_gradient")
    return torch.empty_like(positions)


# ----------------------------------------------------------------------------
# Autograd. Every backward is made of custom ops, so torch.compile traces it.


def _paint_setup_context(ctx, inputs, output):
    positions, weights, shape, offset, periodic = inputs
    ctx.save_for_backward(positions, weights)
    ctx.geometry = (offset, periodic)


def _paint_backward(ctx, grad_mesh):
    positions, weights = ctx.saved_tensors
    offset, periodic = ctx.geometry
    grad_positions = grad_weights = None
    if ctx.needs_input_grad[0]:
        grad_positions = _ops._cic_position_gradient(grad_mesh, positions, weights, offset, periodic)
    if weights is not None and ctx.needs_input_grad[1]:
        grad_weights = _ops.cic_readout(grad_mesh, positions, offset, periodic)
    return grad_positions, grad_weights, None, None, None


def _readout_setup_context(ctx, inputs, output):
    mesh, positions, offset, periodic = inputs
    ctx.save_for_backward(mesh, positions)
    ctx.geometry = (offset, periodic)


def _readout_backward(ctx, grad_values):
    mesh, positions = ctx.saved_tensors
    offset, periodic = ctx.geometry
    grad_mesh = grad_positions = None
    if ctx.needs_input_grad[0]:
        shape = list(mesh.shape[-3:])
        if _use_reference(positions):
            # deterministic mode may have been switched on after the forward
            grad_mesh = _reference.cic_paint_reference(positions, grad_values, shape, offset, periodic)
        else:
            grad_mesh = _ops.cic_paint(positions, grad_values, shape, offset, periodic)
    if ctx.needs_input_grad[1]:
        grad_positions = _ops._cic_position_gradient(mesh, positions, grad_values, offset, periodic)
    return grad_mesh, grad_positions, None, None


def _position_gradient_setup_context(ctx, inputs, output):
    mesh, positions, values, offset, periodic = inputs
    ctx.save_for_backward(mesh, positions, values)
    ctx.geometry = (offset, periodic)


def _position_gradient_backward(ctx, grad):
    # Only reached for second derivatives (Hessian-vector products, gradient
    # penalties). Rare enough to differentiate the pure-torch twin instead of
    # keeping a second set of kernels; exact, including the cross terms
    # d2W/dx_i dx_j of the trilinear weights.
    mesh, positions, values = ctx.saved_tensors
    offset, periodic = ctx.geometry
    needs = ctx.needs_input_grad[:3]
    with torch.enable_grad():
        inputs = [
            t if t is None or t.requires_grad or not need else t.detach().requires_grad_(True)
            for t, need in zip((mesh, positions, values), needs)
        ]
        out = _reference.cic_position_gradient_reference(*inputs, offset, periodic)
        leaves = [t for t, need in zip(inputs, needs) if need]
        grads = iter(
            torch.autograd.grad(out, leaves, grad, allow_unused=True, create_graph=torch.is_grad_enabled())
        )
    return (*(next(grads) if need else None for need in needs), None, None)


torch.library.register_autograd(
    "torchpm::cic_paint", _paint_backward, setup_context=_paint_setup_context
)
torch.library.register_autograd(
    "torchpm::cic_readout", _readout_backward, setup_context=_readout_setup_context
)
torch.library.register_autograd(
    "torchpm::_cic_position_gradient",
    _position_gradient_backward,
    setup_context=_position_gradient_setup_context,
)
