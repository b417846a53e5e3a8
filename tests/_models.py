"""Small modules shared by the tests of gradients through corrections and spectra (imported
by pytest modules and by the spawned distributed workers alike)."""

from __future__ import annotations

import torch


class AmplifiedPower(torch.nn.Module):
    """The built-in linear spectrum times a learnable amplitude (a parameter)."""

    def __init__(self, amplitude: float = 1.0):
        super().__init__()
        self.amplitude = torch.nn.Parameter(torch.tensor(amplitude, dtype=torch.float64))

    def forward(self, k, cosmology):
        from torchpm.cosmology import linear_power

        return self.amplitude * linear_power(k, cosmology)


def perturbed_spline(conditions: int, seed: int, scale: float = 0.3):
    """A float64 NeuralSplineCorrection moved off the identity, so every weight has a gradient."""
    from torchpm.nn import NeuralSplineCorrection

    torch.manual_seed(seed)
    module = NeuralSplineCorrection(k_max=2.0, knots=6, hidden=(8,), conditions=conditions, dtype=torch.float64)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, dtype=torch.float64))
    return module
