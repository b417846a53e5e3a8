"""The mesh interface the physics is written against: FFTs, wavevectors, paint, readout.

Every Fourier transform and every CIC operation of the simulation goes through
an object with the interface of :class:`LocalMesh`. The distributed FFT (pencil
or slab decomposition over ``torch.distributed``) implements the same interface,
so the physics in :mod:`torchpm.ic`, :mod:`torchpm.pm` and
:mod:`torchpm.analysis` never branches on "distributed or not" (DESIGN.md: one
code path). :class:`LocalMesh` is the 1x1 process grid.

Interface (what the physics may use, and nothing else):

* ``global_shape``: ``(nx, ny, nz)`` of the whole mesh;
* ``local_real_shape``, ``local_real_offset``: this rank's block of the real
  mesh and the global index of its node ``(0, 0, 0)``;
* ``local_fourier_shape``: shape of the local complex block (in the layout
  ``rfftn`` returns it, which may be transposed in the distributed version);
* ``rfftn(field)``: real ``(B, *local_real_shape)`` (or ``(B, C, ...)``) to
  complex ``(B, *local_fourier_shape)``, unnormalised forward transform;
* ``irfftn(field_k)``: the inverse, normalised by ``1/N``;
* ``wavevectors(dtype, device)``: ``(w_x, w_y, w_z)`` in radians per cell,
  ``2 pi fftfreq(n)`` (``rfftfreq`` along z) of the local Fourier block, each
  shaped to broadcast against the local complex block in its actual layout;
* ``paint(positions, weights, order=...)`` / ``readout(mesh, positions, order=...)``:
  mass assignment (``"ngp"``, ``"cic"``, ``"tsc"``, ``"pcs"``) on the local block
  (the distributed version adds halo and particle exchanges).

Fourier kernels must be written in terms of :meth:`wavevectors` only, never by
assuming the axis order of the complex tensor.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch

from .ops import paint, readout

__all__ = ["LocalMesh", "as_box_size", "as_shape"]


def as_shape(value, name: str) -> tuple[int, int, int]:
    """``value`` (int or 3 ints) as a 3-tuple of positive ints, or a ValueError naming ``name``."""
    if isinstance(value, bool):
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
        if isinstance(item, bool) or not float(item).is_integer() or int(item) <= 0:
            raise ValueError(f"`{name}` must be positive integers, got {value!r}")
        result.append(int(item))
    return tuple(result)


def as_box_size(box_size) -> tuple[float, float, float]:
    """``box_size`` (a number or 3 numbers, Mpc/h) as 3 positive finite floats, or a
    ValueError naming ``box_size``."""
    if isinstance(box_size, bool):
        raise ValueError(f"`box_size` must be a positive number or 3 positive numbers, got {box_size!r}")
    if isinstance(box_size, numbers.Real):
        box_size = (box_size,) * 3
    try:
        box = tuple(float(b) for b in box_size)
    except (TypeError, ValueError):
        raise ValueError(f"`box_size` must be a positive number or 3 positive numbers, got {box_size!r}") from None
    if len(box) != 3 or not all(math.isfinite(b) and b > 0 for b in box):
        raise ValueError(f"`box_size` must be positive and finite (Mpc/h), got {box_size!r}")
    return box


class LocalMesh:
    """The whole periodic mesh on one device (the 1x1 process grid).

    Args:
        shape: ``(nx, ny, nz)`` (or one int for a cube) of the global mesh.
    """

    def __init__(self, shape: int | Sequence[int]):
        self.global_shape = as_shape(shape, "shape")
        self.local_real_shape = self.global_shape
        self.local_real_offset = (0, 0, 0)
        nx, ny, nz = self.global_shape
        self.local_fourier_shape = (nx, ny, nz // 2 + 1)
        self._wavevector_cache: dict = {}

    def __repr__(self) -> str:
        return f"LocalMesh(shape={self.global_shape})"

    @property
    def size(self) -> int:
        """Number of cells of the global mesh, ``nx * ny * nz``."""
        return math.prod(self.global_shape)

    def rfftn(self, field: torch.Tensor) -> torch.Tensor:
        """Unnormalised forward DFT over the last 3 axes, ``(..., nx, ny, nz)`` real to
        ``(..., nx, ny, nz//2+1)`` complex."""
        self._check_real(field, "rfftn")
        return torch.fft.rfftn(field, dim=(-3, -2, -1))

    def irfftn(self, field_k: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rfftn` (normalised by ``1/N``): complex
        ``(..., nx, ny, nz//2+1)`` to real ``(..., nx, ny, nz)``."""
        if tuple(field_k.shape[-3:]) != self.local_fourier_shape:
            raise ValueError(
                f"irfftn: expected a complex field ending in {self.local_fourier_shape}, "
                f"got shape {tuple(field_k.shape)}"
            )
        return torch.fft.irfftn(field_k, s=self.global_shape, dim=(-3, -2, -1))

    def wavevectors(self, dtype=torch.float32, device=None):
        """``(w_x, w_y, w_z)``: radians per cell of the local Fourier block.

        ``w_x = 2 pi fftfreq(nx)`` shaped ``(nx, 1, 1)``, ``w_y`` shaped ``(1, ny, 1)``,
        ``w_z = 2 pi rfftfreq(nz)`` shaped ``(1, 1, nz//2+1)``: they broadcast against
        the complex block. The Nyquist frequency of an even axis is ``-pi`` (numpy
        convention) along x and y and ``+pi`` along z.
        """
        device = torch.device("cpu") if device is None else torch.device(device)
        key = (dtype, device)
        if key not in self._wavevector_cache:
            nx, ny, nz = self.global_shape
            wx = torch.fft.fftfreq(nx, dtype=torch.float64) * (2 * math.pi)
            wy = torch.fft.fftfreq(ny, dtype=torch.float64) * (2 * math.pi)
            wz = torch.fft.rfftfreq(nz, dtype=torch.float64) * (2 * math.pi)
            self._wavevector_cache[key] = (
                wx.view(nx, 1, 1).to(dtype=dtype, device=device),
                wy.view(1, ny, 1).to(dtype=dtype, device=device),
                wz.view(1, 1, nz // 2 + 1).to(dtype=dtype, device=device),
            )
        return self._wavevector_cache[key]

    def hermitian_weights(self, dtype=torch.float64, device=None) -> torch.Tensor:
        """How many modes of the full complex DFT each entry of the rfft block stands for.

        2 for ``0 < k_z < nz/2`` (the entry and its conjugate), 1 on the ``k_z = 0``
        plane and, for even ``nz``, on the Nyquist plane. Shaped to broadcast like
        ``w_z``. Sums over the block weighted by this equal sums over all modes.
        """
        nz = self.global_shape[2]
        weights = torch.full((nz // 2 + 1,), 2.0, dtype=dtype, device=device)
        weights[0] = 1.0
        if nz % 2 == 0:
            weights[-1] = 1.0
        return weights.view(1, 1, -1)

    def paint(
        self, positions: torch.Tensor, weights: torch.Tensor | None = None, *, order: str = "cic"
    ) -> torch.Tensor:
        """Paint ``(B, N, 3)`` positions in mesh-cell units onto the local block with the
        mass-assignment window ``order`` (``"ngp"``, ``"cic"``, ``"tsc"``, ``"pcs"``).

        Returns ``(B, *local_real_shape)`` (or ``(B, C, ...)`` for ``(B, N, C)`` weights).
        """
        return paint(
            positions, weights, self.local_real_shape, order=order, offset=self.local_real_offset, periodic=True
        )

    def readout(self, mesh: torch.Tensor, positions: torch.Tensor, *, order: str = "cic") -> torch.Tensor:
        """Readout of ``(B, [C,] *local_real_shape)`` at ``(B, N, 3)`` positions with the
        window ``order``: ``(B, N)`` or ``(B, N, C)``."""
        return readout(mesh, positions, order=order, offset=self.local_real_offset, periodic=True)

    def _check_real(self, field, op):
        if field.is_complex() or tuple(field.shape[-3:]) != self.local_real_shape:
            raise ValueError(
                f"{op}: expected a real field ending in {self.local_real_shape}, got "
                f"{'complex ' if field.is_complex() else ''}shape {tuple(field.shape)}"
            )
