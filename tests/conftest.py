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
