"""Local primordial non-Gaussianity (``Cosmology.f_nl``) in the initial conditions.

Oracles: a transfer computed here independently of torchpm's (numpy FFTs, Eisenstein &
Hu's T(k), the matter-era growth from the Heath integral by scipy's quad), Planck's
published pairs of A_s and sigma8, exact identities (the field is linear in f_nl, f_nl =
0 is the Gaussian field bit for bit, a pair shares the f_nl term), finite differences for
the gradient in f_nl, and the autograd gradient for the adjoint's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torchpm
from torchpm.cosmology import HUBBLE_DISTANCE, eisenstein_hu_transfer

# Non-cubic particle grid and box: a transposed axis would show.
SHAPE = (12, 10, 14)
BOX = (150.0, 120.0, 180.0)


def _sim(f_nl=0.0, dtype=torch.float64, cosmology=None, **options):
    cosmology = cosmology or torchpm.Planck15(f_nl=f_nl)
    options = dict(dict(steps=2, mesh_factor=1), **options)
    return torchpm.Simulation(SHAPE, BOX, cosmology=cosmology, dtype=dtype, **options)


def _independent_transfer(cosmology, shape, box):
    """M(k) = 2/3 (k c/H0)^2 T(k) D_md(1) / Omega_m on the rfft grid (0 at k = 0), with T the
    Eisenstein & Hu fit with wiggles and D_md(1) = 5/2 Omega_m int_0^1 da / (a E)^3 (flat
    LambdaCDM, E(1) = 1), computed here without torchpm's growth or IC code."""
    from scipy.integrate import quad

    k = _k_magnitude(shape, box)
    omega_m = float(cosmology.Omega_m)
    E = lambda a: math.sqrt(omega_m / a**3 + 1.0 - omega_m)  # noqa: E731
    growth = 2.5 * omega_m * quad(lambda a: (a * E(a)) ** -3 if a > 0 else 0.0, 0.0, 1.0, epsabs=0, epsrel=1e-12)[0]
    safe = np.where(k > 0, k, 1.0)
    T = eisenstein_hu_transfer(torch.from_numpy(safe), cosmology).numpy()
    return np.where(k > 0, 2.0 / 3.0 * (safe * HUBBLE_DISTANCE) ** 2 * T * growth / omega_m, 0.0)


def test_zero_f_nl_is_the_gaussian_field_bit_for_bit():
    """f_nl = 0 (the default) takes the Gaussian path; a differentiated f_nl = 0 takes the
    non-Gaussian one and gives the same bits, with a gradient."""
    noise = _sim().white_noise(seed=4)
    gaussian = _sim(cosmology=torchpm.Planck15()).linear_field(noise)
    assert torch.equal(_sim(0.0).linear_field(noise), gaussian)
    f_nl = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    field = _sim(f_nl).linear_field(noise)
    assert torch.equal(field.detach(), gaussian)
    (gradient,) = torch.autograd.grad((field**3).sum(), f_nl)
    assert float(gradient) != 0.0 and math.isfinite(float(gradient))


def test_field_is_linear_in_f_nl_and_a_pair_shares_the_f_nl_term():
    """delta(f) = delta_G + f delta_2 exactly: delta(2f) - delta(0) = 2 (delta(f) - delta(0)),
    delta(f) + delta(-f) = 2 delta(0); the paired partner (negated noise) is -delta_G + f delta_2."""
    sim0, sim1, sim2, sim_minus = _sim(0.0), _sim(300.0), _sim(600.0), _sim(-300.0)
    noise = sim0.white_noise(seed=5)
    d0, d1, d2, dm = (s.linear_field(noise) for s in (sim0, sim1, sim2, sim_minus))
    term = d1 - d0
    scale = float(term.abs().max())
    assert scale > 1e-3 * float(d0.abs().max())  # the term is there
    assert float((d2 - d0 - 2 * term).abs().max()) <= 1e-12 * float(d0.abs().max())
    assert float((d1 + dm - 2 * d0).abs().max()) <= 1e-12 * float(d0.abs().max())
    partner = sim1.linear_field(sim1.white_noise(seed=5, paired=True))
    assert float((partner - (term - d0)).abs().max()) <= 1e-12 * float(d0.abs().max())


def _k_magnitude(shape, box):
    axes = [2 * np.pi * np.fft.fftfreq(n, d=b / n) for n, b in zip(shape[:2], box[:2])]
    axes.append(2 * np.pi * np.fft.rfftfreq(shape[2], d=box[2] / shape[2]))
    kx, ky, kz = np.meshgrid(*axes, indexing="ij")
    return np.sqrt(kx**2 + ky**2 + kz**2)


@pytest.mark.parametrize("f_nl,kmax", [(40.0, 0.0), (-250.0, 0.0), (300.0, 2.0 / 3.0)])
def test_field_matches_an_independent_transfer(f_nl, kmax):
    """phi = IDFT(DFT(delta_G) / M), delta = delta_G + f_nl IDFT(M DFT(phi^2)) with M
    computed here (numpy, the Eisenstein & Hu fit, the Heath integral): the f_nl term
    agrees to 1e-5 of its size (torchpm reads T = 1 at k = 1e-5 h/Mpc, where the fit is 1
    to 1e-6). With ``primordial_kmax`` the Gaussian modes at and above that fraction of
    the smallest Nyquist wavenumber (pi n / L, computed here) are zeroed first."""
    cosmology = torchpm.Planck15(f_nl=f_nl)
    sim = _sim(cosmology=cosmology, primordial_kmax=kmax)
    noise = sim.white_noise(seed=6)
    gaussian_k = np.fft.rfftn(_sim(0.0).linear_field(noise)[0].numpy())
    if kmax:
        nyquist = min(np.pi * n / b for n, b in zip(SHAPE, BOX))
        cut = _k_magnitude(SHAPE, BOX) >= kmax * nyquist
        assert 0.2 < cut.mean() < 0.95
        gaussian_k[cut] = 0.0
    gaussian = np.fft.irfftn(gaussian_k, s=SHAPE, axes=(0, 1, 2))
    got = sim.linear_field(noise)[0].numpy()
    M = _independent_transfer(cosmology, SHAPE, BOX)
    inverse = np.divide(1.0, M, out=np.zeros_like(M), where=M > 0)
    phi = np.fft.irfftn(gaussian_k * inverse, s=SHAPE, axes=(0, 1, 2))
    expected_term = f_nl * np.fft.irfftn(M * np.fft.rfftn(phi * phi), s=SHAPE, axes=(0, 1, 2))
    scale = np.abs(expected_term).max()
    assert scale > 1e-4 * np.abs(gaussian).max()
    assert np.abs(got - gaussian - expected_term).max() <= 1e-5 * scale


def test_primordial_kmax_cuts_the_gaussian_modes_whatever_f_nl():
    """f_nl = 0 with ``primordial_kmax``: the field's modes at and above the cut are zero
    and those below are the uncut field's (to rounding); the cut is refused below 0."""
    noise = _sim().white_noise(seed=2)
    full = np.fft.rfftn(_sim(0.0).linear_field(noise)[0].numpy())
    cut_field = np.fft.rfftn(_sim(0.0, primordial_kmax=0.5).linear_field(noise)[0].numpy())
    nyquist = min(np.pi * n / b for n, b in zip(SHAPE, BOX))
    cut = _k_magnitude(SHAPE, BOX) >= 0.5 * nyquist
    assert cut.any() and (~cut).sum() > 10
    assert np.abs(cut_field[cut]).max() <= 1e-12 * np.abs(full).max()
    assert np.abs(cut_field[~cut] - full[~cut]).max() <= 1e-12 * np.abs(full).max()
    with pytest.raises(ValueError, match="`primordial_kmax`"):
        _sim(0.0, primordial_kmax=-0.5)
    assert "primordial_kmax=0.5" in repr(_sim(0.0, primordial_kmax=0.5))


@pytest.mark.parametrize("preset,A_s", [(torchpm.Planck15, math.exp(3.064) * 1e-10),
                                        (torchpm.Planck18, math.exp(3.047) * 1e-10)])
def test_primordial_potential_has_planck_amplitude(preset, A_s):
    """P_Phi = P(k) / M(k)^2 is the power law of the potential of matter domination,
    k^3 P_Phi / (2 pi^2) = 9/25 A_s (k / k_pivot)^(n_s - 1) (k_pivot = 0.05/Mpc): the same A_s
    at every k (to 1e-9), and within 6% of the A_s Planck published with the preset's sigma8
    (ln(1e10 A_s) = 3.064 for 2015, 3.047 for 2018; Eisenstein & Hu's fit and Planck's
    massive neutrinos differ by a few percent). A wrong growth normalisation (D = 1 today),
    Omega_m or 3/5 would be off by 1.6 to 2.8 times."""
    from torchpm.fourier import FourierKernels
    from torchpm.ic import primordial_transfer
    from torchpm.mesh import LocalMesh

    cosmology = preset()
    sim = torchpm.Simulation(16, 1000.0, cosmology=cosmology, dtype=torch.float64)
    kernels = FourierKernels(LocalMesh((16, 16, 16)), (1000.0,) * 3, dtype=torch.float64, device="cpu")
    M = primordial_transfer(kernels, sim.power, cosmology, sim.growth_table().D1_matter_era)[0]
    k = kernels.k_magnitude.expand_as(M)
    keep = k > 0
    k, M = k[keep], M[keep]
    power = sim.power(k, cosmology)
    n_s, h = float(cosmology.n_s), float(cosmology.h)
    implied = k**3 * power / M**2 / (2 * math.pi**2) * 25.0 / 9.0 / (k / (0.05 / h)) ** (n_s - 1.0)
    assert float(implied.max() / implied.min() - 1.0) < 1e-9
    ratio = float(implied.mean()) / A_s
    assert abs(ratio - 1.0) < 0.06, ratio
    # and the README's figure: 4.4% below Planck's A_s for both presets
    assert round(100 * (1.0 - ratio), 1) == 4.4, ratio


def test_gradient_in_f_nl_matches_finite_differences_and_the_adjoint():
    """d loss / d f_nl through a run (the linear field, the LPT, two PM steps, the density)
    equals central finite differences (TSC mass assignment, whose gradient has no kinks at
    cell faces; CIC's would make differences of +-1 in f_nl disagree by about 1%), so does
    that of the 2LPT initial state, and the gradients of the adjoint method, of
    checkpoint=True and of torch.func.grad equal autograd's."""
    field = torch.randn(1, *(2 * n for n in SHAPE), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weights = torch.randn(1, math.prod(SHAPE), 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def loss(f_nl, **options):
        sim = _sim(f_nl, mesh_factor=2, **options)
        return (sim.density(sim(sim.white_noise(seed=7))) * field).sum()

    def initial(f_nl):
        sim = _sim(f_nl, steps=0)
        return (sim(sim.white_noise(seed=7)).positions * weights).sum()

    for function, options, tolerance in [(loss, dict(paint_order="tsc"), 1e-4), (initial, {}, 1e-8)]:
        f_nl = torch.tensor(100.0, dtype=torch.float64, requires_grad=True)
        (gradient,) = torch.autograd.grad(function(f_nl, **options), f_nl)
        with torch.no_grad():
            numeric = (function(101.0, **options) - function(99.0, **options)) / 2.0
        assert abs(float(gradient)) > 0
        assert abs(float(gradient - numeric)) <= tolerance * abs(float(gradient)), (float(gradient), float(numeric))
    f_nl = torch.tensor(100.0, dtype=torch.float64, requires_grad=True)
    (gradient,) = torch.autograd.grad(loss(f_nl), f_nl)
    (adjoint,) = torch.autograd.grad(loss(f_nl, adjoint=True), f_nl)
    assert abs(float(adjoint - gradient)) <= 1e-9 * abs(float(gradient)), (float(adjoint), float(gradient))
    (checkpointed,) = torch.autograd.grad(loss(f_nl, checkpoint=True), f_nl)
    transformed = torch.func.grad(loss)(torch.tensor(100.0, dtype=torch.float64))
    for other in (checkpointed, transformed):
        assert abs(float(other - gradient)) <= 1e-12 * abs(float(gradient)), (float(other), float(gradient))


def test_float32_field_matches_float64():
    noise = _sim().white_noise(seed=8)
    single = _sim(500.0, dtype=torch.float32).linear_field(noise.float())
    double = _sim(500.0).linear_field(noise)
    term32 = single.double() - _sim(0.0, dtype=torch.float32).linear_field(noise.float()).double()
    term64 = double - _sim(0.0).linear_field(noise)
    assert float((term32 - term64).abs().max()) <= 1e-4 * float(term64.abs().max())


def _table(path, k_min):
    cosmology = torchpm.Planck15()
    k = torch.logspace(math.log10(k_min), 1.0, 2000, dtype=torch.float64)
    power = torchpm.cosmology.linear_power(k, cosmology)
    np.savetxt(path, torch.stack([k, power], 1).numpy())
    return str(path)


def test_power_table_must_reach_the_primordial_scale(tmp_path):
    """A table reaching k = 1e-5 h/Mpc gives the fit's field (to its interpolation error);
    one starting above 1e-4 h/Mpc is refused, naming f_nl and the table."""
    noise = _sim().white_noise(seed=9)
    fit = _sim(200.0).linear_field(noise) - _sim(0.0).linear_field(noise)
    table = _table(tmp_path / "low.txt", 1e-5)
    tabulated = (_sim(200.0, power_spectrum=table).linear_field(noise)
                 - _sim(0.0, power_spectrum=table).linear_field(noise))
    assert float((tabulated - fit).abs().max()) <= 1e-4 * float(fit.abs().max())
    high = _table(tmp_path / "high.txt", 1e-3)
    with pytest.raises(ValueError, match=r"`f_nl` = 200 needs the linear power .*high\.txt"):
        _sim(200.0, power_spectrum=high).linear_field(noise)
    _sim(0.0, power_spectrum=high).linear_field(noise)  # Gaussian: the table's range is enough


def test_cosmology_checks_f_nl():
    with pytest.raises(ValueError, match="`f_nl` must be finite"):
        torchpm.Planck15(f_nl=float("nan"))
    assert "f_nl=25" in repr(torchpm.Planck15(f_nl=25.0))
    assert float(torchpm.Planck15(f_nl=3.0).to("cpu").f_nl) == 3.0


def test_snapshot_records_f_nl_and_resume_compares_it(tmp_path):
    """A snapshot holds the run's f_nl; a run with another f_nl cannot resume from it; a
    snapshot without the attribute (written before it existed) counts as f_nl = 0."""
    h5py = pytest.importorskip("h5py")
    from torchpm.io import check_restart, read_snapshot, write_snapshot

    sim = _sim(30.0, steps=[0.3, 0.6])
    path = str(tmp_path / "snap.hdf5")
    write_snapshot(path, sim(sim.white_noise(seed=1), until=0.3, return_mesh_units=True), sim, mesh_units=True)
    check_restart(read_snapshot(path), _sim(30.0, steps=[0.3, 0.6]))
    with pytest.raises(ValueError, match="cosmology_f_nl: snapshot 30.0"):
        check_restart(read_snapshot(path), _sim(0.0, steps=[0.3, 0.6]))
    gaussian = _sim(0.0, steps=[0.3, 0.6])
    path = str(tmp_path / "old.hdf5")
    write_snapshot(path, gaussian(gaussian.white_noise(seed=1), until=0.3, return_mesh_units=True), gaussian,
                   mesh_units=True)
    with h5py.File(path, "r+") as handle:
        del handle["torchpm"].attrs["cosmology_f_nl"]
    check_restart(read_snapshot(path), gaussian)
    with pytest.raises(ValueError, match="cosmology_f_nl: snapshot 0.0"):
        check_restart(read_snapshot(path), _sim(30.0, steps=[0.3, 0.6]))


def test_cli_f_nl_key_reaches_the_initial_conditions(tmp_path, capsys, monkeypatch):
    """`f_nl = 150` in a config makes the run's initial conditions those of
    Cosmology(f_nl=150) (the 1LPT particles at a_start, from the snapshot); the summary names
    it; the key inside a cosmology table is refused, naming the setting to use."""
    pytest.importorskip("h5py")
    from torchpm.__main__ import main
    from torchpm.io import read_snapshot, restart_state

    monkeypatch.chdir(tmp_path)
    base = ('n_particles = 6\nbox_size = 60.0\nmesh_factor = 1\nsteps = 0\nlpt_order = 1\n'
            'dtype = "float64"\nseed = 3\nsnapshots = [0.1]\n')
    config = tmp_path / "run.toml"
    config.write_text(base + "f_nl = 150.0\n")
    assert main(["run", str(config)]) == 0
    assert "f_nl=150" in capsys.readouterr().out  # the simulation's line
    assert "f_nl=150" in (tmp_path / "out" / "power_spectrum.txt").read_text().splitlines()[1]
    sim = torchpm.Simulation(6, 60.0, mesh_factor=1, steps=0, lpt_order=1, dtype=torch.float64,
                             cosmology=torchpm.Planck15(f_nl=150.0))
    state = restart_state(read_snapshot(tmp_path / "out" / "snap_000.hdf5"), sim)
    expected = sim(sim.white_noise(seed=3), return_mesh_units=True)
    torch.testing.assert_close(state.positions, expected.positions, rtol=0, atol=1e-12)
    gaussian = torchpm.Simulation(6, 60.0, mesh_factor=1, steps=0, lpt_order=1, dtype=torch.float64)
    assert not torch.allclose(gaussian(gaussian.white_noise(seed=3)).positions, sim(sim.white_noise(seed=3)).positions)
    config.write_text(base + 'output = "b"\ncosmology = { Omega_c = 0.26, Omega_b = 0.05, h = 0.68, n_s = 0.96, '
                      'sigma8 = 0.8, f_nl = 10 }\n')
    assert main(["run", str(config)]) == 2
    error = capsys.readouterr().err
    assert "`f_nl` is a setting of its own" in error and len(error.strip().splitlines()) == 1, error
    config.write_text(base + 'output = "c"\nf_nl = "ten"\n')
    assert main(["run", str(config)]) == 2
    assert "`f_nl`" in capsys.readouterr().err


def test_cli_primordial_kmax_reaches_the_run_and_resume_compares_it(tmp_path, capsys, monkeypatch):
    """`primordial_kmax` makes the run's initial conditions those of
    Simulation(primordial_kmax=...); --resume refuses a snapshot of another cut (it changed
    the particles before the snapshot), and one written before the key existed counts as 0."""
    h5py = pytest.importorskip("h5py")
    from torchpm.__main__ import main
    from torchpm.io import read_snapshot, restart_state

    monkeypatch.chdir(tmp_path)
    base = ('n_particles = 6\nbox_size = 60.0\nmesh_factor = 1\nsteps = [0.2]\nlpt_order = 1\n'
            'dtype = "float64"\nseed = 3\nsnapshots = [0.1]\nf_nl = 80.0\n')
    config = tmp_path / "run.toml"
    config.write_text(base + "primordial_kmax = 0.6\n")
    assert main(["run", str(config)]) == 0
    sim = torchpm.Simulation(6, 60.0, mesh_factor=1, steps=[0.2], lpt_order=1, dtype=torch.float64,
                             cosmology=torchpm.Planck15(f_nl=80.0), primordial_kmax=0.6)
    snapshot = str(tmp_path / "out" / "snap_000.hdf5")
    state = restart_state(read_snapshot(snapshot), sim)
    torch.testing.assert_close(state.positions, sim(sim.white_noise(seed=3), until=0.1, return_mesh_units=True).positions,
                               rtol=0, atol=1e-12)
    capsys.readouterr()
    config.write_text(base + "primordial_kmax = 0.5\n")
    assert main(["run", str(config), "--check", "--resume", snapshot]) == 2
    error = capsys.readouterr().err
    assert "primordial_kmax 0.6 (this configuration: 0.5)" in error, error
    config.write_text(base)  # no cut
    with h5py.File(snapshot, "r+") as handle:  # as written before the key existed
        text = handle["torchpm"].attrs["config"]
        text = text.decode() if isinstance(text, bytes) else text
        handle["torchpm"].attrs["config"] = "\n".join(line for line in text.splitlines()
                                                     if not line.startswith("primordial_kmax")) + "\n"
    assert main(["run", str(config), "--check", "--resume", snapshot]) == 0
    config.write_text(base + 'primordial_kmax = -1\noutput = "d"\n')
    assert main(["run", str(config)]) == 2
    assert "`primordial_kmax`" in capsys.readouterr().err


def test_simulation_config_is_a_valid_config_with_f_nl():
    """The config a library run writes into its snapshots (``torchpm.io.simulation_config``)
    holds ``f_nl`` and ``primordial_kmax`` as the CLI's keys (not inside the cosmology
    table, which the CLI refuses) and validates."""
    from torchpm.config import validate
    from torchpm.io import simulation_config

    config = simulation_config(_sim(12.5, primordial_kmax=0.5))
    assert config["f_nl"] == 12.5 and config["primordial_kmax"] == 0.5 and "f_nl" not in config["cosmology"]
    checked = validate(config)
    assert checked["f_nl"] == 12.5 and checked["primordial_kmax"] == 0.5


def test_primordial_kmax_cuts_a_shell_on_the_threshold_alike_in_both_dtypes():
    """kmax n / 2 an integer puts a whole shell of modes exactly on the threshold: they are
    cut ("at and above") in float32 as in float64, as the modes beyond; a cut changed after
    construction is the cut of a new simulation (the power kernel's cache does not keep it)."""
    n, box, kmax = 24, 300.0, 0.5
    noise = torchpm.Simulation(n, box, 1, steps=1, dtype=torch.float64).white_noise(seed=3)
    fields = {}
    for dtype in (torch.float64, torch.float32):
        sim = torchpm.Simulation(n, box, 1, steps=1, dtype=dtype, primordial_kmax=kmax)
        fields[dtype] = np.fft.rfftn(sim.linear_field(noise.to(dtype))[0].double().numpy())
    i = np.fft.fftfreq(n, 1.0 / n)
    l = np.arange(n // 2 + 1)
    m = i[:, None, None] ** 2 + i[None, :, None] ** 2 + l[None, None, :] ** 2
    shell = m == (kmax * n / 2) ** 2
    assert shell.sum() > 6
    for field in fields.values():  # (zero to the FFTs' rounding)
        empty = np.abs(field) < 1e-4 * np.abs(field).max()
        assert np.array_equal(empty[m > 0], (m >= (kmax * n / 2) ** 2)[m > 0])
    sim = torchpm.Simulation(n, box, 1, steps=1, dtype=torch.float64, primordial_kmax=kmax)
    sim.linear_field(noise)
    sim.primordial_kmax = 0.25
    fresh = torchpm.Simulation(n, box, 1, steps=1, dtype=torch.float64, primordial_kmax=0.25)
    assert torch.equal(sim.linear_field(noise), fresh.linear_field(noise))
    sim.primordial_kmax = -1.0
    with pytest.raises(ValueError, match="`primordial_kmax`"):
        sim.linear_field(noise)


def test_spectra_without_power_somewhere_or_given_as_a_number():
    """A constant spectrum given as a number works with f_nl as without; a spectrum that is 0
    above a cutoff gives no potential there (M = 0: no f_nl term, no NaN), not an error."""
    constant = _sim(50.0, power_spectrum=lambda k, c: 1000.0)
    noise = constant.white_noise(seed=1)
    assert bool(torch.isfinite(constant.linear_field(noise)).all())

    def cut(k, cosmology):
        return torch.where(k < 0.15, torchpm.cosmology.linear_power(k, cosmology), torch.zeros_like(k))

    field = _sim(300.0, power_spectrum=cut).linear_field(noise)
    assert bool(torch.isfinite(field).all())
    k = _k_magnitude(SHAPE, BOX)
    modes = np.fft.rfftn(field[0].numpy())
    assert np.abs(modes[k >= 0.15]).max() <= 1e-12 * np.abs(modes).max()
    gaussian = _sim(0.0, power_spectrum=cut).linear_field(noise)
    assert float((field - gaussian).abs().max()) > 1e-6 * float(gaussian.abs().max())


def test_positive_f_nl_skews_the_density_positively():
    """The sign of the convention, physically: the mean skewness of the linear density over
    seeds rises with f_nl (+-1000 in a 2000 Mpc/h box, 24^3) on every seed, positive for
    f_nl > 0 and negative for f_nl < 0."""
    def skewness(field):
        field = field - field.mean()
        return float((field**3).mean() / (field**2).mean() ** 1.5)

    sims = {f: torchpm.Simulation(24, 2000.0, 1, steps=1, dtype=torch.float64, cosmology=torchpm.Planck15(f_nl=f))
            for f in (-1000.0, 0.0, 1000.0)}
    values = {f: [] for f in sims}
    for seed in range(6):
        noise = sims[0.0].white_noise(seed=seed)
        for f, sim in sims.items():
            values[f].append(skewness(sim.linear_field(noise)))
    for low, mid, high in zip(values[-1000.0], values[0.0], values[1000.0]):
        assert low < mid < high
    assert np.mean(values[1000.0]) > 0.05 > -0.05 > np.mean(values[-1000.0])
