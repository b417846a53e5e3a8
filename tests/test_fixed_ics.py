"""Paired and fixed initial conditions (`torchpm.ic.fixed_amplitude`,
`Simulation.white_noise(fixed_amplitude=..., paired=...)`).

Oracles: numpy's full complex DFT (not torch's rfft) for the amplitudes, phases and
self-conjugate modes, and a numpy twin of the transform; the exact identity
``P_estimated(k) = P_input(k)`` mode by mode for the fixed linear field, binned in shells
with numpy; gradcheck; hand cases (all-zero noise). The grid cases run on 2 gloo ranks
and compare with the single-device field (see _spawn.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torchpm
from torchpm.ic import fixed_amplitude

from _spawn import rank_errors, world_results_fixture

SHAPES = [(6, 5, 4), (4, 4, 4), (5, 3, 7), (2, 6, 8)]


def _noise(shape, batch=2, seed=0, dtype=torch.float64):
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _numpy_fixed(noise: np.ndarray) -> np.ndarray:
    """The transform on the full complex grid: IDFT(sqrt(N) X / |X|)."""
    axes = (-3, -2, -1)
    n = math.prod(noise.shape[-3:])
    x = np.fft.fftn(noise, axes=axes)
    return np.fft.ifftn(math.sqrt(n) * x / np.abs(x), axes=axes).real


def _self_conjugate(shape):
    """Indices of the modes k with k = -k (mod n): 0 and, for even n, n/2 on each axis."""
    choices = [[0] + ([n // 2] if n % 2 == 0 else []) for n in shape]
    return [(i, j, k) for i in choices[0] for j in choices[1] for k in choices[2]]


# ----------------------------------------------------------------------------------
# The transform.


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_amplitude_is_its_expectation_and_every_phase_is_kept(shape):
    noise = _noise(shape)
    fixed = fixed_amplitude(noise)
    assert fixed.shape == noise.shape and fixed.dtype == noise.dtype
    n = math.prod(shape)
    full = np.fft.fftn(fixed.numpy(), axes=(-3, -2, -1))
    original = np.fft.fftn(noise.numpy(), axes=(-3, -2, -1))
    # <|DFT omega|^2> = sum_x <omega(x)^2> = N for unit white noise, every mode
    np.testing.assert_allclose(np.abs(full) ** 2, n, rtol=1e-12)
    # the same phase: fixed * conj(original) is real and positive
    product = full * np.conj(original)
    assert np.all(product.real > 0)
    np.testing.assert_allclose(product.imag / np.abs(product), 0.0, atol=1e-12)
    # self-conjugate modes: real, +-sqrt(N), the sign of the original
    for index in _self_conjugate(shape):
        for member in range(noise.shape[0]):
            value, before = full[(member, *index)], original[(member, *index)]
            assert abs(value.imag) < 1e-12 * math.sqrt(n), (index, value)
            assert value.real == pytest.approx(math.copysign(math.sqrt(n), before.real), rel=1e-12), index
    # and the whole field equals the numpy twin
    np.testing.assert_allclose(fixed.numpy(), _numpy_fixed(noise.numpy()), rtol=0, atol=1e-12)


def test_float32_keeps_its_dtype_and_amplitudes():
    noise = _noise((8, 6, 4), dtype=torch.float32)
    fixed = fixed_amplitude(noise)
    assert fixed.dtype == torch.float32
    full = np.fft.fftn(fixed.double().numpy(), axes=(-3, -2, -1))
    np.testing.assert_allclose(np.abs(full) ** 2, 8 * 6 * 4, rtol=1e-5)


def test_zero_noise_by_hand_and_no_nan_gradient():
    """All-zero noise has no phase anywhere: every mode becomes +sqrt(N), whose inverse
    DFT is sqrt(N) at the origin and 0 elsewhere; the gradient there is 0, not NaN."""
    zero = torch.zeros(1, 4, 2, 6, dtype=torch.float64, requires_grad=True)
    fixed = fixed_amplitude(zero)
    expected = torch.zeros(1, 4, 2, 6, dtype=torch.float64)
    expected[0, 0, 0, 0] = math.sqrt(48)
    torch.testing.assert_close(fixed.detach(), expected, rtol=0, atol=1e-12)
    weights = torch.arange(48.0, dtype=torch.float64).reshape(fixed.shape)
    (gradient,) = torch.autograd.grad((fixed * weights).sum(), zero)
    assert torch.equal(gradient, torch.zeros_like(gradient))


def test_gradient_is_finite_where_some_amplitudes_are_zero():
    """A plane wave along x has zero amplitude in every other mode (and a real Nyquist
    mode): the gradient is finite everywhere."""
    x = torch.arange(6, dtype=torch.float64)
    wave = (torch.cos(2 * math.pi * x / 6) + 0.5 * torch.cos(math.pi * x)).reshape(1, 6, 1, 1).expand(1, 6, 4, 3)
    wave = wave.clone().requires_grad_(True)
    fixed = fixed_amplitude(wave)
    weights = torch.randn(fixed.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (gradient,) = torch.autograd.grad((fixed * weights).sum(), wave)
    assert bool(torch.isfinite(gradient).all())


@pytest.mark.parametrize("shape", [(4, 3, 2), (3, 2, 4)], ids=lambda s: "x".join(map(str, s)))
def test_gradcheck(shape):
    noise = _noise(shape, batch=1, seed=5).requires_grad_(True)
    assert torch.autograd.gradcheck(fixed_amplitude, (noise,), eps=1e-6, atol=1e-8)


def test_the_map_is_odd_so_a_pair_stays_a_pair():
    noise = _noise((6, 5, 4))
    assert torch.equal(fixed_amplitude(-noise), -fixed_amplitude(noise))


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(4, 4, 4, dtype=torch.int64), "`noise` must be a real float32 or float64"),
    (torch.zeros(4, 4, 4, dtype=torch.complex128), "`noise` must be a real float32 or float64"),
    (torch.zeros(4, 4), "`noise` must have at least 3 dimensions"),
    (torch.tensor([[[float("nan")]]]), "`noise` contains 1 NaN"),
    ([[[0.0]]], "`noise` must be a tensor"),
])
def test_bad_noise_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        fixed_amplitude(bad)


def test_bad_mesh_is_named():
    with pytest.raises(ValueError, match=r"`noise` must have shape \(\.\.\., 4, 4, 4\)"):
        fixed_amplitude(torch.zeros(1, 4, 4, 5), torchpm.mesh.LocalMesh(4))
    with pytest.raises(ValueError, match="`mesh` must be a LocalMesh or a PencilDecomposition"):
        fixed_amplitude(torch.zeros(1, 4, 4, 4), mesh="4x4x4")


# ----------------------------------------------------------------------------------
# Simulation.white_noise and the linear field.


def _simulation(**options):
    return torchpm.Simulation(n_particles=(8, 6, 4), box_size=(80.0, 72.0, 40.0), steps=0,
                              dtype=torch.float64, **options)


def test_white_noise_options():
    sim = _simulation()
    plain = sim.white_noise(batch=2, seed=9)
    fixed = sim.white_noise(batch=2, seed=9, fixed_amplitude=True)
    np.testing.assert_allclose(fixed.numpy(), _numpy_fixed(plain.numpy()), rtol=0, atol=1e-12)
    # paired: every phase shifted by pi, so the two members of a pair sum to zero
    assert torch.equal(sim.white_noise(batch=2, seed=9, paired=True), -plain)
    partner = sim.white_noise(batch=2, seed=9, fixed_amplitude=True, paired=True)
    assert torch.equal(partner + fixed, torch.zeros_like(fixed))
    original = np.fft.fftn(fixed.numpy(), axes=(-3, -2, -1))
    flipped = np.fft.fftn(partner.numpy(), axes=(-3, -2, -1))
    np.testing.assert_allclose(flipped, original * np.exp(1j * np.pi), atol=1e-12)


@pytest.mark.parametrize("option", ["fixed_amplitude", "paired"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_white_noise_options_must_be_bools(option, value):
    with pytest.raises(ValueError, match=f"`{option}`"):
        _simulation().white_noise(seed=1, **{option: value})


def _shell_spectra(field: np.ndarray, box, power):
    """Shell means of the estimated P = V/N^2 |DFT delta|^2 and of the input P at each
    mode's |k| (k = 0 left out), on the full complex grid; shells of width 2 pi / L_min."""
    shape = field.shape
    n = math.prod(shape)
    volume = math.prod(box)
    estimated = volume / n**2 * np.abs(np.fft.fftn(field)) ** 2
    axes = [2 * math.pi * np.fft.fftfreq(m, d=b / m) for m, b in zip(shape, box)]
    kx, ky, kz = np.meshgrid(*axes, indexing="ij")
    k = np.sqrt(kx**2 + ky**2 + kz**2)
    expected = np.zeros_like(k)
    nonzero = k > 0
    expected[nonzero] = power(k[nonzero])
    width = 2 * math.pi / min(box)
    shell = np.floor(k / width).astype(int)
    counts = np.bincount(shell[nonzero])
    used = counts > 0
    mean = lambda values: np.bincount(shell[nonzero], weights=values[nonzero])[used] / counts[used]  # noqa: E731
    return mean(estimated), mean(expected), estimated[nonzero], expected[nonzero]


def test_fixed_linear_field_has_no_cosmic_variance():
    """The fixed linear field's P(k) equals the input P(k) mode by mode and so per shell
    (to rounding); the unfixed field of the same seed scatters around it."""
    sim = _simulation()

    def power(k):
        return sim.linear_power(torch.from_numpy(k)).numpy()

    for member in (sim.white_noise(seed=4, fixed_amplitude=True), sim.white_noise(seed=4, fixed_amplitude=True,
                                                                                  paired=True)):
        field = sim.linear_field(member)[0].numpy()
        shells, expected_shells, modes, expected_modes = _shell_spectra(field, sim.box_size, power)
        np.testing.assert_allclose(modes, expected_modes, rtol=1e-11)
        np.testing.assert_allclose(shells, expected_shells, rtol=1e-11)
    field = sim.linear_field(sim.white_noise(seed=4))[0].numpy()
    shells, expected_shells, modes, expected_modes = _shell_spectra(field, sim.box_size, power)
    assert np.max(np.abs(modes / expected_modes - 1)) > 0.5  # a chi^2 scatter, not rounding
    assert np.max(np.abs(shells / expected_shells - 1)) > 0.05


def test_fixed_noise_runs_and_pairs_mirror_at_first_order():
    """A fixed pair through 1LPT: the displacements of the two members are opposite."""
    sim = _simulation(lpt_order=1)
    one = sim(sim.white_noise(seed=2, fixed_amplitude=True))
    two = sim(sim.white_noise(seed=2, fixed_amplitude=True, paired=True))
    q = torchpm.ic.grid_positions(sim.particle_shape, 1, dtype=torch.float64, device="cpu") * torch.tensor(
        sim.particle_cell, dtype=torch.float64)
    box = torch.tensor(sim.box_size, dtype=torch.float64)

    def displacement(state):
        d = state.positions[0] - q
        return d - box * torch.round(d / box)

    torch.testing.assert_close(displacement(two), -displacement(one), rtol=0, atol=1e-10)
    assert float(displacement(one).abs().max()) > 0.1


# ----------------------------------------------------------------------------------
# On a process grid: 2 gloo ranks, each comparing its block with the single-device field.

GRID_SHAPE = (6, 5, 4)  # split x evenly over (2, 1), y unevenly over (1, 2); Nyquist planes in x and z
GRIDS = [(2, 1), (1, 2)]


def case_ids(world_size):
    return [f"{kind}-{p0}x{p1}" for p0, p1 in GRIDS for kind in ("field", "gradient", "bad_block")]


def make_context(world_size):
    import torch.distributed as dist

    from torchpm.distributed import process_grid_groups

    return {"rank": dist.get_rank(), "groups": {grid: process_grid_groups(grid) for grid in GRIDS}}


def run_case(case_id, ctx):
    kind, grid_text = case_id.rsplit("-", 1)
    grid = tuple(int(p) for p in grid_text.split("x"))
    globals()[f"case_{kind}"](grid, ctx)


def _pair(grid, ctx):
    config = dict(n_particles=GRID_SHAPE, box_size=60.0, steps=0, dtype=torch.float64)
    return torchpm.Simulation(**config), torchpm.Simulation(**config, mesh=ctx["groups"][grid])


def case_field(grid, ctx):
    serial, distributed = _pair(grid, ctx)
    mesh = distributed.particle_mesh
    for paired in (False, True):
        expected = serial.white_noise(batch=2, seed=7, fixed_amplitude=True, paired=paired)
        local = distributed.white_noise(batch=2, seed=7, fixed_amplitude=True, paired=paired)
        torch.testing.assert_close(local, mesh.local_real_part(expected), rtol=0, atol=1e-12)
    # the plain function on the decomposition too
    noise = serial.white_noise(batch=2, seed=8)
    torch.testing.assert_close(fixed_amplitude(mesh.local_real_part(noise), mesh),
                               mesh.local_real_part(fixed_amplitude(noise)), rtol=0, atol=1e-12)


def case_gradient(grid, ctx):
    serial, distributed = _pair(grid, ctx)
    mesh = distributed.particle_mesh
    noise = serial.white_noise(seed=3)
    weights = torch.randn(noise.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole = noise.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad((fixed_amplitude(whole) * weights).sum(), whole)
    local = mesh.local_real_part(noise).requires_grad_(True)
    # each rank's share of the loss: the transforms' collective backwards add the others'
    loss = (fixed_amplitude(local, mesh) * mesh.local_real_part(weights)).sum()
    (gradient,) = torch.autograd.grad(loss, local)
    torch.testing.assert_close(gradient, mesh.local_real_part(expected), rtol=0, atol=1e-12)


def case_bad_block(grid, ctx):
    _, distributed = _pair(grid, ctx)
    mesh = distributed.particle_mesh
    noise = torch.zeros(1, *mesh.local_real_shape, dtype=torch.float64)
    if ctx["rank"] == 1:
        noise = torch.zeros(1, *GRID_SHAPE, dtype=torch.float64)  # the whole grid: not this rank's block
    try:
        fixed_amplitude(noise, mesh)
    except ValueError as error:
        assert "`noise` must have shape" in str(error), str(error)
        return
    raise AssertionError("a bad block on rank 1 was not refused on every rank")


world_results = world_results_fixture(__name__, case_ids, "fixed_world", timeout_s=300)


@pytest.mark.distributed
@pytest.mark.parametrize("case_id", case_ids(2))
def test_fixed_amplitude_on_a_process_grid(world_results, case_id):
    errors = rank_errors(world_results(2)[case_id])
    if errors:
        pytest.fail(errors)
