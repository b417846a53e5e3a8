"""Mass assignment (NGP, CIC, TSC, PCS): paint and readout as torch custom ops.

The kernels are C++ (CPU) and CUDA, registered under ``torch.ops.torchpm``, one
template over the stencil width for every order. This module gives them fake
(meta) kernels for ``torch.compile`` that perform every check that needs no
values, autograd formulas whose backwards are themselves custom ops, and the
public functions :func:`paint`, :func:`readout` (and the CIC shortcuts
:func:`cic_paint`, :func:`cic_readout`) with argument checking.

Geometry. Positions are in mesh-cell units: node ``j`` of the global mesh sits at
``x = j``. An assignment of order ``p`` (1 NGP, 2 CIC, 3 TSC, 4 PCS) gives a
particle at ``x`` the ``p`` nodes ``first .. first + p - 1`` along each axis, with
``first = floor(x + 1 - p/2)`` and ``t = x + 1 - p/2 - first`` in ``[0, 1)``, and
weights the uniform B-spline of degree ``p - 1`` at the node distances:

* NGP: the nearest node ``floor(x + 1/2)``, weight 1;
* CIC: ``floor(x)``, ``floor(x) + 1`` with ``1 - t``, ``t``;
* TSC: the nearest node ``c`` and ``c -+ 1``, with ``(1-t)^2/2``, ``3/4 - (t-1/2)^2``,
  ``t^2/2`` (``t - 1/2 = x - c``);
* PCS: ``floor(x) - 1 .. floor(x) + 2`` with ``(1-t)^3/6``, ``(4 - 6t^2 + 3t^3)/6``,
  ``(4 - 6(1-t)^2 + 3(1-t)^3)/6``, ``t^3/6``;

the 3-d weight is the product over the axes. Its Fourier transform is
``W(w) = prod_i sinc(w_i / 2 pi)^p`` (``w`` in radians per cell). A local mesh of
shape ``(nx, ny, nz)`` holds global nodes ``offset .. offset + shape - 1``:

* on a *periodic* axis, indices wrap modulo the local size (with ``offset = 0``
  and the full size this is the ordinary periodic mesh);
* on a *block* axis, all ``p`` nodes must lie in the block, that is
  ``offset + p/2 - 1 <= x < offset + n - p/2``; a particle outside is an error
  naming how many particles and the worst one. Nothing is ever dropped silently.
  :func:`halo_widths` gives the halo a block needs around the interval it owns.

Gradients are exact for every order. NGP's weights are piecewise constant: its
position gradient is zero (exact almost everywhere; the jumps at cell faces
have no derivative), its weight and mesh gradients are ordinary.

Non-finite values: by default (``check_finite=True``) paint raises on NaN/Inf
weights and readout raises when a particle reads a NaN/Inf mesh value, with one
flag per call inside the kernels (no extra pass). ``check_finite=False`` skips
that and propagates them (the backward passes do so: a NaN gradient is the
upstream's to report). Non-finite positions always raise.

When an error is raised: on the CPU inside the call; on CUDA, by default, by the
next torchpm op or :func:`torchpm.check` (no host synchronisation per call; the
call returns NaN where the bad particles should have contributed). The message
names the op and the argument either way; :func:`torchpm.set_error_checking`
chooses (``torchpm.ops.error_checking``).

Inputs must be torch tensors: numpy arrays and lists raise a ``TypeError``
(converting would have to guess the dtype and device).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from . import _arguments as args
from . import _reference
from ._autograd import register_autograd as _register_autograd

__all__ = ["paint", "readout", "cic_paint", "cic_readout", "halo_widths", "set_paint_method", "get_paint_method"]

_ops = torch.ops.torchpm


def halo_widths(order) -> tuple[int, int]:
    """``(below, above)``: the reach of the stencil of ``order`` around a block.

    A particle whose global coordinate along an axis lies in the owned interval
    ``[o, o + n)`` has all its stencil nodes in ``[o - below, o + n - 1 + above]``.
    So a block mesh of shape ``n + below + above`` with ``offset = o - below``
    accepts every particle the rank owns. With ``first = floor(x + 1 - p/2)``
    (module docs), ``below = ceil(p/2 - 1)`` and ``above = ceil(p/2)``:

    ========  =====  =====
    order     below  above
    ========  =====  =====
    ngp (1)   0      1
    cic (2)   0      1
    tsc (3)   1      2
    pcs (4)   1      2
    ========  =====  =====
    """
    p = args.order_number(order, "halo_widths")
    below = -((2 - p) // 2)  # ceil(p/2 - 1)
    above = (p + 1) // 2
    return below, above


PAINT_METHODS = ("auto", "scatter", "tiled")
_paint_method = "auto"


def set_paint_method(method: str) -> str:
    """Choose how paint accumulates on CUDA; returns the previous choice.

    * ``"auto"`` (default): the tiled paint for the TSC and PCS windows and for
      paints of two or more channels (readout's backward of the three force
      components), the scatter otherwise (NGP and CIC, one channel, and calls of
      more than 2^31 - 1 particles, which the tiled paint refuses). On an H100
      the tiled paint took 0.11-0.75x the scatter's time for those, and 0.85-1.13x
      for one CIC channel, where it also needs its scratch (``benchmarks/RESULTS.md``).
    * ``"scatter"``: one thread per particle adds its ``p^3``
      contributions to the mesh with global atomic adds.
    * ``"tiled"``: the particles are binned by tiles of 8^3 nodes; a block sums
      a tile's particles (at most 1024 at a time) in a shared-memory copy of the
      tile and its halo, then adds the copy to the mesh (one atomic per nonzero
      node). For clustered particles, where the scatter's atomics meet on the
      same cells; it costs a binning pass and 12 bytes per particle of scratch.
      ``torch.ops.torchpm._paint_tiled``.

    Both give the same mesh up to float rounding (the order of the sums), both
    use atomics (not deterministic: under
    ``torch.use_deterministic_algorithms(True)`` CUDA paints node by node
    whatever the choice). It applies to :func:`paint`, readout's backward (a
    paint) and so to the simulation, on CUDA; the CPU keeps its scatter kernel,
    which is deterministic and works plane by plane in cache (its
    ``_paint_tiled`` runs the CUDA passes one after another, for the tests).
    The C++ API (``torchpm::cic_paint``) always scatters.
    """
    global _paint_method
    if method not in PAINT_METHODS:
        raise ValueError(f"set_paint_method: expected `method` to be one of {PAINT_METHODS}, got {method!r}.")
    previous, _paint_method = _paint_method, method
    return previous


def get_paint_method() -> str:
    """The paint method CUDA uses: ``"auto"``, ``"scatter"`` or ``"tiled"`` (:func:`set_paint_method`)."""
    return _paint_method


#: Most particles (B * N) the tiled paint takes in one call (its int32 counts).
TILED_MAX_PARTICLES = 2**31 - 1


def _cuda_paint_method(order: int, positions: torch.Tensor, weights: torch.Tensor | None) -> str:
    """``"scatter"`` or ``"tiled"``: the paint CUDA runs for window ``order`` (1..4),
    ``(B, N, 3)`` ``positions`` and ``weights`` under :func:`set_paint_method`'s choice
    ("auto" keeps the scatter beyond the tiled paint's particle count)."""
    if _paint_method != "auto":
        return _paint_method
    # B * N of a (B, N, 3) tensor; of any other shape a number, so that the op raises its ValueError.
    if math.prod(positions.shape[:-1]) > TILED_MAX_PARTICLES:
        return "scatter"
    channels = 1 if weights is None or weights.dim() < 3 else weights.shape[-1]
    return "tiled" if order >= 3 or channels > 1 else "scatter"


def _paint_op(tensor, order: int, weights: torch.Tensor | None):
    """The paint op for ``tensor``'s device and mode: on CUDA, the paint computed
    node by node under ``torch.use_deterministic_algorithms(True)``
    (``_paint_deterministic``, no atomics), else the method of
    :func:`set_paint_method`; on the CPU the scatter paint."""
    if tensor.is_cuda:
        if torch.are_deterministic_algorithms_enabled():
            return _ops._paint_deterministic
        if _cuda_paint_method(order, tensor, weights) == "tiled":
            return _ops._paint_tiled
    return _ops.paint


def paint(
    positions: torch.Tensor,
    weights: torch.Tensor | None = None,
    shape: Sequence[int] | None = None,
    *,
    order: str | int = "cic",
    offset: Sequence[int] | None = None,
    periodic: bool | Sequence[bool] = True,
    check_finite: bool = True,
) -> torch.Tensor:
    """Paint particles onto a mesh with the mass-assignment window ``order``.

    Args:
        positions: ``(B, N, 3)`` float32 or float64, global mesh-cell units.
        weights: ``(B, N)`` or ``(B, N, C)`` values carried by each particle (same
            dtype and device), or ``None`` for unit mass.
        shape: ``(nx, ny, nz)`` of the (local) mesh, integers below 2^31.
        order: ``"ngp"``, ``"cic"``, ``"tsc"`` or ``"pcs"`` (or 1..4).
        offset: 3 integers, global index of the local mesh's node ``(0, 0, 0)``;
            default 0.
        periodic: a bool or 3 bools: per axis, whether indices wrap modulo the
            local size; a non-periodic axis is a block axis (module docs).
        check_finite: raise on NaN/Inf weights (module docs).

    Returns:
        ``(B, nx, ny, nz)``, or ``(B, C, nx, ny, nz)`` for ``(B, N, C)`` weights.
        The sum of the mesh equals the sum of the weights.

    Differentiable in ``positions`` and ``weights``. On CUDA the kernel adds with
    atomics, so float rounding may differ between runs; under
    ``torch.use_deterministic_algorithms(True)`` the same paint is computed node
    by node instead (``torch.ops.torchpm._paint_deterministic``: particles
    sorted by cell, each node sums its contributions in a fixed order; no
    atomics; its extra memory is a few tens of bytes per particle and 8 per
    mesh cell). Readout and the gradients of paint and readout in the positions
    gather without atomics and keep their kernels. float32 atomic adds on CUDA
    flush denormal numbers to zero: contributions below about 1.2e-38 are lost
    (float64 and the node-by-node paint keep them). :func:`set_paint_method`
    chooses between the scatter kernel and a tiled one (shared-memory sums,
    for clustered particles) on CUDA. The CPU kernel is deterministic and
    independent of the number of threads.
    """
    op = "paint"
    positions = args.tensor_argument(positions, "positions", op)
    weights = args.tensor_argument(weights, "weights", op, optional=True)
    shape = args.shape_argument(shape, op)
    offset = args.offset_argument(offset, op)
    periodic = args.periodic_argument(periodic, op)
    p = args.order_number(order, op)
    check_finite = args.bool_argument(check_finite, "check_finite", op)
    return _paint_op(positions, p, weights)(positions, weights, shape, offset, periodic, p, check_finite)


def readout(
    mesh: torch.Tensor,
    positions: torch.Tensor,
    *,
    order: str | int = "cic",
    offset: Sequence[int] | None = None,
    periodic: bool | Sequence[bool] = True,
    check_finite: bool = True,
) -> torch.Tensor:
    """Interpolate a mesh at particle positions with the window ``order``.

    Args:
        mesh: ``(B, nx, ny, nz)`` or ``(B, C, nx, ny, nz)`` (C channels read in
            one pass over the particles, e.g. the 3 force components).
        positions: ``(B, N, 3)``, same dtype and device as ``mesh``.
        order, offset, periodic: as in :func:`paint`.
        check_finite: raise when a particle reads a NaN/Inf mesh value.

    Returns:
        ``(B, N)`` or ``(B, N, C)``.

    Differentiable in ``mesh`` and ``positions``. The adjoint of readout in the
    mesh is paint with the same order: ``<paint(x, w), f> = <w, readout(f, x)>``.
    """
    op = "readout"
    mesh = args.tensor_argument(mesh, "mesh", op)
    positions = args.tensor_argument(positions, "positions", op)
    offset = args.offset_argument(offset, op)
    periodic = args.periodic_argument(periodic, op)
    p = args.order_number(order, op)
    check_finite = args.bool_argument(check_finite, "check_finite", op)
    return _ops.readout(mesh, positions, offset, periodic, p, check_finite)


def cic_paint(positions, weights=None, shape=None, *, offset=None, periodic=True, check_finite=True):
    """:func:`paint` with ``order="cic"`` (cloud in cell)."""
    return paint(positions, weights, shape, order=2, offset=offset, periodic=periodic, check_finite=check_finite)


def cic_readout(mesh, positions, *, offset=None, periodic=True, check_finite=True):
    """:func:`readout` with ``order="cic"`` (cloud in cell)."""
    return readout(mesh, positions, order=2, offset=offset, periodic=periodic, check_finite=check_finite)


# ----------------------------------------------------------------------------
# Fake kernels: every check that needs no values (the same ones as the C++
# argument checks, so meta tensors and torch.compile fail as eager does).


def _check_positions(positions, op):
    args.particle_positions(op, positions)  # the C++ check_positions, its message included


def _check_same(t, name, positions, op):
    if t.dtype != positions.dtype:
        raise ValueError(f"{op}: expected `{name}` to have the dtype of `positions` ({positions.dtype}), got {t.dtype}.")
    if t.device != positions.device:
        raise RuntimeError(f"{op}: expected `{name}` on the device of `positions` ({positions.device}), got {t.device}.")


def _check_values(values, name, positions, op):
    """(B, N) or (B, N, C) -> C or None (no channel axis)."""
    if values.dim() not in (2, 3) or tuple(values.shape[:2]) != tuple(positions.shape[:2]):
        raise ValueError(
            f"{op}: expected `{name}` of shape (B, N) or (B, N, C) with (B, N) = "
            f"{tuple(positions.shape[:2])} from `positions`, got {tuple(values.shape)}."
        )
    _check_same(values, name, positions, op)
    if values.dim() == 3 and values.shape[2] == 0:
        raise ValueError(f"{op}: `{name}` has zero channels.")
    return values.shape[2] if values.dim() == 3 else None


def _check_mesh(mesh, positions, op):
    if mesh.dim() not in (4, 5) or mesh.shape[0] != positions.shape[0]:
        raise ValueError(
            f"{op}: expected `mesh` of shape (B, nx, ny, nz) or (B, C, nx, ny, nz) with B = "
            f"{positions.shape[0]} from `positions`, got {tuple(mesh.shape)}."
        )
    _check_same(mesh, "mesh", positions, op)
    if mesh.dim() == 5 and mesh.shape[1] == 0:
        raise ValueError(f"{op}: `mesh` has zero channels.")
    if any(s <= 0 for s in mesh.shape[-3:]):
        raise ValueError(f"{op}: expected every mesh size of `mesh` to be positive, got {tuple(mesh.shape)}.")
    return mesh.shape[1] if mesh.dim() == 5 else None


def _check_geometry(shape, offset, order, op):
    if len(shape) != 3 or any(s <= 0 or s > args.MAX_AXIS for s in shape):
        raise ValueError(f"{op}: expected `shape` to be 3 positive integers below 2^31, got {tuple(shape)}.")
    if len(offset) != 3 or any(abs(o) >= 2**40 for o in offset):
        raise ValueError(f"{op}: expected `offset` to have 3 entries below 2^40, got {tuple(offset)}.")
    if not 1 <= order <= 4:
        raise ValueError(f"{op}: expected `order` 1 (NGP), 2 (CIC), 3 (TSC) or 4 (PCS), got {order}.")


def _paint_checks(positions, weights, shape, offset, order):
    op = "torchpm.paint"
    _check_positions(positions, op)
    channels = _check_values(weights, "weights", positions, op) if weights is not None else None
    _check_geometry(shape, offset, order, op)
    return channels


@torch.library.register_fake("torchpm::paint")
def _paint_fake(positions, weights, shape, offset, periodic, order=2, check_finite=True):
    channels = _paint_checks(positions, weights, shape, offset, order)
    batch = positions.shape[0]
    if channels is not None:
        return positions.new_empty(batch, channels, *shape)
    return positions.new_empty(batch, *shape)


torch.library.register_fake("torchpm::_paint_deterministic")(_paint_fake)
torch.library.register_fake("torchpm::_paint_tiled")(_paint_fake)


@torch.library.register_fake("torchpm::readout")
def _readout_fake(mesh, positions, offset, periodic, order=2, check_finite=True):
    op = "torchpm.readout"
    _check_positions(positions, op)
    channels = _check_mesh(mesh, positions, op)
    _check_geometry(list(mesh.shape[-3:]), offset, order, op)
    batch, count = positions.shape[0], positions.shape[1]
    if channels is not None:
        return positions.new_empty(batch, count, channels)
    return positions.new_empty(batch, count)


@torch.library.register_fake("torchpm::_readout_kick_drift_")
def _readout_kick_drift_fake(mesh, positions, momenta, offset, periodic, order, kicks, drift, check_finite=True):
    op = "torchpm._readout_kick_drift_"
    _check_positions(positions, op)
    if mesh.dim() != 5 or mesh.shape[1] != 3:
        raise ValueError(f"{op}: expected `mesh` of shape (B, 3, nx, ny, nz) (the three force components), got "
                         f"{tuple(mesh.shape)}.")
    _check_mesh(mesh, positions, op)
    if momenta.shape != positions.shape or momenta.dtype != positions.dtype or momenta.device != positions.device:
        raise ValueError(f"{op}: expected `momenta` of the shape, dtype and device of `positions` "
                         f"{tuple(positions.shape)}, {positions.dtype}, {positions.device}; got "
                         f"{tuple(momenta.shape)}, {momenta.dtype}, {momenta.device}.")
    if not (positions.is_contiguous() and momenta.is_contiguous()):
        raise ValueError(f"{op}: expected `positions` and `momenta` contiguous (they are updated in place); got "
                         f"strides {tuple(positions.stride())} and {tuple(momenta.stride())}.")
    if len(kicks) not in (1, 2):
        raise ValueError(f"{op}: expected one or two `kicks`, got {len(kicks)}.")
    _check_geometry(list(mesh.shape[-3:]), offset, order, op)


@torch.library.register_fake("torchpm::_position_gradient")
def _position_gradient_fake(mesh, positions, values, offset, periodic, order=2):
    op = "torchpm._position_gradient"
    _check_positions(positions, op)
    channels = _check_mesh(mesh, positions, op)
    if values is not None:
        if _check_values(values, "values", positions, op) != channels:
            raise ValueError(f"{op}: `values` must have one entry per channel of `mesh`.")
    elif channels is not None:
        raise ValueError(f"{op}: `values` may be omitted only for a single-channel mesh.")
    _check_geometry(list(mesh.shape[-3:]), offset, order, op)
    # A fresh contiguous (B, N, 3), as the kernels return, whatever the strides of positions.
    return positions.new_empty(positions.shape[0], positions.shape[1], 3)


@torch.library.register_fake("torchpm::_readout_and_position_gradient")
def _readout_and_position_gradient_fake(mesh, positions, values, readout_channels, offset, periodic, order=2):
    op = "torchpm._readout_and_position_gradient"
    gradient = _position_gradient_fake(mesh, positions, values, offset, periodic, order)
    channels = _check_mesh(mesh, positions, op) or 1
    if not 0 <= readout_channels <= channels:
        raise ValueError(
            f"{op}: expected `readout_channels` between 0 and the {channels} channels of `mesh`, "
            f"got {readout_channels}."
        )
    return positions.new_empty(positions.shape[0], positions.shape[1], readout_channels), gradient


# ----------------------------------------------------------------------------
# Autograd. Every backward is made of custom ops, so torch.compile traces it.


def _paint_setup_context(ctx, inputs, output):
    positions, weights, shape, offset, periodic, order, _ = inputs
    ctx.save_for_backward(positions, weights)
    ctx.geometry = (offset, periodic, order)


def _paint_backward(ctx, grad_mesh):
    positions, weights = ctx.saved_tensors
    offset, periodic, order = ctx.geometry
    grad_positions = grad_weights = None
    if ctx.needs_input_grad[0]:
        grad_positions = _ops._position_gradient(grad_mesh, positions, weights, offset, periodic, order)
    if weights is not None and ctx.needs_input_grad[1]:
        grad_weights = _ops.readout(grad_mesh, positions, offset, periodic, order, False)
    return grad_positions, grad_weights, None, None, None, None, None


def _readout_setup_context(ctx, inputs, output):
    mesh, positions, offset, periodic, order, _ = inputs
    ctx.save_for_backward(mesh, positions)
    ctx.geometry = (offset, periodic, order)


def _readout_backward(ctx, grad_values):
    mesh, positions = ctx.saved_tensors
    offset, periodic, order = ctx.geometry
    grad_mesh = grad_positions = None
    if ctx.needs_input_grad[0]:
        shape = list(mesh.shape[-3:])
        # (deterministic mode may have been switched on after the forward)
        grad_mesh = _paint_op(positions, order, grad_values)(positions, grad_values, shape, offset, periodic, order, False)
    if ctx.needs_input_grad[1]:
        grad_positions = _ops._position_gradient(mesh, positions, grad_values, offset, periodic, order)
    return grad_mesh, grad_positions, None, None, None, None


def _position_gradient_setup_context(ctx, inputs, output):
    mesh, positions, values, offset, periodic, order = inputs
    ctx.save_for_backward(mesh, positions, values)
    ctx.geometry = (offset, periodic, order)


def _position_gradient_backward(ctx, grad):
    # Only reached for second derivatives (Hessian-vector products, gradient
    # penalties). Rare enough to differentiate the pure-torch twin instead of
    # keeping a second set of kernels; exact, including the cross terms
    # d2W/dx_i dx_j of the separable weights. The partial derivatives are taken with
    # torch.func.vjp, which treats mesh, positions and values as independent inputs:
    # torch.autograd.grad on the saved tensors themselves would add, to the partial in
    # the positions, the path through a mesh that depends on them (the cotangent of a
    # paint inside a loss such as sum(paint(x)**2)), counting it twice. The result
    # stays differentiable in the saved tensors for third derivatives.
    mesh, positions, values = ctx.saved_tensors
    offset, periodic, order = ctx.geometry
    needs = ctx.needs_input_grad[:3]
    inputs = (mesh, positions, values)
    wanted = [i for i, need in enumerate(needs) if need and inputs[i] is not None]

    def twin(*chosen):
        arguments = list(inputs)
        for i, value in zip(wanted, chosen):
            arguments[i] = value
        return _reference.position_gradient_reference(*arguments, offset, periodic, order)

    result = [None, None, None]
    if wanted:
        _, pull_back = torch.func.vjp(twin, *(inputs[i] for i in wanted))
        for i, g in zip(wanted, pull_back(grad)):
            result[i] = g
    return (*result, None, None, None)


_register_autograd("torchpm::paint", _paint_backward, setup_context=_paint_setup_context)
_register_autograd(
    "torchpm::_paint_deterministic", _paint_backward, setup_context=_paint_setup_context
)
_register_autograd("torchpm::_paint_tiled", _paint_backward, setup_context=_paint_setup_context)
_register_autograd("torchpm::readout", _readout_backward, setup_context=_readout_setup_context)
_register_autograd(
    "torchpm::_position_gradient",
    _position_gradient_backward,
    setup_context=_position_gradient_setup_context,
)
