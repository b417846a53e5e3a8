"""The halo mass function: counting a catalogue (torchpm.halos.mass_function) by hand, and
the fits of the literature (mass_function_theory) against colossus's implementation of
each (an independent code: its own power spectrum integration and sigma(M))."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torchpm
from torchpm.halos import HaloCatalog, MASS_FUNCTION_MODELS, mass_function, mass_function_theory

PLANCK15 = dict(Omega_c=0.2589, Omega_b=0.0486, h=0.6774, n_s=0.9667, sigma8=0.8159)


def test_counts_by_hand():
    masses = torch.tensor([[1e13, 2e13, 5e13, 0.0], [3e13, 2.9e13, 0.0, 0.0]], dtype=torch.float64)
    edges = [1e13, 3e13, 1e14]
    result = mass_function(masses, 100.0, bins=edges)
    np.testing.assert_array_equal(result.counts.numpy(), [[2, 1], [1, 1]])  # (1e13 is in [1e13, 3e13))
    widths = np.log([3.0, 1e14 / 3e13])
    np.testing.assert_allclose(result.dn_dlnM.numpy(), result.counts.numpy() / (1e6 * widths), rtol=1e-14)
    np.testing.assert_allclose(result.error.numpy(), np.sqrt(result.counts.numpy()) / (1e6 * widths), rtol=1e-14)
    np.testing.assert_allclose(result.mass.numpy(), [math.sqrt(3e26), math.sqrt(3e27)], rtol=1e-14)
    # One member, a catalogue, a non-cubic box; the default bins: five per decade from the smallest halo.
    catalog = HaloCatalog(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), masses[:1],
                          torch.zeros(1, 4, 3), None)
    default = mass_function(catalog, (50.0, 40.0, 50.0))
    np.testing.assert_allclose(default.edges.numpy(), 1e13 * 10 ** (np.arange(5) / 5), rtol=1e-12)
    np.testing.assert_array_equal(default.counts.numpy(), [[1, 1, 0, 1]])
    assert default.dn_dlnM.shape == (1, 4)
    # A number of bins spans at least 0.2 dex from the smallest halo: [2.9e13, 2.9e13 * 10^0.2].
    single = mass_function(masses[1], 100.0, bins=2)
    assert single.counts.tolist() == [2.0, 0.0] and single.dn_dlnM.shape == (2,)
    np.testing.assert_allclose(single.edges.numpy(), 2.9e13 * 10 ** np.array([0.0, 0.1, 0.2]), rtol=1e-12)
    # 10^log10(m) can round above m (here 2e11): the smallest halo still counts, as does the largest.
    for low in (2e11, 20 * 6.827e11, 7.3e12):
        assert mass_function(torch.tensor([low, low * 1.05], dtype=torch.float64), 100.0).counts.sum() == 2
        assert mass_function(torch.tensor([low, low * 3], dtype=torch.float64), 100.0, bins=3).counts.sum() == 2


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="`masses`"):
        mass_function(torch.tensor([1e13, -1.0]), 100.0)
    with pytest.raises(ValueError, match="`masses`"):
        mass_function([1e13], 100.0)
    with pytest.raises(ValueError, match="no halo"):
        mass_function(torch.zeros(3, dtype=torch.float64), 100.0)
    for bins in (0, [1e13], [2e13, 1e13], [0.0, 1e13], "many"):
        with pytest.raises(ValueError, match="`bins`"):
            mass_function(torch.tensor([1e13], dtype=torch.float64), 100.0, bins=bins)
    cosmology = torchpm.Cosmology(**PLANCK15)
    with pytest.raises(ValueError, match="`model`"):
        mass_function_theory([1e13], cosmology, model="tinker")
    with pytest.raises(ValueError, match="`mass`"):
        mass_function_theory([0.0], cosmology)
    with pytest.raises(ValueError, match="`mass` must hold at least one mass"):
        mass_function_theory([], cosmology)
    with pytest.raises(ValueError, match="`a`"):
        mass_function_theory([1e13], cosmology, a=0.0)
    with pytest.raises(ValueError, match="one finite value per wavenumber"):
        mass_function_theory([1e13], cosmology, power=lambda k: k * float("nan"))


@pytest.mark.parametrize("model", sorted(MASS_FUNCTION_MODELS))
@pytest.mark.parametrize("a", [1.0, 0.5])
def test_theory_matches_colossus(model, a):
    cosmology_module = pytest.importorskip("colossus.cosmology.cosmology")
    mass_function_module = pytest.importorskip("colossus.lss.mass_function")
    cosmology_module.setCosmology("torchpm-mass-function", params=dict(
        flat=True, H0=100 * PLANCK15["h"], Om0=PLANCK15["Omega_c"] + PLANCK15["Omega_b"], Ob0=PLANCK15["Omega_b"],
        sigma8=PLANCK15["sigma8"], ns=PLANCK15["n_s"], relspecies=False, Tcmb0=2.7255))
    masses = np.logspace(11, 15.5, 19)
    ours = mass_function_theory(torch.from_numpy(masses), torchpm.Cosmology(**PLANCK15), a, model=model).numpy()
    reference = mass_function_module.massFunction(masses, 1 / a - 1, mdef="fof", model=model, q_out="dndlnM")
    # In the exponential tail a relative difference of sigma is multiplied by (delta_c / sigma)^2.
    below = masses <= 3e14
    np.testing.assert_allclose(ours[below], reference[below], rtol=6e-3)
    np.testing.assert_allclose(ours[~below], reference[~below], rtol=6e-2)


def test_small_spheres_integrate_further_in_k():
    """Below about 1e9 Msun/h (R < 0.2 Mpc/h) sigma(R) needs k past 100 h/Mpc: the grid
    extends to 300 / R, so 1e6 Msun/h matches an integral to 1e4 h/Mpc done here (numpy:
    its own top hat and trapezoid rule in ln k, the spectrum from `linear_power`)."""
    from torchpm.cosmology import linear_power

    cosmology = torchpm.Cosmology(**PLANCK15)
    k = np.logspace(-5, 4, 2 * 9 * 600 * 8 + 1)
    power = linear_power(torch.from_numpy(k), cosmology).numpy()
    rho = 27.7536627e10 * float(cosmology.Omega_m)

    def sigma(m):
        x = k * (3 * m / (4 * math.pi * rho)) ** (1 / 3)
        integrand = k**3 * power * (3 * (np.sin(x) - x * np.cos(x)) / x**3) ** 2
        return math.sqrt(float(np.sum((integrand[1:] + integrand[:-1]) * np.diff(np.log(k)))) / 2 / (2 * math.pi**2))

    m = 1e6
    slope = (math.log(sigma(m * 1.001)) - math.log(sigma(m / 1.001))) / (2 * math.log(1.001))
    expected = 0.282 * ((1.406 / sigma(m)) ** 2.163 + 1) * math.exp(-1.210 / sigma(m) ** 2) * rho / m * abs(slope)
    np.testing.assert_allclose(float(mass_function_theory([m], cosmology)[0]), expected, rtol=2e-3)


def test_theory_is_differentiable_in_the_cosmology():
    sigma8 = torch.tensor(0.8159, dtype=torch.float64, requires_grad=True)
    masses = torch.tensor([1e13, 1e14, 1e15], dtype=torch.float64)

    def n(value):
        return mass_function_theory(masses, torchpm.Cosmology(**dict(PLANCK15, sigma8=value)), 0.8)

    (gradient,) = torch.autograd.grad(n(sigma8).log().sum(), sigma8)
    step = 1e-5
    expected = (n(torch.tensor(0.8159 + step, dtype=torch.float64)).log().sum()
                - n(torch.tensor(0.8159 - step, dtype=torch.float64)).log().sum()) / (2 * step)
    assert float(gradient) > 0  # more massive halos with a larger amplitude
    np.testing.assert_allclose(float(gradient), float(expected), rtol=1e-6)
