"""``torch.ops.torchpm._add_scaled``: the integrator's ``x + y * f`` in one pass, with a
fake kernel and autograd. :func:`torchpm.pm.add_scaled` is its front end."""

from __future__ import annotations

import torch

__all__ = []


@torch.library.register_fake("torchpm::_add_scaled")
def _add_scaled_fake(x, y, factor):
    if x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"torchpm._add_scaled: expected `x` to be float32 or float64, got {x.dtype}.")
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        raise ValueError(
            f"torchpm._add_scaled: expected `y` of the shape, dtype and device of `x` {tuple(x.shape)}, "
            f"{x.dtype}, {x.device}; got {tuple(y.shape)}, {y.dtype}, {y.device}."
        )
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    ctx.factor = inputs[2]


def _backward(ctx, grad):
    return grad, grad * ctx.factor, None


torch.library.register_autograd("torchpm::_add_scaled", _backward, setup_context=_setup)
