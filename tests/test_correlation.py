"""The two-point correlation function (torchpm.analysis.correlation_function and
cross_correlation) against the sum over every pair of cells, done here in numpy lag by
lag; its multipoles, window compensation and Poisson self-pairs; gradients; errors.
On a process grid: case_correlation in test_distributed_simulation.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from torchpm.analysis import (aliased_window_power, correlation_function, cross_correlation, paint_density,
                              power_spectrum)


def pair_sum(a, b, box, edges, ells=None, axis=2):
    """``(r, xi, lags)`` by the definition: for every lag vector ``d`` of the periodic mesh,
    the mean over the cells of ``(a - mean a)(x) (b - mean b)(x + d)``, binned by the length
    of ``d``'s minimum image (zero excluded); with ``ells``, weighted by ``(2l+1) L_l(mu)``."""
    a, b = (np.array(f.numpy() if isinstance(f, torch.Tensor) else f, dtype=np.float64) for f in (a, b))
    a, b = a - a.mean(), b - b.mean()
    shape = a.shape
    cell = [L / n for L, n in zip(box, shape)]
    n_bins = len(edges) - 1
    orders = [0] if ells is None else list(ells)
    sums, lags, r_sums = np.zeros((len(orders), n_bins)), np.zeros(n_bins), np.zeros(n_bins)
    for d in itertools.product(*(range(n) for n in shape)):
        vector = np.array([(di - n if di > n // 2 else di) * c for di, n, c in zip(d, shape, cell)])
        r = float(np.sqrt((vector**2).sum()))
        if r == 0:
            continue
        j = int(np.searchsorted(edges, r, side="right")) - 1
        if not 0 <= j < n_bins:
            continue
        value = float(np.mean(a * np.roll(b, tuple(-di for di in d), axis=(0, 1, 2))))
        mu = vector[axis] / r
        for i, ell in enumerate(orders):
            weight = 1.0 if ells is None else (2 * ell + 1) * np.polynomial.legendre.legval(mu, [0] * ell + [1])
            sums[i, j] += value * weight
        lags[j] += 1
        r_sums[j] += r
    keep = lags > 0
    xi = sums[:, keep] / lags[keep]
    return r_sums[keep] / lags[keep], (xi[0] if ells is None else xi), lags[keep]


def check(result, expected, tolerance=1e-12):
    r, xi, lags = expected
    np.testing.assert_array_equal(result.lags.numpy(), lags)
    np.testing.assert_allclose(result.r.numpy(), r, rtol=1e-14, atol=0)
    scale = max(np.abs(xi).max(), 1e-300)
    np.testing.assert_allclose(result.xi.detach().numpy(), xi, rtol=0, atol=tolerance * scale)


SHAPE, BOX = (6, 5, 8), (30.0, 27.5, 36.0)  # non-cubic cells and box, odd and even sides


def random_field(shape, seed, batch=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*((batch,) if batch else ()), *shape, generator=g, dtype=torch.float64) + 0.3


@pytest.mark.parametrize("bins", [None, 3, [0.0, 4.0, 6.1, 9.0, 12.0, 25.0]])
def test_auto_correlation_is_the_sum_over_cell_pairs(bins):
    field = random_field(SHAPE, 1)
    result = correlation_function(field, BOX, bins=bins)
    from torchpm.analysis import _lag_edges
    from torchpm.mesh import LocalMesh

    edges = _lag_edges(LocalMesh(SHAPE), BOX, bins, "cpu").numpy()
    if bins is None:  # shells one largest cell (5.5 Mpc/h) wide centred on its multiples, up to L_min / 2
        np.testing.assert_allclose(edges, [2.75, 8.25, 13.75], rtol=1e-15)
    elif isinstance(bins, int):
        np.testing.assert_allclose(edges, np.linspace(0, 13.75, 4), rtol=1e-11)
    check(result, pair_sum(field, field, BOX, edges))
    assert result.ells is None and result.xi.shape == result.r.shape


def test_cubic_mesh_default_shells_batched_and_cross():
    shape, box = (8, 8, 8), 40.0
    a, b = random_field(shape, 2, batch=2), random_field(shape, 3, batch=2)
    edges = 5.0 * (np.arange(4) + 0.5)  # 5 Mpc/h cells; shells up to L / 2 = 20
    auto = correlation_function(a, box)
    assert auto.xi.shape == (2, 3)
    cross = cross_correlation(a, b, box)
    for i in range(2):
        check(type(auto)(auto.r, auto.xi[i], auto.lags), pair_sum(a[i], a[i], (box,) * 3, edges))
        check(type(cross)(cross.r, cross.xi[i], cross.lags), pair_sum(a[i], b[i], (box,) * 3, edges))
    # The first shell, [2.5, 7.5) Mpc/h, holds the 6 offsets of one cell and the 12 of sqrt(2) cells.
    assert auto.lags.tolist()[0] == 18


@pytest.mark.parametrize("axis", [0, "z"])
def test_multipoles_are_the_legendre_weighted_pair_sums(axis):
    a, b = random_field(SHAPE, 4), random_field(SHAPE, 5)
    edges = np.array([0.0, 5.0, 8.0, 14.0])
    index = {"z": 2}.get(axis, axis)
    auto = correlation_function(a, BOX, bins=edges.tolist(), ells=(0, 2, 4), axis=axis)
    assert auto.ells == (0, 2, 4) and auto.xi.shape == (3, len(auto.r))
    check(auto, pair_sum(a, a, BOX, edges, ells=(0, 2, 4), axis=index))
    cross = cross_correlation(a, b, BOX, bins=edges.tolist(), ells=[2], axis=axis)
    check(cross, pair_sum(a, b, BOX, edges, ells=(2,), axis=index))
    # The monopole is the shell average.
    torch.testing.assert_close(auto.xi[0], correlation_function(a, BOX, bins=edges.tolist()).xi, rtol=1e-13,
                               atol=1e-15)


@pytest.mark.parametrize("window", ["cic", "tsc"])
def test_window_compensation_is_the_pair_sum_of_the_deconvolved_field(window):
    field = random_field(SHAPE, 6)
    w = np.meshgrid(*(2 * np.pi * np.fft.fftfreq(n) for n in SHAPE[:2]),
                    2 * np.pi * np.fft.rfftfreq(SHAPE[2]), indexing="ij")
    p = {"cic": 2, "tsc": 3}[window]
    W = np.prod([np.sinc(wi / (2 * np.pi)) ** p for wi in w], axis=0)
    deconvolved = np.fft.irfftn(np.fft.rfftn(field.numpy()) / W, s=SHAPE, axes=(0, 1, 2))
    edges = np.array([0.0, 6.0, 10.0, 13.75])
    check(correlation_function(field, BOX, bins=edges.tolist(), window=window),
          pair_sum(deconvolved, deconvolved, BOX, edges), tolerance=1e-11)
    check(correlation_function(field, BOX, bins=edges.tolist(), compensate_cic=True),
          pair_sum(*(np.fft.irfftn(np.fft.rfftn(field.numpy()) / np.prod(
              [np.sinc(wi / (2 * np.pi)) ** 2 for wi in w], axis=0), s=SHAPE, axes=(0, 1, 2)),) * 2, BOX, edges), tolerance=1e-11)


@pytest.mark.parametrize("order", ["ngp", "cic", "tsc", "pcs"])
def test_aliased_window_power_is_the_sum_over_images(order):
    p = {"ngp": 1, "cic": 2, "tsc": 3, "pcs": 4}[order]
    w = torch.linspace(-math.pi, math.pi, 13, dtype=torch.float64)
    images = np.arange(-200000, 200001) if p == 1 else np.arange(-20000, 20001)
    per_axis = (np.sinc((w.numpy()[:, None] + 2 * np.pi * images) / (2 * np.pi)) ** (2 * p)).sum(1)
    wx, wy, wz = w.view(-1, 1, 1), w[::2].view(1, -1, 1), w[::3].view(1, 1, -1)
    expected = per_axis[:, None, None] * per_axis[::2][None, :, None] * per_axis[::3][None, None, :]
    np.testing.assert_allclose(aliased_window_power((wx, wy, wz), order).numpy(), expected,
                               rtol=1e-5 if p == 1 else 1e-12)


@pytest.mark.parametrize("order", ["cic", "tsc"])
def test_poisson_self_pairs_subtracted(order):
    """Uniform random particles have xi = 0 at every separation: painted with a window wider
    than a cell, the first shells hold the particles' pairs with themselves unless
    n_particles removes them; the batch mean is then zero within its standard error."""
    shape, box, n, batch = (16, 16, 16), 64.0, 2048, 48
    g = torch.Generator().manual_seed(7)
    positions = torch.rand(batch, n, 3, generator=g, dtype=torch.float64) * 16
    delta = paint_density(positions, shape=shape, order=order)
    bins = [0.0, 4.5, 6.5, 8.5]  # 1, sqrt(2) and sqrt(3) cells; 2 cells
    raw = correlation_function(delta, box, bins=bins, window=order)
    clean = correlation_function(delta, box, bins=bins, window=order, n_particles=n)
    error = clean.xi.std(0) / math.sqrt(batch)
    assert bool((clean.xi.mean(0).abs() < 4 * error).all()), (clean.xi.mean(0), error)
    # Without it the self-pairs (divided by the window, as the power is) are many standard
    # errors away from zero at one cell.
    assert abs(float(raw.xi.mean(0)[0])) > 20 * float(error[0]), (raw.xi.mean(0), error)


@pytest.mark.parametrize("order", ["ngp", "cic", "tsc", "pcs"])
def test_self_pairs_of_one_particle_cancel_exactly(order):
    """One particle, averaged over its position in a cell: with ``n_particles=1`` the expected
    xi is zero at every separation (no other pair exists). The painted field is piecewise
    polynomial in the position, with breaks at whole and half cells, so Gauss-Legendre nodes
    on each half cell give the average exactly."""
    nodes, weights = np.polynomial.legendre.leggauss(5)
    points = np.concatenate([0.25 + 0.25 * nodes, 0.75 + 0.25 * nodes])
    weights = np.concatenate([weights, weights]) / 4  # (sum to 1 over the cell)
    g = torch.tensor(points)
    positions = torch.stack(torch.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 1, 3) + torch.tensor(
        [2.0, 3.0, 1.0], dtype=torch.float64)
    w = torch.tensor(weights)
    average = (w.view(-1, 1, 1) * w.view(1, -1, 1) * w.view(1, 1, -1)).reshape(-1)
    shape = (6, 7, 8)
    delta = paint_density(positions, shape=shape, order=order)
    bins = [0.0, 1.2, 1.6, 2.0, 3.0]
    clean = correlation_function(delta, (6.0, 7.0, 8.0), bins=bins, window=order, n_particles=1)
    np.testing.assert_allclose((average @ clean.xi).numpy(), 0.0, atol=1e-12)
    raw = correlation_function(delta, (6.0, 7.0, 8.0), bins=bins, window=order)
    assert float((average @ raw.xi).abs().max()) > 0.1  # what was subtracted
    # A count of particles: numpy's integers too, not 1.0 (as for the spectra).
    torch.testing.assert_close(correlation_function(delta, (6.0, 7.0, 8.0), bins=bins, window=order,
                                                    n_particles=np.int64(1)).xi, clean.xi, rtol=0, atol=0)


def test_shells_leave_out_axes_one_cell_thick():
    for shape, box, expected in (((16, 16, 1), (16.0, 16.0, 16.0), 1.0 * (np.arange(8) + 0.5)),
                                 ((6, 1, 5), (12.0, 3.0, 10.0), 2.0 * (np.arange(3) + 0.5))):
        from torchpm.analysis import _lag_edges
        from torchpm.mesh import LocalMesh

        edges = _lag_edges(LocalMesh(shape), box, None, "cpu").numpy()
        np.testing.assert_allclose(edges, expected, rtol=1e-15)
        field = random_field(shape, 12)
        check(correlation_function(field, box), pair_sum(field, field, box, edges))
    # An int number of shells ends just past half the box: the separation of half a box is kept.
    field = random_field((8, 8, 8), 13)
    result = correlation_function(field, 8.0, bins=2)
    assert int(result.lags.sum()) == int(pair_sum(field, field, (8.0,) * 3, [0.0, 2.0, 4.0 + 1e-9])[2].sum())


def test_gradients():
    shape, box = (4, 3, 6), (8.0, 6.0, 12.0)  # (an even last side: its Nyquist plane)
    a, b = random_field(shape, 8).requires_grad_(), random_field(shape, 9).requires_grad_()
    torch.autograd.gradcheck(lambda f: correlation_function(f, box, bins=2, window="cic").xi, (a,))
    torch.autograd.gradcheck(lambda f: correlation_function(f, box, ells=(0, 2), window="tsc", n_particles=50).xi,
                             (a,))
    torch.autograd.gradcheck(lambda f, g: cross_correlation(f, g, box, bins=2, ells=(0, 2)).xi, (a, b))
    # The shells do not depend on the field: only xi carries a gradient (and P(k) alone, not k).
    result, spectrum = correlation_function(a, box), power_spectrum(a, box)
    assert result.xi.requires_grad and spectrum.power.requires_grad
    assert not (result.r.requires_grad or result.lags.requires_grad or spectrum.k.requires_grad
                or spectrum.modes.requires_grad)


def test_errors_name_the_argument():
    field = random_field(SHAPE, 10)
    with pytest.raises(ValueError, match="`n_particles` needs `window=`"):
        correlation_function(field, BOX, n_particles=100)
    for bad in (0, -3, 1.0, 1.5, float("inf"), True, "10"):
        with pytest.raises(ValueError, match="`n_particles` must be a positive integer"):
            correlation_function(field, BOX, n_particles=bad, window="cic")
    # compensate_cic names the CIC window
    correlation_function(field, BOX, n_particles=100, compensate_cic=True)
    with pytest.raises(ValueError, match="`axis`"):
        correlation_function(field, BOX, axis=7)  # (checked without ells too)
    for bins in ([3.0, 1.0], [-1.0, 2.0], [1.0, float("nan")], 0, "many"):
        with pytest.raises(ValueError, match="`bins`"):
            correlation_function(field, BOX, bins=bins)
    with pytest.raises(ValueError, match="`ells`"):
        correlation_function(field, BOX, ells=(1,))
    with pytest.raises(ValueError, match="`axis`"):
        correlation_function(field, BOX, ells=(0,), axis=3)
    with pytest.raises(ValueError, match="same shape"):
        cross_correlation(field, random_field((6, 5, 7), 1), BOX)
    with pytest.raises(ValueError, match="NaN"):
        correlation_function(field.clone().fill_(float("nan")), BOX)
    with pytest.raises(ValueError, match="correlation_function.*window"):
        correlation_function(field, BOX, window="quadratic")


def test_linear_field_has_the_hankel_transform_of_its_power():
    """A fixed-amplitude linear field (|delta_k|^2 = P(k) V / N^2 mode by mode), smoothed by
    exp(-k^2 R^2 / 2), against ``xi(r) = 1/(2 pi^2) int k^2 P(k) exp(-k^2 R^2) j0(k r) dk`` of
    the linear power, integrated here with numpy: the normalisation of the linear field and of
    the estimator. The lattice's sum over modes differs from the integral by its discreteness
    (about 1% up to 110 Mpc/h in a 1 Gpc/h box)."""
    import torchpm
    from torchpm.cosmology import linear_power

    n, box, smoothing = 128, 1000.0, 15.0
    sim = torchpm.Simulation(n, box, steps=1, dtype=torch.float64)
    delta = sim.linear_field(sim.white_noise(seed=1, fixed_amplitude=True))[0]
    k = 2 * np.pi * np.fft.fftfreq(n, d=box / n)
    kz = 2 * np.pi * np.fft.rfftfreq(n, d=box / n)
    k2 = k[:, None, None] ** 2 + k[None, :, None] ** 2 + kz[None, None, :] ** 2
    smooth = np.fft.irfftn(np.fft.rfftn(delta.numpy()) * np.exp(-k2 * smoothing**2 / 2), s=(n,) * 3, axes=(0, 1, 2))
    xi = correlation_function(torch.from_numpy(smooth), box, bins=np.arange(20.0, 181.0, 7.8125).tolist())
    q = np.logspace(-5, 1, 400001)
    power = linear_power(torch.from_numpy(q), sim.cosmology).numpy() * np.exp(-q**2 * smoothing**2)
    expected = np.array([np.trapezoid(q**2 * power * np.sinc(q * r / np.pi), q) / (2 * np.pi**2)
                         for r in xi.r.numpy()])
    near = xi.r.numpy() < 110
    measured = xi.xi.numpy()
    assert np.all(np.abs(measured[near] - expected[near]) < 0.015 * np.abs(expected[near])), (measured, expected)
    assert np.all(np.abs(measured[~near] - expected[~near]) < 5e-4 * expected.max()), (measured, expected)
    assert expected[0] > 0.04 and expected[-1] < 0  # the range spans xi's zero crossing near 130 Mpc/h


def test_correlation_from_power_of_a_gaussian_spectrum():
    """P(k) = exp(-k^2 R^2) has xi(r) = exp(-r^2 / 4R^2) / (8 pi^(3/2) R^3) (by hand)."""
    from torchpm.analysis import correlation_from_power

    radius = 10.0
    r = torch.tensor([0.5, 5.0, 20.0, 40.0, 60.0], dtype=torch.float64)
    xi = correlation_from_power(r, lambda k: torch.exp(-(k * radius) ** 2))
    expected = torch.exp(-r**2 / (4 * radius**2)) / (8 * math.pi**1.5 * radius**3)
    torch.testing.assert_close(xi, expected, rtol=1e-6, atol=1e-9 * float(expected.max()))
    assert correlation_from_power(r.view(5, 1), lambda k: torch.exp(-(k * radius) ** 2)).shape == (5, 1)
    # The default points follow the largest separation (8 per period of j0 at k_max): at
    # 1000 Mpc/h the Gaussian's tail is still its closed form (to 1e-9 of the peak).
    far = torch.tensor([500.0, 1000.0], dtype=torch.float64)
    wide = correlation_from_power(far, lambda k: torch.exp(-(k * 2.0) ** 2) * 1e3)
    torch.testing.assert_close(wide, 1e3 * torch.exp(-far**2 / 16.0) / (8 * math.pi**1.5 * 8.0), rtol=0,
                               atol=1e-9 * 1e3 / (8 * math.pi**1.5 * 8.0))
    for bad, match in ((dict(r=[0.0, 1.0]), "`r`"), (dict(k_min=0.0), "`k_min`"), (dict(points=2), "`points`"),
                       (dict(power=3.0), "`power`"), (dict(k_min="1e-5"), "`k_min`"),
                       (dict(power=lambda k: k.sum()), "one finite value per wavenumber"),
                       (dict(power=lambda k: k.unsqueeze(-1)), "one finite value per wavenumber"),
                       (dict(power=lambda k: k * float("nan")), "NaN")):
        arguments = {"r": r, "power": lambda k: k, **bad}
        with pytest.raises((ValueError, TypeError), match=match):
            correlation_from_power(arguments.pop("r"), arguments.pop("power"), **arguments)
