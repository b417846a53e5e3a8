"""Distributed pieces of torchpm: the pencil decomposition (the mesh protocol on a process
grid), its distributed rfftn/irfftn, halo exchange, particle migration, and the
transposer ops they are built from. One concern per module:

* :mod:`.layout`: block layout arithmetic (sizes, offsets, owners);
* :mod:`.groups`: process groups of a grid, grid-wide reductions, failing together;
* :mod:`.fft`: the transposes and the distributed FFT;
* :mod:`.halo`: halo fill and add;
* :mod:`.particles`: migration plans;
* :mod:`.decomposition`: :class:`PencilDecomposition`, which composes them.

A single process is a 1 x 1 grid: ``PencilDecomposition(shape)`` needs no
process group and its operations are the plain local ones.
"""

from ._ops import all_to_all, pack_blocks, unpack_blocks
from .decomposition import PencilDecomposition
from .groups import process_grid_groups
from .layout import balanced_grid, split_sizes
from .particles import MigrationPlan, debug_checks

__all__ = [
    "PencilDecomposition",
    "MigrationPlan",
    "balanced_grid",
    "debug_checks",
    "process_grid_groups",
    "split_sizes",
    "pack_blocks",
    "unpack_blocks",
    "all_to_all",
]
