"""Fake kernels and autograd of the transposer ops, and their Python front ends.

``pack_blocks`` / ``unpack_blocks`` are C++ (CPU) and CUDA kernels;
``_all_to_all`` is C++ issuing the collective on the c10d ProcessGroup resolved
from the group's name. All three are linear maps whose adjoints are each other
(pack <-> unpack) or themselves with the roles of the split sizes swapped
(all-to-all), so every backward is another call of these ops.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..ops._autograd import register_autograd as _register_autograd

__all__ = ["pack_blocks", "unpack_blocks", "all_to_all"]

_ops = torch.ops.torchpm


def _int_list(values, name, op):
    try:
        values = [int(v) for v in values]
    except TypeError:
        raise ValueError(f"{op}: `{name}` must be a sequence of integers, got {values!r}") from None
    return values


def pack_blocks(input: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Split ``input`` along ``dim`` into chunks of ``sizes`` and pack them end to end.

    Returns a 1-D tensor with ``input.numel()`` elements: chunk ``p``
    (``input.narrow(dim, sum(sizes[:p]), sizes[p])`` in row-major order) occupies
    one contiguous range, so an all-to-all can send chunk ``p`` to peer ``p``.
    Any dtype; differentiable (the backward is :func:`unpack_blocks`).
    """
    return _ops.pack_blocks(input, int(dim), _int_list(sizes, "sizes", "pack_blocks"))


def unpack_blocks(
    buffer: torch.Tensor, shape: Sequence[int], dim: int, sizes: Sequence[int]
) -> torch.Tensor:
    """Inverse of :func:`pack_blocks`: a 1-D buffer of chunks back to a tensor of ``shape``.

    ``shape[dim]`` must equal ``sum(sizes)``; chunk ``p`` of the buffer has shape
    ``shape`` with ``dim`` replaced by ``sizes[p]``. Differentiable (the backward
    is :func:`pack_blocks`).
    """
    return _ops.unpack_blocks(
        buffer,
        _int_list(shape, "shape", "unpack_blocks"),
        int(dim),
        _int_list(sizes, "sizes", "unpack_blocks"),
    )


def all_to_all(
    input: torch.Tensor,
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    group_name: str,
) -> torch.Tensor:
    """All-to-all of a 1-D buffer over the process group named ``group_name``.

    Chunk ``p`` of ``input`` (``input_split_sizes[p]`` elements) goes to group
    rank ``p``; chunk ``q`` of the result (``output_split_sizes[q]`` elements)
    comes from group rank ``q``. Differentiable: the backward is the reverse
    all-to-all, so every rank of the group must run the backward too.
    """
    return _ops._all_to_all(
        input,
        _int_list(input_split_sizes, "input_split_sizes", "all_to_all"),
        _int_list(output_split_sizes, "output_split_sizes", "all_to_all"),
        str(group_name),
    )


# ----------------------------------------------------------------------------
# Fake kernels: shapes only, for FakeTensor / torch.compile.


@torch.library.register_fake("torchpm::pack_blocks")
def _pack_fake(input, dim, sizes):
    if sum(sizes) != input.shape[dim]:
        raise ValueError(
            f"torchpm.pack_blocks: `sizes` {list(sizes)} sum to {sum(sizes)} but dimension {dim} "
            f"of the input has size {input.shape[dim]}"
        )
    return input.new_empty(input.numel())


@torch.library.register_fake("torchpm::unpack_blocks")
def _unpack_fake(buffer, shape, dim, sizes):
    if buffer.dim() != 1:
        raise ValueError(f"torchpm.unpack_blocks: expected a 1-D `buffer`, got {tuple(buffer.shape)}")
    return buffer.new_empty(shape)


@torch.library.register_fake("torchpm::_all_to_all")
def _all_to_all_fake(input, input_split_sizes, output_split_sizes, group_name):
    return input.new_empty(sum(output_split_sizes))


# ----------------------------------------------------------------------------
# Autograd: the adjoint of a permutation is its inverse.


def _pack_setup_context(ctx, inputs, output):
    input, dim, sizes = inputs
    ctx.layout = (list(input.shape), dim, sizes)


def _pack_backward(ctx, grad):
    shape, dim, sizes = ctx.layout
    return _ops.unpack_blocks(grad.contiguous(), shape, dim, sizes), None, None


def _unpack_setup_context(ctx, inputs, output):
    buffer, shape, dim, sizes = inputs
    ctx.layout = (dim, sizes)


def _unpack_backward(ctx, grad):
    dim, sizes = ctx.layout
    return _ops.pack_blocks(grad, dim, sizes), None, None, None


def _all_to_all_setup_context(ctx, inputs, output):
    input, input_split_sizes, output_split_sizes, group_name = inputs
    ctx.splits = (input_split_sizes, output_split_sizes, group_name)


def _all_to_all_backward(ctx, grad):
    input_split_sizes, output_split_sizes, group_name = ctx.splits
    grad_input = _ops._all_to_all(grad.contiguous(), output_split_sizes, input_split_sizes, group_name)
    return grad_input, None, None, None


_register_autograd(
    "torchpm::pack_blocks", _pack_backward, setup_context=_pack_setup_context
)
_register_autograd(
    "torchpm::unpack_blocks", _unpack_backward, setup_context=_unpack_setup_context
)
_register_autograd(
    "torchpm::_all_to_all", _all_to_all_backward, setup_context=_all_to_all_setup_context
)
