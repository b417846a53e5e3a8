"""Distributed pieces of torchpm: pencil decomposition, distributed rfftn/irfftn,
halo exchange, and the transposer ops they are built from.

A single process is a 1 x 1 grid: ``PencilDecomposition(shape)`` needs no
process group and its transforms are plain ``torch.fft`` calls.
"""

from ._ops import all_to_all, pack_blocks, unpack_blocks
from .decomposition import PencilDecomposition, process_grid_groups, split_sizes

__all__ = [
    "PencilDecomposition",
    "process_grid_groups",
    "split_sizes",
    "pack_blocks",
    "unpack_blocks",
    "all_to_all",
]
