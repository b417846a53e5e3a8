"""The mesh interface the physics is written against, and its single-device case.

Every Fourier transform, mass assignment, reduction and particle migration of the
simulation goes through an object with the :class:`Mesh` interface. It has one
implementation, :class:`torchpm.distributed.PencilDecomposition`, for every
process grid; :class:`LocalMesh` is its 1 x 1 grid (no process group, plain local
operations). So the physics in :mod:`torchpm.ic`, :mod:`torchpm.pm`,
:mod:`torchpm.analysis` and :class:`torchpm.Simulation` never branches on
"distributed or not" (DESIGN.md: one code path).

Fourier kernels must be written in terms of :meth:`Mesh.wavevectors` only, never by
assuming the axis order of the complex tensor (the distributed layout is
transposed).
"""

from __future__ import annotations

import math
import numbers
from typing import Protocol, Sequence, runtime_checkable

import torch

from .distributed.decomposition import PencilDecomposition

__all__ = ["Mesh", "LocalMesh", "as_box_size", "as_shape"]


def as_shape(value, name: str) -> tuple[int, int, int]:
    """``value`` (int or 3 ints) as a 3-tuple of positive ints, or a ValueError naming ``name``."""
    # A string is iterable: "444" would read as (4, 4, 4).
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"`{name}` must be a positive integer or 3 positive integers, got {value!r}")
    if isinstance(value, numbers.Integral) or (isinstance(value, numbers.Real) and float(value).is_integer()):
        value = (int(value),) * 3
    try:
        items = list(value)
    except TypeError:
        raise ValueError(
            f"`{name}` must be a positive integer or 3 positive integers, got {value!r}"
        ) from None
    if len(items) != 3:
        raise ValueError(f"`{name}` must have 3 entries, got {value!r}")
    result = []
    for item in items:
        try:
            integral = not isinstance(item, (bool, str, bytes)) and float(item).is_integer()
        except (TypeError, ValueError):
            integral = False
        if not integral or int(item) <= 0:
            raise ValueError(f"`{name}` must be positive integers, got {value!r}")
        result.append(int(item))
    return tuple(result)


def as_box_size(box_size) -> tuple[float, float, float]:
    """``box_size`` (a number or 3 numbers, Mpc/h) as 3 positive finite floats, or a
    ValueError naming ``box_size``."""
    # A string is iterable: "256" would read as (2.0, 5.0, 6.0).
    if isinstance(box_size, (bool, str, bytes)):
        raise ValueError(f"`box_size` must be a positive number or 3 positive numbers, got {box_size!r}")
    if isinstance(box_size, numbers.Real):
        box_size = (box_size,) * 3
    try:
        if any(isinstance(b, (bool, str, bytes)) for b in box_size):
            raise TypeError
        box = tuple(float(b) for b in box_size)
    except (TypeError, ValueError):
        raise ValueError(f"`box_size` must be a positive number or 3 positive numbers, got {box_size!r}") from None
    if len(box) != 3 or not all(math.isfinite(b) and b > 0 for b in box):
        raise ValueError(f"`box_size` must be positive and finite (Mpc/h), got {box_size!r}")
    return box


@runtime_checkable
class Mesh(Protocol):
    """What the physics needs from a mesh (implemented by :class:`PencilDecomposition`).

    Attributes: ``global_shape`` ``(nx, ny, nz)``; ``size`` (``nx ny nz``);
    ``grid_shape`` ``(P0, P1)``; ``local_real_shape`` / ``local_real_offset``: this
    rank's real block and the global index of its node ``(0, 0, 0)``;
    ``local_fourier_shape`` / ``local_fourier_offset``: its block of the rfft
    spectrum, in the layout :meth:`rfftn` returns (transposed on a grid).
    """

    global_shape: tuple[int, int, int]
    grid_shape: tuple[int, int]
    local_real_shape: tuple[int, int, int]
    local_real_offset: tuple[int, int, int]
    local_fourier_shape: tuple[int, int, int]
    local_fourier_offset: tuple[int, int, int]

    @property
    def size(self) -> int: ...

    def rfftn(self, field: torch.Tensor) -> torch.Tensor:
        """Unnormalised forward DFT: real ``(..., *local_real_shape)`` to complex
        ``(..., *local_fourier_shape)``."""

    def irfftn(self, field_k: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`rfftn`, normalised by ``1/N``."""

    def wavevectors(self, dtype=torch.float32, device=None):
        """``(w_x, w_y, w_z)`` in radians per cell of the local Fourier block, each shaped
        to broadcast against it (``2 pi fftfreq``, ``rfftfreq`` along z)."""

    def hermitian_weights(self, dtype=torch.float64, device=None) -> torch.Tensor:
        """Full-DFT modes each local rfft entry stands for (1 or 2), broadcastable."""

    def paint(self, positions: torch.Tensor, weights: torch.Tensor | None = None, *, order: str = "cic") -> torch.Tensor:
        """Mass assignment of owned ``(B, N, 3)`` particles (mesh-cell units) onto the local block."""

    def readout(self, field: torch.Tensor, positions: torch.Tensor, *, order: str = "cic") -> torch.Tensor:
        """Interpolation of the local block at owned particles."""

    def migrate(self, positions: torch.Tensor, ids: torch.Tensor, *attributes: torch.Tensor,
                capacity: int | None = None, destination: torch.Tensor | None = None, overwrite: bool = False,
                overwrite_ids: bool = False):
        """Move particles to the ranks owning their positions: ``(plan, positions, ids, *attributes)``."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce a tensor over every rank of the grid."""

    def raise_together(self, error: str | None, exception=ValueError, operation: str = "") -> None:
        """Raise on every rank when any rank reports an error."""


class LocalMesh(PencilDecomposition):
    """The whole periodic mesh on one device: the 1 x 1 process grid.

    Args:
        shape: ``(nx, ny, nz)`` (or one int for a cube) of the global mesh.
    """

    def __init__(self, shape: int | Sequence[int]):
        super().__init__(as_shape(shape, "shape"))

    def __repr__(self) -> str:
        return f"LocalMesh(shape={self.global_shape})"
