"""Float64 promises of the background, the growth table and the LPT kernels.

Oracles: exact float64 values of Python numbers, finite differences, scipy's adaptive
DOP853 solver on the growth ODEs written independently here (rtol 1e-12, started deep
in matter domination), the closed form of EdS growth, and numpy FFTs of hand-written
Fourier multipliers (a full complex transform, not torch's real one).
"""

import copy
import math

import numpy as np
import pytest
import torch

import torchpm
from torchpm.cosmology import growth_table
from torchpm.fourier import FourierKernels
from torchpm.ic import lpt_displacements, lpt_initial_state
from torchpm.mesh import LocalMesh

COSMOLOGIES = {
    "planck15": dict(Omega_c=0.2589, Omega_b=0.0486, h=0.6774, n_s=0.9667, sigma8=0.8159),
    "closed_w0wa": dict(Omega_c=0.25, Omega_b=0.05, h=0.7, n_s=0.96, sigma8=0.8, Omega_k=0.03, w0=-0.9, wa=0.2),
    "open_phantom": dict(Omega_c=0.25, Omega_b=0.05, h=0.7, n_s=0.96, sigma8=0.8, Omega_k=-0.05, w0=-1.1, wa=-0.3),
    "low_matter": dict(Omega_c=0.12, Omega_b=0.03, h=0.7, n_s=0.96, sigma8=0.8, Omega_k=0.1, w0=-0.8, wa=-0.5),
}
QUANTITIES = ("D1", "D2", "f1", "f2", "gp", "Gf", "gf")


# --- float64 parameters ----------------------------------------------------------------


def test_python_float_parameters_are_not_rounded():
    # Regression: torch.tensor(float(x)) without a dtype went through float32
    # (Omega_c was 0.258899986743927).
    assert torchpm.Planck15().Omega_c.item() == 0.2589
    h = 0.6766
    assert torchpm.Planck18().Omega_c.item() == 0.11933 / h**2
    values = dict(Omega_c=0.1234567890123, Omega_b=0.0456789012345, h=0.6789012345678, n_s=0.9612345678901,
                  sigma8=0.8123456789012, Omega_k=0.0123456789012, w0=-0.9876543210987, wa=0.1234567890123)
    cosmology = torchpm.Cosmology(**values)
    for key, value in values.items():
        tensor = getattr(cosmology, key)
        assert tensor.dtype == torch.float64, key
        assert tensor.item() == value, key
    assert torchpm.Cosmology(**{**values, "h": 1}).h.dtype == torch.float64  # an int too


def _autograd_and_difference(function, x0=0.2589, step=1e-7):
    x = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
    (exact,) = torch.autograd.grad(function(x), x)
    # Python floats on purpose: they are what a float32 round trip would spoil.
    numeric = (function(x0 + step) - function(x0 - step)) / (2 * step)
    return float(exact), float(numeric.detach())


@pytest.mark.parametrize("which", ["E", "D1", "f2", "Gf"])
def test_finite_difference_in_omega_c_matches_autograd(which):
    a = torch.tensor([0.05, 0.3, 0.77], dtype=torch.float64)
    weights = torch.tensor([0.3, -1.1, 0.7], dtype=torch.float64)

    def function(omega_c):
        cosmology = torchpm.Planck15(Omega_c=omega_c)
        values = cosmology.E(a) if which == "E" else getattr(cosmology.growth(a), which)
        return (weights * values).sum()

    exact, numeric = _autograd_and_difference(function)
    # float64 rounding over a 1e-7 step is ~1e-9 of the value; float32 parameters gave 4%.
    assert exact != 0.0
    assert abs(exact - numeric) <= 1e-6 * abs(exact), (exact, numeric)


# --- growth table ----------------------------------------------------------------------


def _raw_growth(params, a_eval, a_start=1e-6):
    """Unnormalised D1, F1, D2, F2 (F = dD/dlna) at ``a_eval`` and at a = 1, from scipy.

    The ODEs of DESIGN.md in ln a, with dlnE/dlna written analytically here, started
    at ``a_start`` with the matter-dominated D1 = a, D2 = -3/7 a^2: a decaying mode that
    start excites is down by (a_start/a)^(5/2) (below 1e-12 for a >= 1e-4).
    """
    integrate = pytest.importorskip("scipy.integrate")
    om, ok = params["Omega_c"] + params["Omega_b"], params.get("Omega_k", 0.0)
    w0, wa = params.get("w0", -1.0), params.get("wa", 0.0)
    ode = 1.0 - om - ok

    def rhs(t, y):
        a = math.exp(t)
        de = ode * a ** (-3 * (1 + w0 + wa)) * math.exp(3 * wa * (a - 1))
        e2 = om * a**-3 + ok * a**-2 + de
        dlne = 0.5 * (-3 * om * a**-3 - 2 * ok * a**-2 + de * (-3 * (1 + w0 + wa) + 3 * wa * a)) / e2
        damping, source = 2 + dlne, 1.5 * om * a**-3 / e2
        d1, f1, d2, f2 = y
        return [f1, -damping * f1 + source * d1, f2, -damping * f2 + source * (d2 - d1 * d1)]

    times = np.unique(np.append(np.log(a_eval), 0.0))
    y0 = [a_start, a_start, -3 / 7 * a_start**2, -6 / 7 * a_start**2]
    solution = integrate.solve_ivp(
        rhs, (math.log(a_start), 0.0), y0, t_eval=times, rtol=1e-12, atol=1e-30, method="DOP853"
    )
    assert solution.success and solution.t[-1] == 0.0
    return np.exp(solution.t), solution.y


def _reference_growth(params, a_eval):
    a, (d1, f1, d2, f2) = _raw_growth(params, a_eval)
    om, ok = params["Omega_c"] + params["Omega_b"], params.get("Omega_k", 0.0)
    w0, wa = params.get("w0", -1.0), params.get("wa", 0.0)
    E = np.sqrt(om * a**-3 + ok * a**-2 + (1 - om - ok) * a ** (-3 * (1 + w0 + wa)) * np.exp(3 * wa * (a - 1)))
    D1, F1, D2, F2 = d1 / d1[-1], f1 / d1[-1], d2 / d2[-1], f2 / d2[-1]
    gp = F1 / a
    values = dict(D1=D1, D2=D2, f1=F1 / D1, f2=F2 / D2, gp=gp, Gf=a**3 * E * gp, gf=1.5 * om * D1 / (a**2 * E))
    return a, values


@pytest.mark.parametrize("name", sorted(COSMOLOGIES))
@pytest.mark.parametrize("a_min", [1e-3, 0.05])
def test_growth_table_matches_tight_ode_solution(name, a_min):
    params = COSMOLOGIES[name]
    table = growth_table(torchpm.Cosmology(**params), a_min=a_min)
    nodes = table.log_a.exp().numpy()
    rng = np.random.default_rng(3)
    # arbitrary a, the nodes, the midpoints between nodes (farthest from the data), the ends
    a_eval = np.concatenate([
        np.exp(rng.uniform(math.log(a_min), 0.0, 200)), nodes[::7], np.sqrt(nodes[1::5] * nodes[:-1:5]), [a_min, 1.0]
    ])
    a, reference = _reference_growth(params, a_eval)
    ours = table.at(torch.tensor(a))
    errors = {key: float(np.max(np.abs(getattr(ours, key).numpy() / value - 1))) for key, value in reference.items()}
    print(f"growth table vs DOP853 rtol 1e-12 ({name}, a_min {a_min}): {errors}")
    assert max(errors.values()) <= 1e-8, errors


@pytest.mark.parametrize("name", ["planck15", "open_phantom"])
def test_kick_and_drift_factors_match_the_ode(name):
    # The FastPM factors difference Gf and D1 between nearby a (the previous table gave
    # them to ~1e-4); here from the scipy solution at the nodes and half steps.
    from torchpm.pm import step_factors

    params = COSMOLOGIES[name]
    a = np.linspace(0.1, 1.0, 11)
    half = np.sqrt(a[:-1] * a[1:])
    points, reference = _reference_growth(params, np.concatenate([a, half]))
    position = {float(x): i for i, x in enumerate(points)}

    def ref(key, x):
        return np.array([reference[key][position[float(np.exp(np.log(v)))]] for v in x])

    cosmology = torchpm.Cosmology(**params)

    def E(x):
        return cosmology.E(torch.tensor(x)).numpy()

    expected = dict(
        first_kick=(ref("Gf", half) - ref("Gf", a[:-1])) / (a[:-1] ** 2 * E(a[:-1]) * ref("gf", a[:-1])),
        drift=(ref("D1", a[1:]) - ref("D1", a[:-1])) / (half**3 * E(half) * ref("gp", half)),
        second_kick=(ref("Gf", a[1:]) - ref("Gf", half)) / (a[1:] ** 2 * E(a[1:]) * ref("gf", a[1:])),
    )
    factors = step_factors(growth_table(cosmology), torch.tensor(a))
    for key, value in expected.items():
        ours = np.array([float(getattr(f, key)) for f in factors])
        error = float(np.max(np.abs(ours / value - 1)))
        assert error <= 1e-8, (key, error)


def test_growth_table_convergence_is_what_makes_it_accurate():
    # A coarse table must be measurably worse: the comparison above can fail.
    params = COSMOLOGIES["planck15"]
    a, reference = _reference_growth(params, np.array([0.0123, 0.37, 0.81]))
    coarse = growth_table(torchpm.Cosmology(**params), steps=16).at(torch.tensor(a))
    assert float(np.max(np.abs(coarse.f1.numpy() / reference["f1"] - 1))) > 1e-8


def test_einstein_de_sitter_growth_is_exact():
    # Omega_m = 1: D1 = a, D2 = a^2 (normalised), f1 = 1, f2 = 2, D2_norm = 3/7 exactly.
    cosmology = torchpm.Cosmology(Omega_c=0.95, Omega_b=0.05, h=0.7, n_s=0.96, sigma8=0.8)
    a = torch.tensor([1.1e-3, 0.0377, 0.5, 0.9], dtype=torch.float64)
    growth = growth_table(cosmology).at(a)
    torch.testing.assert_close(growth.D1, a, rtol=1e-10, atol=0)
    torch.testing.assert_close(growth.D2, a**2, rtol=1e-10, atol=0)
    torch.testing.assert_close(growth.f2, torch.full_like(a, 2.0), rtol=1e-10, atol=0)
    assert abs(float(growth.D2_norm) - 3 / 7) < 1e-10


def test_growth_table_gradcheck_in_all_background_parameters():
    a = torch.tensor([0.02, 0.31, 0.97], dtype=torch.float64)

    def quantities(omega_c, omega_k, w0, wa):
        cosmology = torchpm.Cosmology(Omega_c=omega_c, Omega_b=0.05, h=0.7, n_s=0.96, sigma8=0.8,
                                      Omega_k=omega_k, w0=w0, wa=wa)
        g = growth_table(cosmology, a_min=0.01, steps=24).at(a)
        return torch.cat([g.D1, g.D2, g.f1, g.f2, g.Gf, g.gf, g.D2_norm.reshape(1)])

    inputs = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (0.25, 0.02, -0.95, 0.1)]
    assert torch.autograd.gradcheck(quantities, inputs)


def test_growth_table_rejects_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        growth_table(torchpm.Planck15(), steps=1)
    with pytest.raises(ValueError, match="steps"):
        growth_table(torchpm.Planck15(), steps=2.5)
    with pytest.raises(ValueError, match="w0 \\+ wa"):
        growth_table(torchpm.Planck15(w0=-0.5, wa=0.6))


# --- 2LPT normalisation ----------------------------------------------------------------


def _second_order_terms(normalisation, a_start=0.1):
    sims = {
        order: torchpm.Simulation(8, 64.0, steps=0, a_start=a_start, lpt_order=order,
                                  lpt_normalisation=normalisation, dtype=torch.float64)
        for order in (1, 2)
    }
    delta = sims[1].linear_field(sims[1].white_noise(seed=4))
    (x1, p1, ids1), (x2, p2, ids2) = (sims[order].lpt(delta) for order in (1, 2))
    assert torch.equal(ids1, ids2)
    return x2 - x1, p2 - p1


def test_lpt_normalisation_exact_against_the_growth_ode():
    # The 2LPT term of "exact" over that of "fastpm" is -D2(1)/D1(1)^2 / (3/7) of the
    # unnormalised ODE solutions (D2 ~ -3/7 D1^2 early), here from scipy.
    _, (d1, _, d2, _) = _raw_growth(COSMOLOGIES["planck15"], np.array([1.0]))
    expected = -d2[-1] / d1[-1] ** 2 / (3 / 7)
    assert 1.008 < expected < 1.009  # 0.85% for Planck15 (DESIGN.md)
    (x_fastpm, p_fastpm), (x_exact, p_exact) = (_second_order_terms(n) for n in ("fastpm", "exact"))
    assert float(x_fastpm.abs().max()) > 1e-4  # a real second-order term
    torch.testing.assert_close(x_exact, expected * x_fastpm, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(p_exact, expected * p_fastpm, rtol=1e-9, atol=1e-15)


def test_lpt_normalisation_fastpm_is_three_sevenths_D2():
    # The default is unchanged: 3/7 D2(a)/D2(1) Psi2 (the JaxPM comparison depends on it).
    cosmology = torchpm.Planck15()
    growth = growth_table(cosmology).at(torch.tensor(0.1, dtype=torch.float64))
    psi = torch.randn(1, 3, 2, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q = torch.zeros(8, 3, dtype=torch.float64)
    x1, _ = lpt_initial_state(psi, None, growth, q, (1.0, 1.0, 1.0))
    x2, _ = lpt_initial_state(psi, psi, growth, q, (1.0, 1.0, 1.0))
    torch.testing.assert_close(x2 - x1, 3 / 7 * growth.D2 * x1 / growth.D1, rtol=1e-12, atol=1e-15)


def test_lpt_second_order_from_real_space_stencils_equals_fourier_multipliers():
    # With "fd4" the 2LPT Hessian comes from the 4-point stencil applied to psi1 in real
    # space; the Fourier multipliers G_i G_j (six inverse transforms) are the same operator
    mesh = LocalMesh((8, 12, 10))
    kernels = FourierKernels(mesh, (2.0, 1.5, 3.0), dtype=torch.float64)
    assert kernels.real_space_gradient
    delta = torch.randn(2, 8, 12, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    psi1, psi2 = lpt_displacements(delta, kernels, 2)
    fourier = copy.copy(kernels)
    fourier.real_space_gradient = False
    expected1, expected2 = lpt_displacements(delta, fourier, 2)
    assert float(expected2.abs().max()) > 0.1
    torch.testing.assert_close(psi1, expected1, rtol=0, atol=1e-13)
    torch.testing.assert_close(psi2, expected2, rtol=0, atol=1e-13)


def test_lpt_initial_state_written_out():
    # x = q + (D1 Psi1 + 3/7 D2 Psi2) / cell, p = a^2 E (f1 D1 Psi1 + f2 3/7 D2 Psi2) / cell,
    # per component (unequal cells), per batch member, in the contiguous (B, N, 3) layout
    growth = growth_table(torchpm.Planck15()).at(torch.tensor(0.2, dtype=torch.float64))
    g = torch.Generator().manual_seed(1)
    psi1, psi2 = (torch.randn(2, 3, 2, 3, 4, dtype=torch.float64, generator=g) for _ in range(2))
    q = torch.rand(24, 3, dtype=torch.float64, generator=g) * 8
    cell = (1.5, 2.0, 4.0)
    x, p = lpt_initial_state(psi1, psi2, growth, q, cell)
    assert x.shape == p.shape == (2, 24, 3) and x.is_contiguous() and p.is_contiguous()
    D1, f1, f2, D2 = (float(v) for v in (growth.D1, growth.f1, growth.f2, 3 / 7 * growth.D2))
    factor = float(growth.a**2 * growth.E)
    for b in range(2):
        for n in range(24):
            for i in range(3):
                s1, s2 = float(psi1[b, i].flatten()[n]), float(psi2[b, i].flatten()[n])
                assert math.isclose(float(x[b, n, i]), float(q[n, i]) + (D1 * s1 + D2 * s2) / cell[i],
                                    rel_tol=1e-13, abs_tol=1e-13)
                assert math.isclose(float(p[b, n, i]), factor * (f1 * D1 * s1 + f2 * D2 * s2) / cell[i],
                                    rel_tol=1e-13, abs_tol=1e-13)


def test_lpt_normalisation_rejects_bad_values():
    with pytest.raises(ValueError, match="lpt_normalisation"):
        torchpm.Simulation(8, 64.0, lpt_normalisation="pmwd")
    with pytest.raises(ValueError, match="lpt_normalisation"):
        _second_order_terms(None)


# --- second derivatives at Nyquist -----------------------------------------------------


def _numpy_psi2(delta, cell, gradient, keep_nyquist=True):
    """2LPT displacement with full complex numpy FFTs and hand-written multipliers:
    ``phi_ij = IDFT[-H_ij / k^2 DFT(delta)]`` with ``H_ij`` the multiplier of ``d_i d_j``
    (``-k_i k_j``, Nyquist kept for ``i = j`` with "exact" unless ``keep_nyquist`` is
    False, which is the old product of Nyquist-zeroed gradients), then
    ``psi2_i = IDFT[i g_i / k^2 DFT(S)]``."""
    shape = delta.shape
    w = np.meshgrid(*[2 * np.pi * np.fft.fftfreq(n) for n in shape], indexing="ij")
    k = [wi / c for wi, c in zip(w, cell)]
    nyquist = [(np.abs(np.abs(wi) - np.pi) < 1e-9) & (n % 2 == 0) for wi, n in zip(w, shape)]
    if gradient == "exact":
        g = [np.where(ny, 0.0, ki) for ki, ny in zip(k, nyquist)]
        diagonal = [ki * ki for ki in k] if keep_nyquist else [gi * gi for gi in g]
    else:
        g = [(8 * np.sin(wi) - np.sin(2 * wi)) / 6 / c for wi, c in zip(w, cell)]
        diagonal = [gi * gi for gi in g]
    k2 = sum(ki * ki for ki in k)
    inverse = np.where(k2 > 0, 1 / np.where(k2 > 0, k2, 1), 0.0)
    delta_k = np.fft.fftn(delta)

    def phi(i, j):  # d_i d_j grad^-2 delta = (-k_i k_j)(-1/k^2) delta
        product = diagonal[i] if i == j else g[i] * g[j]
        return np.fft.ifftn(product * inverse * delta_k).real

    h = {(i, j): phi(i, j) for i in range(3) for j in range(i, 3)}
    source = sum(h[i, i] * h[j, j] - h[i, j] ** 2 for i, j in ((0, 1), (0, 2), (1, 2)))
    source_k = np.fft.fftn(source)
    # -d_i grad^-2 = -(i g_i)(-1/k^2)
    return np.stack([np.fft.ifftn(1j * gi * inverse * source_k).real for gi in g])


def _torch_psi2(delta, cell, gradient):
    mesh = LocalMesh(delta.shape)
    kernels = FourierKernels(mesh, cell, gradient=gradient, dtype=torch.float64)
    _, psi2 = lpt_displacements(torch.as_tensor(delta).unsqueeze(0), kernels, order=2)
    return psi2[0].numpy()


def test_exact_second_derivatives_keep_the_nyquist_plane_hand_case():
    # delta = A cos(pi i) + B cos(k1 j) (unit cells, n = 8): phi_xx = A cos(pi i) (the
    # Nyquist plane), phi_yy = B cos(k1 j), so S = AB cos(pi i) cos(k1 j) and
    # psi2_y = -AB k1 cos(pi i) sin(k1 j) / (pi^2 + k1^2); psi2_x = 0 (the first derivative
    # of the Nyquist mode is zero), psi2_z = 0. Dropping phi_xx's Nyquist plane gives 0.
    n, amplitude_a, amplitude_b = 8, 0.3, 0.7
    k1 = 2 * np.pi / n
    i, j, _ = np.meshgrid(*[np.arange(n)] * 3, indexing="ij")
    delta = amplitude_a * np.cos(np.pi * i) + amplitude_b * np.cos(k1 * j)
    psi2 = _torch_psi2(delta, (1.0, 1.0, 1.0), "exact")
    expected_y = -amplitude_a * amplitude_b * k1 * np.cos(np.pi * i) * np.sin(k1 * j) / (np.pi**2 + k1**2)
    np.testing.assert_allclose(psi2[1], expected_y, rtol=0, atol=1e-14)
    np.testing.assert_allclose(psi2[0], 0.0, atol=1e-14)
    np.testing.assert_allclose(psi2[2], 0.0, atol=1e-14)
    assert np.abs(expected_y).max() > 0.01


@pytest.mark.parametrize("gradient", ["exact", "fd4"])
@pytest.mark.parametrize("shape,cell", [((8, 6, 4), (1.0, 1.5, 1.25)), ((6, 5, 8), (2.0, 2.0, 2.0))])
def test_second_order_displacement_against_numpy(gradient, shape, cell):
    rng = np.random.default_rng(11)
    delta = rng.standard_normal(shape)  # white noise: power at every Nyquist plane
    expected = _numpy_psi2(delta, cell, gradient)
    ours = _torch_psi2(delta, cell, gradient)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-12 * np.abs(expected).max())
    if gradient == "exact":
        # The Nyquist planes matter: dropping them (the old kernels) is far outside the tolerance.
        dropped = _numpy_psi2(delta, cell, gradient, keep_nyquist=False)
        assert np.abs(dropped - expected).max() > 1e-3 * np.abs(expected).max()
