"""The 4-point finite-difference gradient in real space:
``torch.ops.torchpm._fd4_gradient`` and its transpose, with fake kernels and autograd.

On a mesh of unit spacing the derivative along an axis is
``D f(i) = (8 (f(i+1) - f(i-1)) - (f(i+2) - f(i-2))) / 12``, whose Fourier multiplier
is ``i (8 sin w - sin 2w) / 6``: FastPM's ``"fd4"`` gradient kernel
(:class:`torchpm.fourier.FourierKernels`). Applied to the potential in real space it
gives the three force components from one inverse FFT instead of three; the result
is the Fourier-space product's up to rounding.

:func:`fd4_gradient` maps a field ``(B, nx, ny, nz)`` to ``(B, 3, ox, oy, oz)``,
channel ``i`` being ``scale[i] * D_i field``. Along a periodic axis the stencil wraps
and ``o = n``; along the others it stays inside the field and ``o = n - 4`` (a block
of a distributed mesh whose halo of 2 is filled). :func:`fd4_gradient_transpose` is
the transpose of that map (the backward with respect to the field). Both are
differentiable with respect to their tensor and to ``scale``, to any order.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._autograd import register_autograd as _register_autograd

__all__ = ["fd4_gradient", "fd4_gradient_transpose", "FD4_REACH"]

_ops = torch.ops.torchpm

#: Nodes the stencil reaches on each side.
FD4_REACH = 2


def _scale_vector(scale, like: torch.Tensor, op: str) -> torch.Tensor:
    """``scale`` (3 numbers or 0-d tensors, or a (3,) tensor) as a (3,) tensor of
    ``like``'s dtype and device, keeping any autograd graph."""
    if isinstance(scale, torch.Tensor):
        vector = scale
    else:
        try:
            items = list(scale)
        except TypeError:
            raise TypeError(f"{op}: `scale` must be 3 numbers or a (3,) tensor, got {scale!r}") from None
        if len(items) != 3:
            raise ValueError(f"{op}: `scale` must have 3 entries, got {len(items)}")
        if any(isinstance(s, torch.Tensor) for s in items):
            vector = torch.stack([torch.as_tensor(s, dtype=torch.float64, device=like.device).reshape(()) for s in items])
        else:  # plain numbers: written by fills on the device, not copied from the host
            try:
                numbers = [float(s) for s in items]
            except (TypeError, ValueError):
                raise TypeError(f"{op}: `scale` must be 3 numbers or a (3,) tensor, got {scale!r}") from None
            return _filled_vector(numbers, like)
    if vector.shape != (3,):
        raise ValueError(f"{op}: `scale` must have shape (3,), got {tuple(vector.shape)}")
    return vector.to(dtype=like.dtype, device=like.device)


def _filled_vector(numbers, like: torch.Tensor) -> torch.Tensor:
    """The (3,) tensor of plain-number factors in ``like``'s dtype and device, written by
    three fills: no host-to-device copy, so a CUDA graph can capture the op (its replays
    keep the numbers of the capture). Each number is rounded to the dtype once, as a
    float64 tensor cast to it would be."""
    vector = torch.empty(3, dtype=like.dtype, device=like.device)
    for index, number in enumerate(numbers):
        vector[index].fill_(number)
    return vector


def _periodic(periodic, op: str) -> list[bool]:
    if isinstance(periodic, bool):
        return [periodic] * 3
    values = list(periodic)
    if len(values) != 3 or not all(isinstance(p, bool) for p in values):
        raise ValueError(f"{op}: `periodic` must be a bool or 3 bools, got {periodic!r}")
    return values


def fd4_gradient(field: torch.Tensor, scale, periodic: bool | Sequence[bool] = True) -> torch.Tensor:
    """``(B, 3, ox, oy, oz)``: channel ``i`` is ``scale[i] * D_i field`` (module docs).

    The result is in ``torch.channels_last_3d`` memory format (a node's three
    components side by side), the layout :func:`torchpm.ops.readout` reads fastest;
    it behaves as any ``(B, 3, ox, oy, oz)`` tensor (``.contiguous()`` gives planar).

    Args:
        field: ``(B, nx, ny, nz)`` float32 or float64, CPU or CUDA.
        scale: 3 factors (numbers or 0-d tensors, or a (3,) tensor; gradients flow
            into tensors), e.g. ``1 / cell_size`` for a derivative in physical units.
        periodic: per axis (or one bool for all): wrap the stencil (``o = n``), or
            keep it inside the field (``o = n - 4``, ``n >= 5``).
    """
    op = "fd4_gradient"
    if not isinstance(field, torch.Tensor):
        raise TypeError(f"{op}: `field` must be a torch.Tensor, got {type(field).__name__}")
    return _ops._fd4_gradient(field, _scale_vector(scale, field, op), _periodic(periodic, op))


def fd4_gradient_transpose(grad: torch.Tensor, scale, periodic: bool | Sequence[bool] = True) -> torch.Tensor:
    """The transpose of :func:`fd4_gradient` with the same ``scale`` and ``periodic``:
    ``(B, 3, ox, oy, oz)`` to ``(B, nx, ny, nz)`` (``n = o``, or ``o + 4`` on a
    non-periodic axis), i.e. ``-sum_i scale[i] D_i grad[:, i]`` with ``grad`` taken
    as zero outside a non-periodic axis."""
    op = "fd4_gradient_transpose"
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"{op}: `grad` must be a torch.Tensor, got {type(grad).__name__}")
    return _ops._fd4_gradient_transpose(grad, _scale_vector(scale, grad, op), _periodic(periodic, op))


# ----------------------------------------------------------------------------
# Fake kernels: the C++ checks that need no values, and the output shapes.


def _check_common(op, name, tensor, scale, periodic):
    if tensor.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: expected `{name}` to be float32 or float64, got {tensor.dtype}.")
    if scale.shape != (3,) or scale.dtype != tensor.dtype or scale.device != tensor.device:
        raise ValueError(
            f"{op}: expected `scale` to be a (3,) tensor of `{name}`'s dtype and device "
            f"({tensor.dtype}, {tensor.device}), got shape {tuple(scale.shape)}, {scale.dtype}, {scale.device}."
        )


@torch.library.register_fake("torchpm::_fd4_gradient")
def _fd4_gradient_fake(field, scale, periodic):
    op = "torchpm._fd4_gradient"
    _check_common(op, "field", field, scale, periodic)
    if field.dim() != 4:
        raise ValueError(f"{op}: expected `field` of shape (B, nx, ny, nz), got {tuple(field.shape)}.")
    shape = []
    for axis, (n, wrap) in enumerate(zip(field.shape[1:], periodic)):
        cut = 0 if wrap else 2 * FD4_REACH
        if n < 1 + cut:
            raise ValueError(f"{op}: expected `field` to have at least {1 + cut} nodes along axis {axis}, "
                             f"got shape {tuple(field.shape)}.")
        shape.append(n - cut)
    # Interleaved, as the kernels write it (the readout's fastest layout).
    return torch.empty((field.shape[0], 3, *shape), dtype=field.dtype, device=field.device,
                       memory_format=torch.channels_last_3d)


@torch.library.register_fake("torchpm::_fd4_gradient_transpose")
def _fd4_gradient_transpose_fake(grad, scale, periodic):
    op = "torchpm._fd4_gradient_transpose"
    _check_common(op, "grad", grad, scale, periodic)
    if grad.dim() != 5 or grad.shape[1] != 3:
        raise ValueError(f"{op}: expected `grad` of shape (B, 3, ox, oy, oz), got {tuple(grad.shape)}.")
    shape = [o + (0 if wrap else 2 * FD4_REACH) for o, wrap in zip(grad.shape[2:], periodic)]
    return grad.new_empty(grad.shape[0], *shape)


# ----------------------------------------------------------------------------
# Autograd: the two ops are each other's backward; the scale's gradient is the
# dot of the upstream gradient with the unit-scale derivatives.


def _setup(ctx, inputs, output):
    tensor, scale, periodic = inputs
    ctx.save_for_backward(tensor, scale)
    ctx.periodic = periodic


def _unit_scale_dot(grad_channels, field, periodic):
    """``(3,)``: ``sum grad_channels[:, i] * D_i field`` (unit scale)."""
    unit = _ops._fd4_gradient(field, torch.ones(3, dtype=field.dtype, device=field.device), periodic)
    return (grad_channels * unit).sum(dim=(0, 2, 3, 4))


def _fd4_gradient_backward(ctx, grad):
    field, scale = ctx.saved_tensors
    grad_field = grad_scale = None
    if ctx.needs_input_grad[0]:
        grad_field = _ops._fd4_gradient_transpose(grad, scale, ctx.periodic)
    if ctx.needs_input_grad[1]:
        grad_scale = _unit_scale_dot(grad, field, ctx.periodic)
    return grad_field, grad_scale, None


def _fd4_gradient_transpose_backward(ctx, grad):
    grad_channels, scale = ctx.saved_tensors
    grad_grad = grad_scale = None
    if ctx.needs_input_grad[0]:
        grad_grad = _ops._fd4_gradient(grad, scale, ctx.periodic)
    if ctx.needs_input_grad[1]:
        # <grad, T_i g_i> = <D_i grad, g_i> (T_i the unit transpose of channel i).
        grad_scale = _unit_scale_dot(grad_channels, grad, ctx.periodic)
    return grad_grad, grad_scale, None


_register_autograd("torchpm::_fd4_gradient", _fd4_gradient_backward, setup_context=_setup)
_register_autograd(
    "torchpm::_fd4_gradient_transpose", _fd4_gradient_transpose_backward, setup_context=_setup
)
