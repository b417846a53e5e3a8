"""LocalMesh (the FFT/paint interface of the physics) and the P(k) estimators on hand cases."""

import math

import numpy as np
import pytest
import torch

from torchpm.analysis import correlation_coefficient, cross_power, power_spectrum, transfer_function
from torchpm.mesh import LocalMesh


def test_local_mesh_interface(device):
    mesh = LocalMesh((4, 6, 8))
    assert mesh.global_shape == (4, 6, 8) and mesh.local_real_shape == (4, 6, 8)
    assert mesh.local_real_offset == (0, 0, 0) and mesh.local_fourier_shape == (4, 6, 5)
    field = torch.randn(2, 4, 6, 8, dtype=torch.float64, device=device)
    field_k = mesh.rfftn(field)
    assert field_k.shape == (2, 4, 6, 5)
    # unnormalised forward, 1/N inverse (torch/numpy conventions)
    np.testing.assert_allclose(field_k.cpu().numpy(), np.fft.rfftn(field.cpu().numpy(), axes=(1, 2, 3)), atol=1e-12)
    torch.testing.assert_close(mesh.irfftn(field_k), field)
    wx, wy, wz = mesh.wavevectors(dtype=torch.float64, device=device)
    assert wx.shape == (4, 1, 1) and wy.shape == (1, 6, 1) and wz.shape == (1, 1, 5)
    np.testing.assert_allclose(wy.flatten().cpu().numpy(), 2 * np.pi * np.fft.fftfreq(6))
    np.testing.assert_allclose(wz.flatten().cpu().numpy(), 2 * np.pi * np.fft.rfftfreq(8))
    # Parseval with the Hermitian weights: sum x^2 = (1/N) sum_k weight |X_k|^2
    weights = mesh.hermitian_weights(device=device)
    parseval = (weights * field_k.abs() ** 2).sum(dim=(1, 2, 3)) / mesh.size
    torch.testing.assert_close(parseval, (field**2).sum(dim=(1, 2, 3)))
    # a derivative kernel written with the wavevectors: d/dx of sin(2 pi x / 4) = (pi/2) cos
    x = torch.arange(4, dtype=torch.float64, device=device).view(1, 4, 1, 1).expand(1, 4, 6, 8)
    derivative = mesh.irfftn(1j * wx * mesh.rfftn(torch.sin(2 * math.pi * x / 4)))
    # 4 points: the mode sits at +-pi/2 exactly; the exact derivative samples (pi/2) cos.
    torch.testing.assert_close(derivative, math.pi / 2 * torch.cos(2 * math.pi * x / 4), atol=1e-12, rtol=0)


def test_local_mesh_inverse_of_several_fields(device):
    # several leading dims (the CPU transforms them one field at a time), with and
    # without a graph: numpy's inverse is the oracle, gradcheck the backward
    mesh = LocalMesh((4, 6, 8))
    g = torch.Generator().manual_seed(5)
    field_k = mesh.rfftn(torch.randn(2, 3, 4, 6, 8, generator=g, dtype=torch.float64).to(device))
    expected = np.fft.irfftn(field_k.cpu().numpy(), s=(4, 6, 8), axes=(2, 3, 4))
    np.testing.assert_allclose(mesh.irfftn(field_k).cpu().numpy(), expected, atol=1e-12)
    with_graph = field_k.clone().requires_grad_()
    result = mesh.irfftn(with_graph)
    assert result.shape == (2, 3, 4, 6, 8) and result.requires_grad
    np.testing.assert_allclose(result.detach().cpu().numpy(), expected, atol=1e-12)
    single = mesh.rfftn(torch.randn(2, 1, 4, 6, 8, generator=g, dtype=torch.float64).to(device))
    torch.autograd.gradcheck(lambda k: mesh.irfftn(mesh.rfftn(mesh.irfftn(k))), (single.requires_grad_(),))


def test_local_mesh_paint_readout(device):
    mesh = LocalMesh(4)
    positions = torch.tensor([[[0.5, 1.0, 3.5]]], dtype=torch.float64, device=device)
    painted = mesh.paint(positions)
    assert painted.shape == (1, 4, 4, 4) and float(painted.sum()) == pytest.approx(1.0)
    # periodic: half of the weight of z = 3.5 wraps to node 0
    assert float(painted[0, 0, 1, 0]) == pytest.approx(0.25) and float(painted[0, 1, 1, 3]) == pytest.approx(0.25)
    values = mesh.readout(torch.stack([painted, 2 * painted], dim=1), positions)
    assert values.shape == (1, 1, 2)
    assert float(values[0, 0, 1]) == pytest.approx(2 * float(values[0, 0, 0]))
    with pytest.raises(ValueError, match="`field` of shape"):
        mesh.rfftn(torch.zeros(1, 4, 4, 5, device=device))


def test_as_shape_errors():
    for bad in (0, (4, 4), (4, 4, -1), "x", 2.5, True):
        with pytest.raises(ValueError, match="shape"):
            LocalMesh(bad)


def _plane_wave(n, box, mode, amplitude=1.0, phase="cos"):
    index = torch.arange(n, dtype=torch.float64)
    x, y, z = torch.meshgrid(index, index, index, indexing="ij")
    argument = 2 * math.pi * (mode[0] * x + mode[1] * y + mode[2] * z) / n
    return amplitude * (torch.cos(argument) if phase == "cos" else torch.sin(argument))


def test_power_spectrum_of_a_plane_wave():
    n, box, amplitude = 16, 100.0, 0.3
    field = _plane_wave(n, box, (0, 2, 0), amplitude)
    result = power_spectrum(field, box)
    k_fundamental = 2 * math.pi / box
    # default bins: shells of width k_f centred on multiples of k_f, up to Nyquist
    assert result.k.numel() == 7
    # Every mode of the shell |n| in [1.5, 2.5) is counted; only the 2 modes (0, +-2, 0)
    # carry power, each |DFT|^2 = (A N^3 / 2)^2, and P = V/N^6 * sum / modes.
    shell = int(torch.argmin((result.k - 2 * k_fundamental).abs()))
    n_vectors = np.stack(np.meshgrid(*[np.fft.fftfreq(n, 1 / n)] * 3, indexing="ij"), -1)
    norm = np.linalg.norm(n_vectors, axis=-1)
    in_shell = (norm >= 1.5) & (norm < 2.5)
    assert float(result.modes[shell]) == in_shell.sum()
    assert float(result.k[shell]) == pytest.approx(norm[in_shell].mean() * k_fundamental)
    expected = box**3 / n**6 * 2 * (amplitude * n**3 / 2) ** 2 / in_shell.sum()
    assert float(result.power[shell]) == pytest.approx(expected, rel=1e-12)
    others = torch.cat([result.power[:shell], result.power[shell + 1 :]])
    assert float(others.abs().max()) < 1e-12 * expected
    # total number of modes below the last edge is what the shells hold
    assert float(result.modes.sum()) == ((norm >= 0.5) & (norm < 7.5)).sum()


def test_cross_power_r_and_transfer():
    n, box = 16, 50.0
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(n, n, n, generator=generator, dtype=torch.float64)
    b = torch.randn(n, n, n, generator=generator, dtype=torch.float64)
    r_same = correlation_coefficient(a, 3 * a, box)
    torch.testing.assert_close(r_same.power, torch.ones_like(r_same.power))
    r_opposite = correlation_coefficient(a, -a, box)
    torch.testing.assert_close(r_opposite.power, -torch.ones_like(r_opposite.power))
    torch.testing.assert_close(transfer_function(2 * a, a, box).power, torch.full_like(r_same.power, 2.0))
    # cos and sin of the same mode are 90 degrees apart: zero cross power
    cosine = _plane_wave(n, box, (1, 0, 0))
    sine = _plane_wave(n, box, (1, 0, 0), phase="sin")
    assert float(cross_power(cosine, sine, box).power.abs().max()) < 1e-12
    # independent noise: |r| small (about 1/sqrt(modes))
    r_independent = correlation_coefficient(a, b, box)
    assert float((r_independent.power.abs() * r_independent.modes.sqrt()).max()) < 5


def test_power_spectrum_options():
    n, box = 8, 80.0
    field = _plane_wave(n, box, (1, 0, 0))
    plain = power_spectrum(field, box)
    compensated = power_spectrum(field, box, compensate_cic=True)
    window = np.sinc(1 / n) ** 2  # CIC window of the (1, 0, 0) mode, sinc(w/2pi)^2
    assert float(compensated.power[0]) == pytest.approx(float(plain.power[0]) / window**2)
    shot = power_spectrum(field, box, n_particles=512)
    torch.testing.assert_close(shot.power, plain.power - box**3 / 512)
    batched = power_spectrum(torch.stack([field, 2 * field]), box)
    torch.testing.assert_close(batched.power[1], 4 * plain.power)
    custom = power_spectrum(field, box, bins=[0.05, 0.1, 0.2])
    assert custom.power.shape == (2,)
    with pytest.raises(ValueError, match="`field` must be a real tensor"):
        power_spectrum(torch.zeros(8, 8), box)
    with pytest.raises(ValueError, match="NaN"):
        power_spectrum(torch.full((8, 8, 8), float("nan")), box)
    with pytest.raises(ValueError, match="box_size"):
        power_spectrum(field, -1.0)


def test_ratios_to_a_field_without_power_raise_and_errors_name_the_argument():
    # r(k) and T(k) divide by an auto power: where it is zero they were NaN or Inf, passed
    # on silently. And power_spectrum's own argument is `field` (it said `field_a`).
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(2, 8, 8, 8, generator=generator, dtype=torch.float64)
    constant = torch.full_like(a, 1.5)
    with pytest.raises(ValueError, match=r"correlation_coefficient: `field_b` has no power in 6 of 6 bins"):
        correlation_coefficient(a, constant, 100.0)
    with pytest.raises(ValueError, match=r"correlation_coefficient: `field_a` has no power"):
        correlation_coefficient(constant, a, 100.0)
    with pytest.raises(ValueError, match=r"transfer_function: `reference` has no power"):
        transfer_function(a, constant, 100.0)
    assert torch.isfinite(transfer_function(constant, a, 100.0).power).all()  # zero T(k) is defined
    bad = a.clone()
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^`field` contains NaN"):
        power_spectrum(bad, 100.0)
    with pytest.raises(ValueError, match=r"^`reference` contains NaN"):
        transfer_function(a, bad, 100.0)
    with pytest.raises(ValueError, match=r"^`field_b` contains NaN"):
        cross_power(a, bad, 100.0)


def test_empty_fields_are_refused_by_name():
    """A batch of no field, or an axis of no cell, gets an error naming the argument (the
    FFT library's "Inconsistent configuration" before)."""
    from torchpm.analysis import correlation_function

    for shape in ((0, 8, 8, 8), (8, 0, 8), (1, 8, 8, 0)):
        empty = torch.zeros(shape, dtype=torch.float64)
        for call in (lambda: power_spectrum(empty, 100.0), lambda: correlation_function(empty, 100.0),
                     lambda: cross_power(empty, empty, 100.0)):
            with pytest.raises(ValueError, match=r"at least one batch member and one cell per axis, got shape"):
                call()
