"""Redshift space and the Legendre multipoles of the power spectrum.

Oracles: a brute-force numpy estimator over the full complex DFT (no rfft half-spectrum,
no torchpm code), plane waves whose multipoles follow from L_ell(+-1) and L_ell(0) by
hand, astropy's E(a) for the redshift-space shift, and Kaiser's linear mapping mode by
mode for Zel'dovich particles painted with TSC (the paint's linear response derived by
hand below), with the growth rate from astropy.
"""

import math

import numpy as np
import pytest
import torch

import torchpm
from torchpm.analysis import (
    cross_multipoles,
    transfer_function,
    paint_density,
    power_multipoles,
    power_spectrum,
    redshift_space,
)

LEGENDRE = {
    0: lambda mu: np.ones_like(mu),
    2: lambda mu: (3 * mu**2 - 1) / 2,
    4: lambda mu: (35 * mu**4 - 30 * mu**2 + 3) / 8,
    6: lambda mu: (231 * mu**6 - 315 * mu**4 + 105 * mu**2 - 5) / 16,
}


def _numpy_multipoles(field_a, field_b, box, edges, ells, axis, weight=None):
    """(B, len(ells), bins) by looping over every mode of the full DFT; ``weight`` (per mode)
    divides the power (e.g. a window squared)."""
    a = np.fft.fftn(field_a, axes=(-3, -2, -1))
    b = np.fft.fftn(field_b, axes=(-3, -2, -1))
    shape = field_a.shape[-3:]
    k_axes = np.meshgrid(*[2 * np.pi * np.fft.fftfreq(n, d=L / n) for n, L in zip(shape, box)], indexing="ij")
    k = np.sqrt(sum(ki**2 for ki in k_axes))
    mu = np.where(k > 0, k_axes[axis] / np.where(k > 0, k, 1.0), 0.0)
    power = (a * np.conj(b)).real * np.prod(box) / np.prod(shape) ** 2
    if weight is not None:
        power = power / weight
    index = np.searchsorted(edges, k, side="right") - 1
    result = np.zeros((field_a.shape[0], len(ells), len(edges) - 1))
    for i in range(len(edges) - 1):
        in_bin = (index == i) & (k > 0)
        for j, ell in enumerate(ells):
            result[:, j, i] = ((2 * ell + 1) * power[:, in_bin] * LEGENDRE[ell](mu[in_bin])).mean(axis=1)
    return result


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_multipoles_match_a_numpy_estimator_over_the_full_dft(axis):
    shape, box = (10, 8, 6), (50.0, 40.0, 30.0)
    generator = torch.Generator().manual_seed(axis)
    a = torch.randn(2, *shape, generator=generator, dtype=torch.float64)
    b = a + 0.5 * torch.randn(2, *shape, generator=generator, dtype=torch.float64)
    edges = [0.1, 0.2, 0.3, 0.45, 0.6, 0.9]
    ells = (0, 2, 4, 6)
    got = power_multipoles(a, box, ells=ells, axis="xyz"[axis], bins=edges)
    expected = _numpy_multipoles(a.numpy(), a.numpy(), box, np.array(edges), ells, axis)
    assert got.ells == ells and got.power.shape == (2, 4, 5)
    np.testing.assert_allclose(got.power.numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())
    cross = cross_multipoles(a, b, box, ells=ells, axis=axis, bins=edges)
    expected = _numpy_multipoles(a.numpy(), b.numpy(), box, np.array(edges), ells, axis)
    np.testing.assert_allclose(cross.power.numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())
    # The TSC window divides the power by W^2 mode by mode.
    w = np.meshgrid(*[2 * np.pi * np.fft.fftfreq(n) for n in shape], indexing="ij")
    window = np.prod([np.sinc(wi / (2 * np.pi)) ** 3 for wi in w], axis=0) ** 2
    got = power_multipoles(a[0], box, ells=(0, 2), axis=axis, bins=edges, window="tsc")
    expected = _numpy_multipoles(a.numpy()[:1], a.numpy()[:1], box, np.array(edges), (0, 2), axis, window)[0]
    assert got.power.shape == (2, 5)
    np.testing.assert_allclose(got.power.numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())


def test_monopole_is_the_power_spectrum_and_shot_noise_is_the_monopoles_alone():
    field = torch.randn(2, 12, 12, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    box = 100.0
    spectrum = power_spectrum(field, box, window="cic", n_particles=1000)
    multipoles = power_multipoles(field, box, ells=(2, 0), window="cic", n_particles=1000)
    assert torch.equal(multipoles.k, spectrum.k) and torch.equal(multipoles.modes, spectrum.modes)
    torch.testing.assert_close(multipoles.power[:, 1], spectrum.power, rtol=1e-13, atol=0)
    plain = power_multipoles(field, box, ells=(2, 0), window="cic")
    torch.testing.assert_close(plain.power[:, 1] - multipoles.power[:, 1],
                               torch.full_like(plain.power[:, 1], box**3 / 1000), rtol=1e-12, atol=0)
    assert torch.equal(plain.power[:, 0], multipoles.power[:, 0]), "the quadrupole lost shot noise"
    same = cross_multipoles(field, field.clone(), box, ells=(2, 0), window="cic")
    torch.testing.assert_close(same.power, plain.power, rtol=1e-13, atol=0)


def test_plane_waves_have_the_hand_computed_multipoles():
    """A wave along the line of sight has mu = +-1, so P_ell = (2 ell + 1) P; one across it has
    mu = 0: P_2 = 5 L_2(0) P = -5/2 P and P_4 = 9 L_4(0) P = 27/8 P."""
    n, box = 16, 64.0
    z = torch.arange(n, dtype=torch.float64) * (box / n)
    wave = torch.cos(2 * math.pi * 3 * z / box)
    along_z = wave.view(1, 1, n).expand(n, n, n).contiguous()
    along_x = wave.view(n, 1, 1).expand(n, n, n).contiguous()
    for field, expected in ((along_z, [1.0, 5.0, 9.0]), (along_x, [1.0, -2.5, 27 / 8])):
        p = power_spectrum(field, box).power
        m = power_multipoles(field, box, axis=2).power
        (peak,) = torch.nonzero(p > 1e-9 * p.max()).flatten().tolist()
        torch.testing.assert_close(m[:, peak], p[peak] * torch.tensor(expected, dtype=torch.float64), rtol=1e-12,
                                   atol=0)
        assert float(m.abs().sum() - m[:, peak].abs().sum()) < 1e-9 * float(p[peak]), "power outside the wave's bin"


def _growth_rate(params, a):
    """f = Omega_m(a)^0.55 with astropy's Omega_m(a): at a = 0.002 Omega_m(a) = 1 - 1e-8, where
    the index's error is of order (1 - Omega_m(a)) (colossus's spline derivative of D is
    off by 4e-3 at z = 499)."""
    astropy_cosmology = pytest.importorskip("astropy.cosmology")
    om = params["Omega_c"] + params["Omega_b"]
    return float(astropy_cosmology.LambdaCDM(H0=100 * params["h"], Om0=om, Ode0=1 - om, Tcmb0=0).Om(1 / a - 1)) ** 0.55


def test_zeldovich_particles_in_redshift_space_follow_kaiser_mode_by_mode():
    """Zel'dovich particles at a tiny amplitude painted with TSC: at linear order the painted
    overdensity is delta(k) = -i sum_j s_j Psi_j(k) prod_{i != j} S_i with s = sin(w) and
    S = 3/4 + cos(w)/4 (TSC's node weights 1/8, 3/4, 1/8 and slopes -+1/2 at +-1 cell), and
    redshift space adds f Psi_axis along the axis. With Psi = -i k delta_L / k^2 the
    redshift-space field is the real-space one times R(k) = 1 + f A_axis / sum_j A_j,
    A_j = s_j w_j prod_{i != j} S_i (Kaiser's 1 + f mu^2 at small w). The expected
    multipoles (2 ell + 1) <|delta_r|^2 R^2 L_ell(mu)> use the real-space field measured
    here, the growth rate from astropy's Omega_m(a); terms of second order in the displacement
    (~ D) remain: 2e-4 of P_0 at a = 0.002."""
    params = dict(Omega_c=0.2589, Omega_b=0.0486, h=0.6774, n_s=0.9667, sigma8=0.8159)
    n, box, a, axis = 32, 1024.0, 0.002, 1
    f = _growth_rate(params, a)
    sim = torchpm.Simulation(n_particles=n, box_size=box, mesh_factor=1, a_start=a, steps=0, lpt_order=1,
                             gradient="exact", cosmology=torchpm.Cosmology(**params), dtype=torch.float64)
    state = sim(sim.white_noise(1, seed=3), return_mesh_units=True)
    moved = sim.redshift_space(state, axis="y")
    assert isinstance(moved, torchpm.MeshUnitsState) and moved.momenta is state.momenta
    real = paint_density(state.positions, sim.force_mesh, order="tsc")[0].numpy()
    redshift = paint_density(moved.positions, sim.force_mesh, order="tsc")
    edges = (2 * math.pi / box) * (np.arange(14) + 0.5)
    got = power_multipoles(redshift, box, bins=torch.tensor(edges), axis=axis).power[0].numpy()

    w = np.meshgrid(*[2 * np.pi * np.fft.fftfreq(n)] * 3, indexing="ij")
    smooth = [0.75 + 0.25 * np.cos(wi) for wi in w]
    slopes = [np.sin(w[j]) * w[j] * np.prod([smooth[i] for i in range(3) if i != j], axis=0) for j in range(3)]
    total = sum(slopes)
    ratio = 1 + f * slopes[axis] / np.where(total > 0, total, 1.0)
    delta = np.fft.fftn(real)
    k = np.sqrt(sum(wi**2 for wi in w)) * n / box
    mu = np.where(k > 0, w[axis] * n / box / np.where(k > 0, k, 1.0), 0.0)
    power = np.abs(delta) ** 2 * box**3 / n**6 * ratio**2
    index = np.searchsorted(edges, k, side="right") - 1
    expected = np.array([[((2 * ell + 1) * power * LEGENDRE[ell](mu))[(index == i) & (k > 0)].mean()
                          for i in range(len(edges) - 1)] for ell in (0, 2, 4)])
    error = np.abs(got - expected) / expected[0]
    assert error.max() < 1e-3, error.max(axis=1)
    # Kaiser's factors on average over the shells (f ~ 1 at a = 0.002): P_2 / P_0 near
    # (4f/3 + 4f^2/7) / (1 + 2f/3 + f^2/5) in the lowest shells (cosmic variance aside)
    kaiser = (4 * f / 3 + 4 * f**2 / 7) / (1 + 2 * f / 3 + f**2 / 5)
    assert abs(float(np.median(got[1, 2:8] / got[0, 2:8])) / kaiser - 1) < 0.1


def test_redshift_space_shift_matches_astropy_and_wraps_into_the_box():
    astropy_cosmology = pytest.importorskip("astropy.cosmology")
    params = dict(Omega_c=0.25, Omega_b=0.05, h=0.7, n_s=0.96, sigma8=0.8, Omega_k=0.03, w0=-0.9, wa=0.2)
    cosmology = torchpm.Cosmology(**params)
    reference = astropy_cosmology.w0waCDM(H0=70.0, Om0=0.3, Ode0=0.67, w0=-0.9, wa=0.2, Tcmb0=0)
    a, box = 0.5, (100.0, 80.0, 60.0)
    positions = torch.tensor([[[10.0, 20.0, 30.0], [99.0, 79.5, 59.0], [1.0, 0.5, 0.25]]], dtype=torch.float64)
    momenta = torch.tensor([[[3.0, -2.0, 1.0], [4.0, 4.0, 4.0], [-5.0, -5.0, -5.0]]], dtype=torch.float64)
    shift = momenta / (a**2 * reference.efunc(1 / a - 1))  # p / (a^2 E): v / (a H) in Mpc/h
    for axis in range(3):
        moved = redshift_space(positions, momenta, a, cosmology, box, axis=axis)
        expected = positions.clone()
        expected[..., axis] = torch.remainder(positions[..., axis] + shift[..., axis], box[axis])
        torch.testing.assert_close(moved, expected, rtol=0, atol=1e-12)
        unwrapped = redshift_space(positions, momenta, torch.tensor(a), cosmology, None, axis=axis)
        expected[..., axis] = positions[..., axis] + shift[..., axis]
        torch.testing.assert_close(unwrapped, expected, rtol=0, atol=1e-12)
    assert bool(((moved >= 0) & (moved < torch.tensor(box, dtype=torch.float64))).all())


def test_simulation_redshift_space_is_the_same_in_both_units():
    sim = torchpm.Simulation(n_particles=8, box_size=(64.0, 48.0, 32.0), mesh_factor=2, a_start=0.2, steps=2,
                             dtype=torch.float64)
    noise = sim.white_noise(2, seed=1)
    physical, cells = sim(noise), sim(noise, return_mesh_units=True)
    for axis in (0, 2):
        moved_physical = sim.redshift_space(physical, axis=axis)
        moved_cells = sim.redshift_space(cells, axis=axis)
        assert type(moved_physical) is torchpm.SimulationState and type(moved_cells) is torchpm.MeshUnitsState
        in_mpc = moved_cells.positions * torch.tensor(sim.cell_size, dtype=torch.float64)
        difference = in_mpc - moved_physical.positions
        box = torch.tensor(sim.box_size, dtype=torch.float64)
        difference = difference - box * torch.round(difference / box)
        assert float(difference.abs().max()) < 1e-10
        # the density of the moved state: mass conserved, another field than real space
        density = sim.density(moved_cells)
        torch.testing.assert_close(density.mean(dim=(1, 2, 3)), torch.ones(2, dtype=torch.float64))
        assert float((density - sim.density(cells)).abs().max()) > 1e-3
    with pytest.raises(TypeError, match="`state` must be a SimulationState"):
        sim.redshift_space(physical.positions)


def test_multipoles_and_redshift_space_are_differentiable():
    field = torch.randn(1, 6, 5, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64,
                       requires_grad=True)
    assert torch.autograd.gradcheck(lambda f: power_multipoles(f, (30.0, 25.0, 20.0), axis=1, bins=3,
                                                               window="cic").power, (field,))
    other = torch.randn(1, 6, 5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64,
                       requires_grad=True)
    assert torch.autograd.gradcheck(lambda f, g: cross_multipoles(f, g, 30.0, ells=(0, 2)).power, (field, other))
    positions = (torch.rand(1, 5, 3, dtype=torch.float64) * 10).requires_grad_()
    momenta = torch.randn(1, 5, 3, dtype=torch.float64, requires_grad=True)
    omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, p, o: redshift_space(x, p, 0.5, torchpm.Planck15(Omega_c=o), None, axis=2), (positions, momenta, omega_c))
    # the multipoles of a simulation's redshift-space density, through the run
    sim = torchpm.Simulation(n_particles=4, box_size=40.0, mesh_factor=1, a_start=0.3, steps=1, dtype=torch.float64)
    noise = sim.white_noise(1, seed=0).requires_grad_()
    loss = lambda x: power_multipoles(sim.density(sim.redshift_space(sim(x))) - 1, 40.0, ells=(2,)).power.sum()  # noqa: E731
    assert torch.autograd.gradcheck(loss, (noise,))


def test_the_layer_measures_the_multipoles():
    from torchpm.nn import PowerSpectrum

    shape, box = (10, 8, 6), (50.0, 40.0, 30.0)
    a = torch.randn(2, *shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    b = torch.randn(2, *shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for axis in ("x", 2):
        layer = PowerSpectrum(shape, box, ells=(0, 2, 4), axis=axis, compensate_cic=True, dtype=torch.float64)
        expected = power_multipoles(a, box, axis=axis, window="cic")
        torch.testing.assert_close(layer(a), expected.power, rtol=1e-12, atol=0)
        torch.testing.assert_close(layer.k, expected.k, rtol=1e-14, atol=0)
        torch.testing.assert_close(layer(a, b), cross_multipoles(a, b, box, axis=axis, window="cic").power,
                                   rtol=1e-12, atol=1e-12)
    assert "ells=(0, 2, 4)" in repr(layer)
    with pytest.raises(ValueError, match="`ells`"):
        PowerSpectrum(shape, box, ells=(1,))


@pytest.mark.parametrize("ells", [(1,), (0, 3), (-2,), (0, 0), (), (True,), ("2",), 2.0])
def test_bad_ells_are_refused(ells):
    with pytest.raises(ValueError, match="`ells` must be distinct even integers"):
        power_multipoles(torch.randn(4, 4, 4), 10.0, ells=ells)


def test_bad_arguments_name_themselves():
    field = torch.randn(4, 4, 4)
    with pytest.raises(ValueError, match="`axis`"):
        power_multipoles(field, 10.0, axis=3)
    with pytest.raises(ValueError, match="`axis`"):
        cross_multipoles(field, field, 10.0, axis="w")
    with pytest.raises(ValueError, match="`field_a` and `field_b` must have the same shape"):
        cross_multipoles(field, torch.randn(4, 4, 5), 10.0)
    with pytest.raises(ValueError, match="`field` contains NaN"):
        power_multipoles(torch.full((4, 4, 4), float("nan")), 10.0)
    with pytest.raises(ValueError, match="at most one of `shot_noise` and `n_particles`"):
        power_multipoles(field, 10.0, shot_noise=1.0, n_particles=8)
    x, p = torch.rand(1, 3, 3), torch.rand(1, 3, 3)
    with pytest.raises(ValueError, match="`axis`"):
        redshift_space(x, p, 0.5, torchpm.Planck15(), 1.0, axis=True)
    with pytest.raises(ValueError, match="`momenta` of shape"):
        redshift_space(x, p[:, :2], 0.5, torchpm.Planck15(), 1.0)
    with pytest.raises(ValueError, match="`positions` must be a real floating-point tensor"):
        redshift_space(x[..., :2], p, 0.5, torchpm.Planck15(), 1.0)
    with pytest.raises(ValueError, match="`a` must be a scale factor"):
        redshift_space(x, p, 0.0, torchpm.Planck15(), 1.0)
    with pytest.raises(TypeError, match="`cosmology` must be a torchpm.Cosmology"):
        redshift_space(x, p, 0.5, "Planck15", 1.0)
    with pytest.raises(ValueError, match="`box_size`"):
        redshift_space(x, p, 0.5, torchpm.Planck15(), -1.0)


def test_binning_in_chunks_of_planes_equals_one_pass(monkeypatch):
    """The shells are summed a few x planes at a time (torchpm.analysis._BIN_CHUNK entries);
    forced down to 2 planes per chunk, every spectrum equals the one-pass result."""
    import torchpm.analysis as analysis

    box = (50.0, 40.0, 30.0)
    a = torch.randn(2, 10, 8, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    b = torch.randn(2, 10, 8, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    calls = {
        "power": lambda: analysis.power_spectrum(a, box, window="tsc", bins=5).power,
        "multipoles": lambda: analysis.power_multipoles(a, box, axis=0, n_particles=100).power,
        "r": lambda: analysis.correlation_coefficient(a, b, box).power,
        "transfer": lambda: analysis.transfer_function(a, b[0], box, bins=[0.1, 0.3, 0.5]).power,
    }
    whole = {name: call() for name, call in calls.items()}
    monkeypatch.setattr(analysis, "_BIN_CHUNK", 2 * 8 * 4)  # 2 planes of the (10, 8, 4) half-spectrum
    for name, call in calls.items():
        torch.testing.assert_close(call(), whole[name], rtol=1e-12, atol=1e-12 * float(whole[name].abs().max()),
                                   msg=name)


def test_transfer_function_takes_a_batch_against_one_reference_and_shot_noise():
    box = 40.0
    fields = torch.randn(3, 8, 8, 8, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    reference = torch.randn(8, 8, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = transfer_function(fields, reference, box, n_particles=4096)
    expected = torch.sqrt(power_spectrum(fields, box, n_particles=4096).power
                          / power_spectrum(reference, box, n_particles=4096).power)
    assert got.power.shape == (3, expected.shape[-1])
    torch.testing.assert_close(got.power, expected, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="same mesh"):
        transfer_function(fields, torch.randn(8, 8, 6), box)
    with pytest.raises(ValueError, match="`reference` contains NaN"):
        transfer_function(fields, torch.full((8, 8, 8), float("nan")), box)


def test_the_multipole_layer_compiles_into_one_graph():
    from torchpm.nn import PowerSpectrum

    layer = PowerSpectrum((12, 10, 8), (60.0, 50.0, 40.0), ells=(0, 2, 4), axis="y", compensate_cic=True)
    field = torch.randn(2, 12, 10, 8, generator=torch.Generator().manual_seed(10), requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    got, expected = compiled(field), layer(field)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    (grad,) = torch.autograd.grad(got[:, 1].sum(), field)
    (expected_grad,) = torch.autograd.grad(expected[:, 1].sum(), field)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5 * float(expected_grad.abs().max()))
