"""Functions of |k| evaluated once per distinct |k| of a Fourier block
(``FourierKernels.radial``), against the same function on every entry."""

from __future__ import annotations

import math

import pytest
import torch

import torchpm
from torchpm.fourier import FourierKernels
from torchpm.ic import power_kernel
from torchpm.mesh import LocalMesh

CASES = [
    ((16, 16, 16), (100.0, 100.0, 100.0)),  # cube: one value per integer m
    ((8, 12, 9), (80.0, 80.0, 80.0)),  # cubic box, other cell sizes per axis: still one per m
    ((12, 10, 14), (150.0, 120.0, 180.0)),  # unequal sides: the folded table
    ((7, 6, 5), (35.0, 30.0, 25.0)),  # odd sizes
]


def _kernels(shape, box, dtype=torch.float64):
    return FourierKernels(LocalMesh(shape), [b / n for b, n in zip(box, shape)], dtype=dtype)


@pytest.mark.parametrize("shape,box", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_radial_values_are_the_function_of_every_entry(shape, box, dtype):
    """radial(f) equals f(|k|) on every entry: bit for bit where the table holds the block's
    own |k| (unequal sides, and float32's rounding), within 1e-15 in a float64 cube (|k| =
    2 pi sqrt(m) / L); f is called once, on far fewer values than the block has."""
    kernels = _kernels(shape, box, dtype)
    calls = []

    def function(k):
        calls.append(k.numel())
        return torch.exp(-k) * torch.cos(3.0 * k) + k**2

    got = kernels.radial(function)
    k = kernels.k_magnitude.to(torch.float64).expand(*kernels.mesh.local_fourier_shape)
    expected = function(k)
    assert got.shape == expected.shape and got.dtype == torch.float64
    assert len(calls) == 2 and calls[0] < calls[1]
    cube = max(box) == min(box)
    if cube and dtype == torch.float64:
        assert float((got - expected).abs().max()) <= 1e-15 * float(expected.abs().max())
    else:
        assert torch.equal(got, expected)
    n_half = [n // 2 + 1 for n in shape]
    largest = sum((n // 2) ** 2 for n in shape)
    assert calls[0] == (largest + 1 if cube and largest + 1 < math.prod(n_half) else math.prod(n_half))


def test_radial_values_carry_gradients():
    """A function with parameters: gradients through radial equal those through every entry."""
    kernels = _kernels((10, 12, 8), (90.0, 90.0, 90.0))
    weight = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    field = torch.randn(*kernels.mesh.local_fourier_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (got,) = torch.autograd.grad((kernels.radial(lambda k: torch.sin(weight * k)) * field).sum(), weight)
    k = kernels.k_magnitude.to(torch.float64)
    (expected,) = torch.autograd.grad((torch.sin(weight * k) * field).sum(), weight)
    assert abs(float(got - expected)) <= 1e-12 * abs(float(expected))


@pytest.mark.parametrize("shape,box", CASES)
def test_power_kernel_matches_the_spectrum_on_every_entry(shape, box):
    """sqrt(P(|k|) N / V) with P evaluated entry by entry (0 at k = 0), to 1e-14."""
    cosmology = torchpm.Planck15()
    kernels = _kernels(shape, box)
    got = power_kernel(kernels, box, lambda k, c: torchpm.cosmology.linear_power(k, c), cosmology)
    k = kernels.k_magnitude.to(torch.float64).expand(*kernels.mesh.local_fourier_shape)
    safe = torch.where(k > 0, k, torch.ones_like(k))
    expected = torch.sqrt(torchpm.cosmology.linear_power(safe, cosmology) * math.prod(shape) / math.prod(box))
    expected = torch.where(k > 0, expected, torch.zeros_like(expected))
    assert float(got.flatten()[0]) == 0.0
    assert float((got - expected).abs().max()) <= 1e-14 * float(expected.max())
