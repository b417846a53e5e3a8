"""``torch.ops.torchpm._add_scaled``: the integrator's ``x + y * f`` in one pass, with a
fake kernel and autograd; ``_add_scaled_`` the same written into ``x`` (no autograd: the
integrator calls it only on arrays it owns, outside any graph).
:func:`torchpm.pm.add_scaled` and :func:`torchpm.pm.add_scaled_` are their front ends."""

from __future__ import annotations

import torch

from ._autograd import register_autograd as _register_autograd

__all__ = []


def _check(op, x, y):
    if x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: expected `x` to be float32 or float64, got {x.dtype}.")
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        raise ValueError(
            f"{op}: expected `y` of the shape, dtype and device of `x` {tuple(x.shape)}, "
            f"{x.dtype}, {x.device}; got {tuple(y.shape)}, {y.dtype}, {y.device}."
        )


@torch.library.register_fake("torchpm::_add_scaled")
def _add_scaled_fake(x, y, factor):
    _check("torchpm._add_scaled", x, y)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("torchpm::_add_scaled_")
def _add_scaled_in_place_fake(x, y, factor):
    _check("torchpm._add_scaled_", x, y)
    if not x.is_contiguous():
        raise ValueError(f"torchpm._add_scaled_: expected `x` contiguous (it is updated in place); got strides "
                         f"{tuple(x.stride())}.")


def _setup(ctx, inputs, output):
    ctx.factor = inputs[2]


def _backward(ctx, grad):
    return grad, grad * ctx.factor, None


_register_autograd("torchpm::_add_scaled", _backward, setup_context=_setup)
