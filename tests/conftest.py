"""Shared fixtures: every test runs on `cpu` and `cuda` (cuda skipped without a GPU)."""

import pytest
import torch

import torchpm

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not (torch.cuda.is_available() and torchpm.has_cuda_kernels()),
                reason="needs a CUDA device and a torchpm build with CUDA kernels",
            ),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def reproducible(device):
    """For tests that compare two runs bit for bit: on CUDA the paint's atomic adds sum
    in a varying order, so there the test runs under
    ``torch.use_deterministic_algorithms(True)`` (node-by-node paint, no atomics). The
    CPU kernels are deterministic as they are. ``warn_only``: a torch op without a
    deterministic CUDA kernel warns instead of raising (torchpm's paint is routed)."""
    if device.type != "cuda":
        yield
        return
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
