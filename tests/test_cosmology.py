"""Background, growth and linear power against independent codes and exact identities.

Independent references: astropy (E(a)), colossus (D1, f1, Eisenstein & Hu T(k) and the
sigma8-normalised P(k)), and scipy's adaptive ODE solver on the growth equations written
in ``a`` (D2, f2), none of which share code with torchpm.
"""

import math

import numpy as np
import pytest
import torch

import torchpm
from torchpm.cosmology import (
    PowerTable,
    eisenstein_hu_transfer,
    growth_table,
    linear_power,
    sigma_r,
)

A_VALUES = np.array([0.02, 0.05, 0.1, 0.25, 0.5, 0.8, 1.0])
COSMOLOGIES = {
    "planck15": dict(Omega_c=0.2589, Omega_b=0.0486, h=0.6774, n_s=0.9667, sigma8=0.8159),
    "w0wa_curved": dict(Omega_c=0.25, Omega_b=0.05, h=0.7, n_s=0.96, sigma8=0.8, Omega_k=0.03, w0=-0.9, wa=0.2),
}


@pytest.mark.parametrize("name", sorted(COSMOLOGIES))
def test_E_matches_astropy(name):
    astropy_cosmology = pytest.importorskip("astropy.cosmology")
    params = COSMOLOGIES[name]
    cosmology = torchpm.Cosmology(**params)
    om = params["Omega_c"] + params["Omega_b"]
    ok = params.get("Omega_k", 0.0)
    # Tcmb0 = 0: no radiation, as in the FastPM background.
    reference = astropy_cosmology.w0waCDM(
        H0=100 * params["h"], Om0=om, Ode0=1 - om - ok, w0=params.get("w0", -1.0), wa=params.get("wa", 0.0), Tcmb0=0
    )
    ours = cosmology.E(A_VALUES).numpy()
    np.testing.assert_allclose(ours, reference.efunc(1 / A_VALUES - 1), rtol=1e-6)
    np.testing.assert_allclose(cosmology.Omega_m_a(A_VALUES).numpy(), reference.Om(1 / A_VALUES - 1), rtol=1e-6)


def _colossus(params):
    colossus = pytest.importorskip("colossus.cosmology.cosmology")
    return colossus.setCosmology(
        "torchpm-test",
        params=dict(
            flat=True, H0=100 * params["h"], Om0=params["Omega_c"] + params["Omega_b"], Ob0=params["Omega_b"],
            sigma8=params["sigma8"], ns=params["n_s"], relspecies=False, Tcmb0=2.7255,
        ),
    )


def test_D1_f1_match_colossus():
    params = COSMOLOGIES["planck15"]
    reference = _colossus(params)
    z = 1 / A_VALUES - 1
    D = reference.growthFactor(z)
    # f = dlnD/dlna = -(1 + z) dlnD/dz
    f = -(1 + z) * reference.growthFactor(z, derivative=1) / D
    growth = torchpm.Cosmology(**params).growth(A_VALUES)
    np.testing.assert_allclose(growth.D1.numpy(), D, rtol=1e-4)
    # colossus's derivative comes from a spline of D(z), good to a few 1e-4.
    np.testing.assert_allclose(growth.f1.numpy(), f, rtol=1e-3)


def _scipy_growth(params, a_values):
    """D1, D2, f1, f2 from scipy's solve_ivp on the ODEs in `a` (DESIGN.md form)."""
    integrate = pytest.importorskip("scipy.integrate")
    om, ok = params["Omega_c"] + params["Omega_b"], params.get("Omega_k", 0.0)
    w0, wa = params.get("w0", -1.0), params.get("wa", 0.0)
    ode = 1 - om - ok

    def e2(a):
        return om * a**-3 + ok * a**-2 + ode * a ** (-3 * (1 + w0 + wa)) * math.exp(3 * wa * (a - 1))

    def dlne_dlna(a, step=1e-6):
        return (math.log(e2(a * (1 + step))) - math.log(e2(a * (1 - step)))) / (4 * step)

    def rhs(a, y):
        d1, v1, d2, v2 = y
        q = (3 + dlne_dlna(a)) / a
        r = 1.5 * om * a**-3 / e2(a) / a**2
        return [v1, -q * v1 + r * d1, v2, -q * v2 + r * (d2 - d1 * d1)]

    a0 = 1e-4
    solution = integrate.solve_ivp(
        rhs, (a0, 1.0), [a0, 1.0, -3 / 7 * a0**2, -6 / 7 * a0], t_eval=a_values,
        rtol=1e-11, atol=1e-15, method="DOP853",
    )
    d1, v1, d2, v2 = solution.y
    a = solution.t
    assert a[-1] == 1.0
    return d1 / d1[-1], d2 / d2[-1], a * v1 / d1, a * v2 / d2


@pytest.mark.parametrize("name", sorted(COSMOLOGIES))
def test_growth_matches_scipy_integration(name):
    params = COSMOLOGIES[name]
    D1, D2, f1, f2 = _scipy_growth(params, A_VALUES)
    growth = torchpm.Cosmology(**params).growth(A_VALUES)
    errors = {
        key: float(np.max(np.abs(getattr(growth, key).numpy() / value - 1)))
        for key, value in dict(D1=D1, D2=D2, f1=f1, f2=f2).items()
    }
    print(f"growth vs scipy ({name}): max relative errors {errors}")
    # ~1e-10 for the table; up to ~3e-8 here is this reference's own start at a = 1e-4
    # (curvature excites a decaying mode). tests/test_precision.py holds the 1e-8 bound.
    assert max(errors.values()) < 1e-7, errors


def test_fastpm_time_functions_are_consistent():
    cosmology = torchpm.Planck15()
    a = torch.tensor([0.1, 0.3, 0.7], dtype=torch.float64)
    g = cosmology.growth(a)
    step = 1e-5
    # Differences of a finer table, so the table's own interpolation error stays small.
    fine = growth_table(cosmology, steps=2048)
    plus, minus = fine.at(a * (1 + step)), fine.at(a * (1 - step))
    # gp = dD1/da and gf = dGf/da by central differences of D1 and Gf.
    torch.testing.assert_close(g.gp, (plus.D1 - minus.D1) / (2 * step * a), rtol=1e-8, atol=0)
    torch.testing.assert_close(g.gf, (plus.Gf - minus.Gf) / (2 * step * a), rtol=1e-8, atol=0)
    torch.testing.assert_close(g.Gf, a**3 * g.E * g.gp)
    # Matter domination: D2 -> D1^2 (both normalised at a=1 though), f1 -> 1, f2 -> 2.
    early = cosmology.growth(torch.tensor([2e-3], dtype=torch.float64))
    assert abs(float(early.f1) - 1) < 1e-3 and abs(float(early.f2) - 2) < 2e-3


def test_growth_is_differentiable_in_omega_c():
    omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)

    def d1(oc):
        return torchpm.Planck15(Omega_c=oc).growth(torch.tensor(0.2, dtype=torch.float64)).D1

    (grad,) = torch.autograd.grad(d1(omega_c), omega_c)
    h = 1e-5
    numeric = (d1(torch.tensor(0.26 + h, dtype=torch.float64)) - d1(torch.tensor(0.26 - h, dtype=torch.float64))) / (2 * h)
    assert abs(float(grad) - float(numeric)) < 1e-6 * max(1.0, abs(float(numeric)))
    assert float(grad) != 0.0


@pytest.mark.parametrize("wiggles,model", [(True, "eisenstein98"), (False, "eisenstein98_zb")])
def test_eisenstein_hu_matches_colossus(wiggles, model):
    params = COSMOLOGIES["planck15"]
    reference = _colossus(params)
    power_spectrum = pytest.importorskip("colossus.cosmology.power_spectrum")
    k = np.logspace(-4, 1.5, 300)
    om = params["Omega_c"] + params["Omega_b"]
    model_function = power_spectrum.modelEisenstein98 if wiggles else power_spectrum.modelEisenstein98ZeroBaryon
    transfer = model_function(k, params["h"], om, params["Omega_b"], 2.7255)
    cosmology = torchpm.Cosmology(**params)
    ours_t = eisenstein_hu_transfer(torch.tensor(k), cosmology, wiggles=wiggles).numpy()
    ours_p = linear_power(torch.tensor(k), cosmology, wiggles=wiggles).numpy()
    reference_p = reference.matterPowerSpectrum(k, z=0, model=model)
    t_error = np.max(np.abs(ours_t / transfer - 1))
    p_error = np.max(np.abs(ours_p / reference_p - 1))
    print(f"EH {model}: max rel. error T(k) {t_error:.2e}, P(k) {p_error:.2e}")
    assert t_error < 1e-5
    assert p_error < 5e-3


def test_sigma8_normalisation_and_gradient():
    sigma8 = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    cosmology = torchpm.Planck15(sigma8=sigma8)
    measured = sigma_r(lambda k: linear_power(k, cosmology), 8.0)
    assert abs(float(measured.detach()) - 0.8) < 1e-10
    # The normalisation sets the amplitude with sigma_r itself: integrate sigma_8^2 =
    # int k^3 P(k) W(kR)^2 dln k / (2 pi^2) independently (numpy, trapezoid in ln k).
    k_grid = np.logspace(-6, 4, 200_001)
    x = k_grid * 8.0
    window = 3 * (np.sin(x) - x * np.cos(x)) / x**3
    p_grid = linear_power(torch.from_numpy(k_grid), cosmology).detach().numpy()
    integrand = k_grid**3 * p_grid * window**2 / (2 * np.pi**2)
    ln_k = np.log(k_grid)
    independent = math.sqrt(float(np.sum((integrand[1:] + integrand[:-1]) * np.diff(ln_k)) / 2))
    assert abs(independent - 0.8) < 1e-6, independent
    k = torch.tensor([0.01, 0.1, 1.0], dtype=torch.float64)
    power = linear_power(k, cosmology)
    (grad,) = torch.autograd.grad(power.sum(), sigma8)
    # P is proportional to sigma8^2: dP/dsigma8 = 2 P / sigma8.
    total = float(power.detach().sum())
    assert abs(float(grad) - 2 * total / 0.8) < 1e-9 * total


def test_presets():
    p15, p18 = torchpm.Planck15(), torchpm.Planck18()
    assert float(p15.Omega_c) == pytest.approx(0.2589) and float(p15.sigma8) == pytest.approx(0.8159)
    assert float(p18.Omega_m) == pytest.approx(0.3111, abs=2e-3) and float(p18.h) == pytest.approx(0.6766)
    assert float(torchpm.Planck15(sigma8=0.9).sigma8) == pytest.approx(0.9)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(Omega_c=-0.1), "Omega_c"),
        (dict(h=0.0), "`h`"),
        (dict(sigma8=float("nan")), "sigma8"),
        (dict(Omega_c=0.9, Omega_b=0.2), "dark-energy"),
        (dict(n_s=torch.ones(2)), "n_s"),
    ],
)
def test_bad_cosmology_raises(overrides, match):
    with pytest.raises(ValueError, match=match):
        torchpm.Planck15(**overrides)


@pytest.mark.parametrize("omega_c,omega_b", [(0.8, 0.2), (0.9514, 0.0486), (0.95, 0.05)])
def test_einstein_de_sitter_is_accepted_whatever_the_rounding(omega_c, omega_b):
    # 1 - 0.8 - 0.2 is -5.6e-17 in floating point: no dark energy, not a negative one.
    cosmology = torchpm.Cosmology(Omega_c=omega_c, Omega_b=omega_b, h=0.7, n_s=1.0, sigma8=0.8)
    a = torch.tensor([0.1, 0.5], dtype=torch.float64)
    growth = cosmology.growth(a)
    np.testing.assert_allclose(growth.D1.numpy(), a.numpy(), rtol=1e-9)  # D1 = a, D2 = a^2 exactly
    np.testing.assert_allclose(growth.D2.numpy(), a.numpy() ** 2, rtol=1e-9)
    assert float(growth.D2_norm) == pytest.approx(3.0 / 7.0, rel=1e-9)
    table = dict(Omega_c=omega_c, Omega_b=omega_b, h=0.7, n_s=1.0, sigma8=0.8)
    assert torchpm.config._check_cosmology("cosmology", table) == table  # the CLI's check agrees


def test_recollapsing_closed_universe_is_refused():
    # Omega_k = -1.2 with Omega_m = 0.3075: E(a)^2 < 0 around a = 0.46, so E, Gf, gf
    # were NaN and the simulation failed later in the paint with non-finite positions.
    with pytest.raises(ValueError, match=r"E\(a\)\^2 .* not positive at a = 0\.4"):
        torchpm.Planck15(Omega_k=-1.2)
    # A closed universe that expands throughout is fine.
    assert bool(torch.isfinite(torchpm.Planck15(Omega_k=-0.3).growth(torch.tensor([0.3, 1.0])).gf).all())


def test_eisenstein_hu_without_baryons():
    # Omega_b = 0 is a valid Cosmology; the BAO fit is undefined there (colossus refuses it
    # too) and returned NaN for every k, which a Simulation reported only as NaN "power
    # spectrum values". The no-wiggle fit matches colossus's eisenstein98_zb at Omega_b = 0.
    cosmology = torchpm.Cosmology(Omega_c=0.3, Omega_b=0.0, h=0.7, n_s=0.96, sigma8=0.8)
    k = torch.tensor([0.01, 0.1, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="`Omega_b` > 0.*wiggles=False"):
        eisenstein_hu_transfer(k, cosmology, wiggles=True)
    with pytest.raises(ValueError, match="`power_spectrum` 'eisenstein_hu'.*`Omega_b` > 0, got 0.0"):  # when built
        torchpm.Simulation(8, 64.0, steps=1, cosmology=cosmology)
    simulation = torchpm.Simulation(8, 64.0, steps=1)
    simulation.cosmology = cosmology  # (a cosmology set later: at the linear field)
    with pytest.raises(ValueError, match="Omega_b"):
        simulation.linear_field(torch.zeros(1, 8, 8, 8))
    torchpm.Simulation(8, 64.0, steps=1, cosmology=cosmology, power_spectrum="eisenstein_hu_nowiggle")
    no_wiggle = eisenstein_hu_transfer(k, cosmology, wiggles=False)
    power_spectrum = pytest.importorskip("colossus.cosmology.power_spectrum")
    expected = power_spectrum.modelEisenstein98ZeroBaryon(k.numpy(), 0.7, 0.3, 0.0, 2.7255)
    np.testing.assert_allclose(no_wiggle.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("name,canonical,wiggles", [
    ("eisenstein_hu", "eisenstein_hu", True), ("eh", "eisenstein_hu", True),
    ("eisenstein_hu_wiggles", "eisenstein_hu", True),
    ("eisenstein_hu_nowiggle", "eisenstein_hu_nowiggle", False), ("eh_nowiggle", "eisenstein_hu_nowiggle", False),
])
def test_builtin_spectrum_names(name, canonical, wiggles):
    """Each name of a built-in spectrum gives that spectrum, and the name the ranks compare."""
    from torchpm.cosmology import builtin_power_name, resolve_power

    cosmology = torchpm.Planck15()
    k = torch.logspace(-3, 0, 7, dtype=torch.float64)
    assert builtin_power_name(name) == canonical
    assert torch.equal(resolve_power(name)(k, cosmology), linear_power(k, cosmology, wiggles=wiggles))
    assert builtin_power_name("my_table.txt") == "my_table.txt"


def test_power_table_round_trip(tmp_path):
    cosmology = torchpm.Planck15()
    k = np.logspace(-4, 1, 2000)
    p = linear_power(torch.tensor(k), cosmology).numpy()
    path = tmp_path / "pk.txt"
    np.savetxt(path, np.column_stack([k, p]), header="k [h/Mpc]  P [(Mpc/h)^3]")
    table = PowerTable(path)
    k_test = torch.tensor([2e-3, 0.05, 0.3, 2.0], dtype=torch.float64)
    # log-log interpolation on a 400-per-decade grid: well below 1e-4.
    torch.testing.assert_close(table(k_test), linear_power(k_test, cosmology), rtol=1e-4, atol=0)
    # a simulation accepts it and reproduces the analytic linear field
    noise = torch.randn(1, 8, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sims = [
        torchpm.Simulation(8, 64.0, steps=0, power_spectrum=spectrum, dtype=torch.float64)
        for spectrum in (str(path), "eisenstein_hu")
    ]
    from_table, analytic = sims[0].linear_field(noise), sims[1].linear_field(noise)
    assert float((from_table - analytic).abs().max()) < 2e-4 * float(analytic.abs().max())


@pytest.mark.parametrize(
    "content,match",
    [
        ("0.1 1.0 3.0\n0.2 2.0 1.0\n", "2 columns"),
        ("0.1 abc\n0.2 2.0\n", "not two numbers"),
        ("0.2 1.0\n0.1 2.0\n", "increasing"),
        ("0.1 -1.0\n0.2 2.0\n", "positive"),
        ("# k P\n0.1 1.0\n\n0.2 2.0\n0.2 3.0\n", r"line 5: k must be strictly increasing, got 0.2 after 0.2"),
        ("0.1 1.0\n0.2 0\n", r"line 2: k and P must be finite and positive, got 0.2 0.0"),
        ("0.1 1.0\nnan 2.0\n", r"line 2: k and P must be finite"),
        ("0.1 1.0\n", "at least 2 rows"),
    ],
)
def test_power_table_malformed(tmp_path, content, match):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        PowerTable(path)


def test_power_table_files_as_editors_and_mistakes_leave_them(tmp_path):
    # a byte-order mark before line 1 (as some editors write) is not part of the table
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbf0.1 1.0\n0.2 2.0\n")
    assert PowerTable(path).k_range == (0.1, 0.2)
    binary = tmp_path / "binary.dat"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ValueError, match="not a UTF-8 text table"):
        PowerTable(binary)
    with pytest.raises(ValueError, match="cannot be read"):
        PowerTable(tmp_path)  # a directory


def test_power_table_must_cover_the_mesh(tmp_path):
    path = tmp_path / "short.txt"
    np.savetxt(path, np.column_stack([[0.01, 0.1], [1e4, 1e3]]))
    # 64 Mpc/h box with 8 particles: k from 0.098 to 0.68 h/Mpc, beyond the table.
    with pytest.raises(ValueError, match="covers k in"):
        torchpm.Simulation(8, 64.0, steps=0, power_spectrum=str(path))
    with pytest.raises(ValueError, match="not found"):
        PowerTable(tmp_path / "missing.txt")


def test_growth_table_range_error():
    table = growth_table(torchpm.Planck15(), a_min=0.05)
    with pytest.raises(ValueError, match="outside the table"):
        table.at(torch.tensor([0.01], dtype=torch.float64))


def test_parameters_are_the_callers_tensors():
    """A 0-d float64 parameter is kept as given, so its gradient can be read from the
    Cosmology too; others are converted (a float32 or 1-element tensor, a number)."""
    omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)
    cosmology = torchpm.Planck15(Omega_c=omega_c, h=torch.tensor([0.7], dtype=torch.float32))
    assert cosmology.Omega_c is omega_c
    assert cosmology.h.shape == () and cosmology.h.dtype == torch.float64
    cosmology.Omega_c.sum().backward()  # (any function of the parameter)
    assert cosmology.Omega_c.grad is omega_c.grad and float(omega_c.grad) == 1.0


def test_vmap_over_parameters_is_refused_by_name_and_func_derivatives_work():
    """vmap over a parameter gets an error naming it (not torch's data-dependent control
    flow error); torch.func.grad and jacrev over the parameters equal central
    differences."""
    a = torch.tensor(0.5, dtype=torch.float64)

    def expansion(omega_c):
        return torchpm.Planck15(Omega_c=omega_c).E(a)

    values = torch.tensor([0.25, 0.3], dtype=torch.float64)
    for transform in (torch.func.vmap(expansion), torch.func.vmap(torch.func.grad(expansion))):
        with pytest.raises(NotImplementedError, match="`Omega_c` is batched by torch.func.vmap"):
            transform(values)

    def both(omega_c):
        cosmology = torchpm.Planck15(Omega_c=omega_c)
        return torch.stack([cosmology.E(a), cosmology.growth_factor(a)])

    eps = 1e-6
    central = (both(values[0] + eps) - both(values[0] - eps)) / (2 * eps)
    torch.testing.assert_close(torch.func.grad(expansion)(values[0]), central[0], rtol=1e-7, atol=0)
    torch.testing.assert_close(torch.func.jacrev(both)(values[0]), central, rtol=1e-6, atol=0)
