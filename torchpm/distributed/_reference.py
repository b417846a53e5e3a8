"""Pure-torch twins of the transposer ops: the test oracle for pack/unpack."""

from __future__ import annotations

import torch


def pack_blocks_reference(input: torch.Tensor, dim: int, sizes) -> torch.Tensor:
    """``cat`` of the flattened chunks ``input.split(sizes, dim)``; see ``pack_blocks``."""
    return torch.cat([chunk.reshape(-1) for chunk in torch.split(input, list(sizes), dim)])


def unpack_blocks_reference(buffer: torch.Tensor, shape, dim: int, sizes) -> torch.Tensor:
    """Inverse of :func:`pack_blocks_reference`; see ``unpack_blocks``."""
    shape = list(shape)
    dim = dim % len(shape)
    chunks, start = [], 0
    for size in sizes:
        chunk_shape = shape[:dim] + [size] + shape[dim + 1 :]
        count = 1
        for s in chunk_shape:
            count *= s
        chunks.append(buffer[start : start + count].reshape(chunk_shape))
        start += count
    return torch.cat(chunks, dim)
