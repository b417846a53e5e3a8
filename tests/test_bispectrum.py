"""The bispectrum of a mesh field (torchpm.bispectrum) on one device.

Oracles: a brute-force numpy sum over every closed triple of modes of the full complex
DFT (no shell fields, no rfft half-spectrum, no torchpm code; the third side found as
``-(k1 + k2)`` and kept only when it lies in its shell, so triangles closing only modulo
the grid are never counted); plane waves whose few closed triangles are counted by hand;
the Poisson shot noise of uniform random particles (its expectation exact, the sample
mean compared within a statistical bound); gradcheck in float64.
"""

import math

import numpy as np
import pytest
import torch

from torchpm.analysis import power_spectrum
from torchpm.bispectrum import bispectrum, triangle_configurations
from torchpm.mesh import LocalMesh

TOLERANCE = 1e-12


def _modes(shape, box, edges):
    """Integer wavevectors of the full DFT (``fftfreq`` order) and each one's shell (-1: none)."""
    reps = np.stack(np.meshgrid(*[np.rint(np.fft.fftfreq(n) * n).astype(int) for n in shape], indexing="ij"), -1)
    reps = reps.reshape(-1, 3)
    k = np.linalg.norm(reps * (2 * np.pi / np.asarray(box)), axis=-1)
    shell = np.searchsorted(edges, k, side="right") - 1
    shell[(k == 0) | (shell >= len(edges) - 1)] = -1
    return reps, shell


def _brute_force(field, box, edges, configurations, weight=None):
    """``(B (batch, n), counts (n,), mean side lengths (n, 3), P (batch, n_bins))`` by
    enumerating every pair ``(k1, k2)`` of the first two shells and keeping ``k3 = -(k1 +
    k2)`` when its length falls in the third shell. ``weight(reps)``: each mode's DFT is
    divided by it (a window)."""
    shape = field.shape[-3:]
    cells, volume = np.prod(shape), np.prod(box)
    transform = np.fft.fftn(field, axes=(-3, -2, -1))
    reps, shell = _modes(shape, box, edges)
    k_fundamental = 2 * np.pi / np.asarray(box)

    def at(r):
        wrapped = r % np.asarray(shape)
        values = transform[..., wrapped[:, 0], wrapped[:, 1], wrapped[:, 2]]
        return values if weight is None else values / weight(r)

    results, counts, sides = [], [], []
    for i, j, l in configurations:
        r1, r2 = reps[shell == i], reps[shell == j]
        r3 = -(r1[:, None, :] + r2[None, :, :])
        k3 = np.linalg.norm(r3 * k_fundamental, axis=-1)
        first, second = np.nonzero((np.searchsorted(edges, k3, side="right") - 1 == l) & (k3 > 0))
        a, b, c = r1[first], r2[second], r3[first, second]
        counts.append(len(first))
        if not len(first):  # (no closed triangle: compared by its count alone)
            results.append(np.full(field.shape[:-3], np.nan))
            sides.append([np.nan] * 3)
            continue
        results.append(volume**2 / cells**3 * (at(a) * at(b) * at(c)).mean(-1).real)
        sides.append([np.linalg.norm(r * k_fundamental, axis=-1).mean() for r in (a, b, c)])
    power = np.stack([(np.abs(at(reps[shell == s])) ** 2).mean(-1) * volume / cells**2
                      for s in range(len(edges) - 1)], -1)
    return np.stack(results, -1), np.array(counts), np.array(sides), power


def _random_field(shape, batch=2, seed=0):
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(got, expected, what, tolerance=TOLERANCE):
    got = got.detach().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    scale = np.abs(expected).max()
    error = np.abs(got - expected).max()
    assert error <= tolerance * scale, f"{what}: max abs difference {error:.3e} > {tolerance:g} x {scale:.3e}"


def _aliased(result, shape, box):
    """Whether some configuration's three shells reach past the grid along an axis (where
    the shell-product sum alone would also count triangles closing modulo the grid)."""
    upper = result.edges[1:].cpu().numpy()
    reach = upper[result.shells.cpu().numpy()].sum(-1)
    return any((reach * b / (2 * np.pi) > n).any() for n, b in zip(shape, box))


@pytest.mark.parametrize("shape,box", [
    ((6, 6, 6), (30.0, 30.0, 30.0)),
    ((7, 7, 7), (35.0, 35.0, 35.0)),
    ((8, 8, 8), (100.0, 100.0, 100.0)),
    ((10, 8, 7), (50.0, 40.0, 28.0)),   # non-cubic cells and box, even and odd sides
    ((9, 6, 10), (45.0, 40.0, 30.0)),
])
def test_default_shells_match_brute_force(device, shape, box):
    field = _random_field(shape)
    result = bispectrum(field.to(device), box)
    edges = result.edges.cpu().numpy()
    configurations = [tuple(t) for t in result.shells.tolist()]
    assert configurations == [t for t in triangle_configurations(edges)
                              if t in configurations], "configurations in the documented order"
    expected, counts, sides, power = _brute_force(field.numpy(), box, edges, configurations)
    assert (counts > 0).all()
    # every default configuration with a closed triangle is returned
    dropped = [t for t in triangle_configurations(edges) if t not in configurations]
    if dropped:
        assert (_brute_force(field.numpy(), box, edges, dropped)[1] == 0).all()
    assert _aliased(result, shape, box), "the case must include configurations that alias"
    assert result.bispectrum.dtype == torch.float64 and result.bispectrum.device.type == device.type
    _close(result.bispectrum, expected, "B")
    assert result.triangles.tolist() == counts.tolist()
    _close(result.k, sides, "mean side lengths")
    shells = result.shells.cpu().numpy()
    _close(result.power, power[:, shells], "P of the sides' shells")
    p1, p2, p3 = (power[:, shells[:, n]] for n in range(3))
    _close(result.reduced, expected / (p1 * p2 + p2 * p3 + p3 * p1), "Q")


def test_default_configurations_by_hand():
    """Shell centres 1, 2, 3: every i <= j <= l with c_l <= c_i + c_j, i.e. all but (0, 0, 2)."""
    assert triangle_configurations([0.5, 1.5, 2.5, 3.5]) == [
        (0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 2), (0, 2, 2), (1, 1, 1), (1, 1, 2), (1, 2, 2), (2, 2, 2)]


def test_given_configurations_bins_and_window(device):
    """Edges given, configurations in any order (the sides follow it), a repeated shell, the
    CIC window divided out of each mode; and an int number of bins up to Nyquist."""
    shape, box = (10, 8, 7), (50.0, 40.0, 28.0)
    field = _random_field(shape, seed=3)
    k_nyquist = min(math.pi * n / b for n, b in zip(shape, box))
    edges = [0.1, 0.25, 0.4, 0.55, k_nyquist]
    configurations = [(2, 0, 1), (3, 3, 1), (1, 3, 2), (3, 3, 3), (0, 0, 0), (1, 1, 0)]
    result = bispectrum(field.to(device), box, bins=edges, triangles=configurations, window="cic")

    def cic(reps):
        w = 2 * np.pi * reps / np.asarray(shape)
        return np.prod(np.sinc(w / (2 * np.pi)) ** 2, axis=-1)

    expected, counts, sides, power = _brute_force(field.numpy(), box, np.array(edges), configurations, weight=cic)
    _close(result.bispectrum, expected, "B with the CIC window")
    assert result.triangles.tolist() == counts.tolist()
    _close(result.k, sides, "side lengths in the given order")
    assert result.shells.tolist() == [list(t) for t in configurations]
    _close(result.power, power[:, np.array(configurations)], "P with the CIC window")

    counted = bispectrum(field.to(device), box, bins=4)
    assert counted.edges.numel() == 5
    assert abs(float(counted.edges[-1]) - k_nyquist) < 1e-12 and abs(float(counted.edges[0]) - math.pi / 50.0) < 1e-12
    expected = _brute_force(field.numpy(), box, counted.edges.cpu().numpy(), counted.shells.tolist())[0]
    _close(counted.bispectrum, expected, "B with 4 equal shells")


def test_single_field_float32_and_batch(device):
    """A (nx, ny, nz) field gives unbatched results; float32 is measured in float64; a batch
    is measured member by member."""
    shape, box = (8, 8, 8), 80.0
    field = _random_field(shape, batch=3, seed=5).to(device)
    batched = bispectrum(field, box)
    for member in range(3):
        single = bispectrum(field[member], box)
        assert single.bispectrum.shape == (batched.bispectrum.shape[1],)
        assert single.power.shape == (batched.bispectrum.shape[1], 3)
        _close(single.bispectrum, batched.bispectrum[member].cpu().numpy(), "batch member")
    low = field.float()
    from_float32 = bispectrum(low, box)
    reference = bispectrum(low.double(), box)
    assert from_float32.bispectrum.dtype == torch.float64
    _close(from_float32.bispectrum, reference.bispectrum.cpu().numpy(), "float32 input")


def test_power_matches_power_spectrum(device):
    """The sides' P are power_spectrum's in the same shells (the same convention and shot noise)."""
    shape, box = (8, 7, 6), (40.0, 35.0, 30.0)
    field = _random_field(shape, seed=2).to(device)
    result = bispectrum(field, box, window="tsc", shot_noise=3.0)
    spectrum = power_spectrum(field, box, bins=result.edges, window="tsc", shot_noise=3.0)
    assert spectrum.power.shape[-1] == result.edges.numel() - 1
    _close(result.power, spectrum.power[:, result.shells].cpu().numpy(), "sides' P against power_spectrum")


def _plane_waves(shape, waves):
    """``sum A cos(2 pi n . j / N + phi)`` on the grid nodes ``j``: ``waves`` = [(n, A, phi)]."""
    grids = np.meshgrid(*[np.arange(n) for n in shape], indexing="ij")
    field = np.zeros(shape)
    for n, amplitude, phase in waves:
        field += amplitude * np.cos(2 * np.pi * sum(ni * g / s for ni, g, s in zip(n, grids, shape)) + phase)
    return torch.tensor(field)


def test_plane_waves_hand_counted(device):
    """Waves at q1 = x, q2 = y, q3 = -(x + y), q5 = z and q4 = 2z (units 2 pi / L) on 8^3.

    Shells (2 pi / L units) [0.5, 1.2): the 6 unit vectors; [1.2, 1.6): the 12 of length
    sqrt 2; [1.6, 2.2): the 8 of length sqrt 3 and the 6 of length 2.

    (0, 0, 1): k1, k2 perpendicular unit vectors (6 x 4 = 24 ordered pairs), k3 = -(k1 +
    k2); the field is non-zero on (x, y, q3), (y, x, q3) and their mirrors, each
    delta_k1 delta_k2 delta_k3 = (N/2)^3 A1 A2 A3 e^(+-i(phi1 + phi2 + phi3)):
    B = V^2/N^3 * 4 (N/2)^3 A1 A2 A3 cos(Phi) / 24 = V^2 A1 A2 A3 cos(Phi) / 48.

    (0, 0, 2): only k1 = k2 (6 pairs) reach a third side in the shell (length 2; the
    others have length sqrt 2 or 0); the field is non-zero on (z, z, -2z) and its mirror:
    B = V^2/N^3 * 2 (N/2)^3 A5^2 A4 cos(2 phi5 - phi4) / 6 = V^2 A5^2 A4 cos(2 phi5 - phi4) / 24.

    P: shell 0 (6 modes, |delta_k|^2 = N^2 A^2 / 4 on +-q1, +-q2, +-q5): V (A1^2 + A2^2 +
    A5^2) / 12; shell 1 (12 modes, +-q3): V A3^2 / 24; shell 2 (14 modes, +-q4): V A4^2 / 28.
    """
    shape, side = (8, 8, 8), 40.0
    waves = {"q1": ((1, 0, 0), 0.7, 0.3), "q2": ((0, 1, 0), 1.1, -0.4), "q3": ((-1, -1, 0), 0.9, 1.2),
             "q5": ((0, 0, 1), 1.3, 0.5), "q4": ((0, 0, 2), 0.6, -0.7)}
    field = _plane_waves(shape, waves.values()).to(device)
    k_fundamental = 2 * math.pi / side
    # a fourth shell [2.2, 3) without power (its three upper edges reach past the grid, so
    # the triangles closing modulo the grid are removed there)
    edges = [e * k_fundamental for e in (0.5, 1.2, 1.6, 2.2, 3.0)]
    result = bispectrum(field, side, bins=edges, triangles=[(0, 0, 1), (0, 0, 2), (1, 1, 1), (3, 3, 3)])
    amplitude = {name: wave[1] for name, wave in waves.items()}
    phase = {name: wave[2] for name, wave in waves.items()}
    volume = side**3
    expected = [
        volume**2 * amplitude["q1"] * amplitude["q2"] * amplitude["q3"]
        * math.cos(phase["q1"] + phase["q2"] + phase["q3"]) / 48,
        volume**2 * amplitude["q5"] ** 2 * amplitude["q4"] * math.cos(2 * phase["q5"] - phase["q4"]) / 24,
        0.0,  # (1, 1, 1): only +-q3 in the shell, which close no triangle among themselves
        0.0,
    ]
    assert result.triangles.tolist()[:2] == [24, 6]
    _close(result.bispectrum, np.array(expected), "plane-wave B")
    _close(result.k[:2], np.array([[1, 1, math.sqrt(2)], [1, 1, 2]]) * k_fundamental, "side lengths")
    powers = [volume * (amplitude["q1"] ** 2 + amplitude["q2"] ** 2 + amplitude["q5"] ** 2) / 12,
              volume * amplitude["q3"] ** 2 / 24, volume * amplitude["q4"] ** 2 / 28]
    _close(result.power[:2], np.array([[powers[0], powers[0], powers[1]], [powers[0], powers[0], powers[2]]]),
           "shell powers")
    for t, (i, j, l) in enumerate([(0, 0, 1), (0, 0, 2)]):
        q = expected[t] / (powers[i] * powers[j] + powers[j] * powers[l] + powers[l] * powers[i])
        assert abs(float(result.reduced[t]) - q) <= TOLERANCE * abs(q)
    assert abs(float(result.reduced[2])) <= TOLERANCE


def test_reduced_bispectrum_of_a_field_without_power_is_nan_with_a_warning(device):
    field = torch.zeros(2, 6, 6, 6, dtype=torch.float64, device=device)
    with pytest.warns(UserWarning, match=r"Q is undefined \(NaN\) for 4 configurations.*\(0, 0, 0\)"):
        result = bispectrum(field, 30.0)
    assert result.shells.shape[0] == 4
    assert torch.isnan(result.reduced).all() and (result.bispectrum == 0).all()


def test_triangles_closing_only_modulo_the_grid_are_not_counted(device):
    """One wave at 2 x (2 pi / L units) on a 6^3 grid: three copies of it add up to 6 x, one
    grid period, so the sum over the cells of I^3 alone (the shell-product estimator without
    the half-cell shifts) gives V^2 A^3 cos(3 phi) / (4 n_triangles) in the shell [1.5, 2.5);
    no geometric triangle of the shell holds the wave three times (2x + 2x + 2x != 0), so B
    is zero. The same wave on a 7^3 grid (no such closure) gives zero as well."""
    side, amplitude, phase = 30.0, 1.5, 0.2
    for n in (6, 7):
        field = _plane_waves((n, n, n), [((2, 0, 0), amplitude, phase)]).to(device)
        k_fundamental = 2 * math.pi / side
        result = bispectrum(field, side, bins=[1.5 * k_fundamental, 2.5 * k_fundamental], triangles=[(0, 0, 0)])
        aliased = side**6 * amplitude**3 * math.cos(3 * phase) / (4 * int(result.triangles[0]))
        assert abs(float(result.bispectrum[0])) <= TOLERANCE * abs(aliased), (n, float(result.bispectrum[0]), aliased)


def test_poisson_shot_noise_of_uniform_particles(device):
    """Particles thrown uniformly at random onto the cells (NGP counts, a multinomial of
    N_p draws): for k1 + k2 + k3 = 0, none zero, E[delta_k1 delta_k2 delta_k3] = N^3 / N_p^2
    exactly (only the terms of one particle taken three times survive the average), i.e.
    E[B] = (V / N_p)^2 = S^2, and E[P] = S: with the noise subtracted (S (P1 + P2 + P3)
    with the P_n shot-noise subtracted, plus S^2) the expectation is 0.

    200 independent realisations; the mean of each configuration's B is compared with its
    expectation within 5 standard errors (the sample standard deviation / sqrt(200); B is
    a cubic polynomial in the counts, so its moments are finite and the mean close to
    normal: a false failure has a probability of order 1e-6 per configuration, and the
    seed is fixed). The bound is ~0.1 S^2, so leaving out S^2, or subtracting the
    measured P instead of the noise-subtracted P (an error of -3 S^2), fails."""
    n, box, particles, realisations = 8, 80.0, 32, 200
    counts = np.random.default_rng(7).multinomial(particles, np.full(n**3, 1.0 / n**3), size=realisations)
    delta = torch.tensor(counts.reshape(realisations, n, n, n) * n**3 / particles - 1.0, device=device)
    k_fundamental = 2 * math.pi / box
    bins = [0.5 * k_fundamental, 2.5 * k_fundamental, 4 * k_fundamental]
    noise = box**3 / particles
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (4000 transforms of 8^3: a thread pool costs more than it gives)
    try:
        raw = bispectrum(delta, box, bins=bins)
        subtracted = bispectrum(delta, box, bins=bins, n_particles=particles)
    finally:
        torch.set_num_threads(threads)
    for result, expected in ((raw, noise**2), (subtracted, 0.0)):
        mean = result.bispectrum.mean(0).cpu().numpy()
        error = result.bispectrum.std(0).cpu().numpy() / math.sqrt(realisations)
        assert (np.abs(mean - expected) <= 5 * error).all(), (mean / noise**2, error / noise**2, expected)
        assert (5 * error < 0.2 * noise**2).all(), "the test could not tell S^2 from 0"
    # the subtraction itself, exactly: P - S in each shell, B - S (P1 + P2 + P3) - S^2
    _close(subtracted.power, (raw.power - noise).cpu().numpy(), "P - S")
    _close(subtracted.bispectrum, (raw.bispectrum - noise * subtracted.power.sum(-1) - noise**2).cpu().numpy(),
           "B - S (P1 + P2 + P3) - S^2")
    same = bispectrum(delta[:3], box, bins=bins, shot_noise=noise)
    _close(same.bispectrum, subtracted.bispectrum[:3].cpu().numpy(), "shot_noise = V / n_particles")


def test_gradcheck(device):
    """float64, a 6 x 5 x 4 mesh of unequal cells whose configurations are evaluated with
    half-cell shifts along all three axes; the window, the shot noise and Q included."""
    shape, box = (6, 5, 4), (30.0, 25.0, 20.0)
    field = _random_field(shape, batch=1, seed=4)[0].to(device).requires_grad_()

    def measured(x):
        result = bispectrum(x, box, window="cic", n_particles=50)
        return result.bispectrum, result.reduced, result.power

    result = bispectrum(field, box)
    assert _aliased(result, shape, box)
    torch.autograd.gradcheck(measured, (field,), fast_mode=True)
    # the backward (which recomputes the shell fields) is differentiable too
    torch.autograd.gradgradcheck(lambda x: bispectrum(x, box).bispectrum, (field,), fast_mode=True)


def test_torch_func_grad_equals_autograd(device):
    field = _random_field((7, 6, 6), batch=1, seed=6)[0].to(device)

    def loss(x):
        return (bispectrum(x, 30.0, window="cic").bispectrum ** 2).sum()

    leaf = field.clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(leaf), leaf)
    _close(torch.func.grad(loss)(field), expected.cpu().numpy(), "torch.func.grad")


def test_jacrev_equals_autograd_rows(device):
    """torch.func.jacrev (vmap over the cotangents of the backward) gives the rows of
    autograd, with the default configurations and given ones (a third shell in any order).
    It raised a vmap error in the backward's in-place sums."""
    field = _random_field((8, 8, 8), batch=1, seed=7)[0].to(device)
    for triangles in (None, [(2, 0, 1), (1, 1, 1), (1, 2, 2)]):  # (3 shells up to Nyquist)
        def measure(x, triangles=triangles):
            return bispectrum(x, 32.0, bins=3, triangles=triangles).bispectrum.reshape(-1)[:3]

        jacobian = torch.func.jacrev(measure)(field)
        leaf = field.clone().requires_grad_()
        values = measure(leaf)
        rows = torch.stack([torch.autograd.grad(values[i], leaf, retain_graph=True)[0] for i in range(len(values))])
        assert float(rows.abs().max()) > 0
        _close(jacobian, rows.cpu().numpy(), "jacrev")


def test_gradient_of_a_batch_matches_brute_force():
    """The gradient of a loss of B in each member of a batch against the brute-force sum
    differentiated by torch (the oracle's DFT taken with torch.fft, the triples the same)."""
    shape, box = (7, 6, 6), (35.0, 30.0, 33.0)
    field = _random_field(shape, batch=2, seed=9).requires_grad_()
    result = bispectrum(field, box)
    loss = (result.bispectrum**2 * torch.arange(1.0, result.bispectrum.shape[1] + 1, dtype=torch.float64)).sum()
    (grad,) = torch.autograd.grad(loss, field)

    edges = result.edges.numpy()
    reps, shell = _modes(shape, box, edges)
    transform = torch.fft.fftn(field, dim=(-3, -2, -1))
    values = []
    for i, j, l in result.shells.tolist():
        r1, r2 = reps[shell == i], reps[shell == j]
        r3 = -(r1[:, None, :] + r2[None, :, :])
        k3 = np.linalg.norm(r3 * (2 * np.pi / np.asarray(box)), axis=-1)
        first, second = np.nonzero((np.searchsorted(edges, k3, side="right") - 1 == l) & (k3 > 0))
        picks = [torch.as_tensor(r % np.asarray(shape)) for r in (r1[first], r2[second], r3[first, second])]
        product = math.prod(transform[:, p[:, 0], p[:, 1], p[:, 2]] for p in picks)
        values.append(np.prod(box) ** 2 / np.prod(shape) ** 3 * product.mean(-1).real)
    oracle = torch.stack(values, -1)
    _close(result.bispectrum, oracle.detach().numpy(), "B")
    oracle_loss = (oracle**2 * torch.arange(1.0, oracle.shape[1] + 1, dtype=torch.float64)).sum()
    (expected,) = torch.autograd.grad(oracle_loss, field)
    _close(grad, expected.numpy(), "d loss / d field")


@pytest.mark.parametrize("field,message", [
    (torch.zeros(6, 6), "`field` must be a real tensor of shape (nx, ny, nz) or (B, nx, ny, nz)"),
    (torch.zeros(1, 1, 6, 6, 6), "`field` must be a real tensor"),
    (torch.zeros(6, 6, 6, dtype=torch.complex128), "`field` must be a real tensor"),
    (torch.zeros(6, 6, 6, dtype=torch.int64), "`field` must be a real tensor"),
    (torch.full((6, 6, 6), math.nan), "`field` contains NaN or infinite values"),
    (torch.tensor([[[math.inf]]]).expand(6, 6, 6), "`field` contains NaN or infinite values"),
])
def test_bad_fields(field, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bispectrum(field, 30.0)


def test_bad_arguments():
    field = _random_field((6, 6, 6), batch=1)[0]
    box = 30.0
    k_fundamental = 2 * math.pi / box
    k_nyquist = 3 * k_fundamental
    cases = [
        (dict(bins=[0.1, 0.3, k_nyquist * 1.01]), r"`bins` must lie in \(0, k_Nyquist\] with k_Nyquist = 0.628"),
        (dict(bins=[-0.1, 0.3]), r"`bins` must lie in \(0, k_Nyquist\]"),
        (dict(bins=[0.3, 0.2]), "`bins` must be None, a positive int or at least 2 finite increasing bin edges"),
        (dict(bins=0), "`bins` must be a positive number of bins"),
        (dict(bins="5"), "`bins` must be None"),
        # a shell between the lengths 1 and sqrt 2 (2 pi / L units) holds no mode
        (dict(bins=[0.5 * k_fundamental, 1.1 * k_fundamental, 1.3 * k_fundamental, 2.5 * k_fundamental]),
         r"1 of the shells the configurations use hold no mode of the 6x6x6 mesh \(h/Mpc: \[0.2304, 0.2723\)"),
        (dict(triangles=[(0, 1, 2)]), r"`triangles` must be None or a non-empty list of \(i, j, l\) shell indices, "
                                      r"integers in \[0, 2\)"),
        (dict(triangles=[(0, 1)]), "`triangles` must be"),
        (dict(triangles=[]), "`triangles` must be"),
        (dict(triangles=[(0.0, 1.0, 1.0)]), "`triangles` must be"),
        (dict(triangles=[(0, -1, 1)]), "`triangles` must be"),
        (dict(triangles=3), "`triangles` must be"),
        # the unit vectors (shell [0.5, 1.2)) close no triangle among themselves, nor with a
        # third side in [1.5, 1.9): |k1 + k2| of two unit vectors is 0, sqrt 2 or 2
        (dict(bins=[0.5 * k_fundamental, 1.2 * k_fundamental, 1.5 * k_fundamental, 1.9 * k_fundamental],
              triangles=[(0, 0, 2), (0, 0, 0), (0, 0, 1)]),
         r"2 of the configurations in `triangles` have no closed triangle on this mesh \(\(0, 0, 2\), \(0, 0, 0\);"),
        (dict(shot_noise=1.0, n_particles=10), "pass at most one of `shot_noise` and `n_particles`"),
        (dict(n_particles=0), "`n_particles` must be a positive integer"),
        (dict(shot_noise=math.inf), "`shot_noise` must be a finite number"),
        (dict(window="quadratic"), "bispectrum: `window` must be one of"),
        (dict(window="tsc", compensate_cic=True), "contradicts"),
        (dict(mesh=LocalMesh((6, 6, 5))), r"does not match this rank's block \(6, 6, 5\)"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            bispectrum(field, box, **options)
    with pytest.raises(ValueError, match="`box_size` must be positive"):
        bispectrum(field, (30.0, -1.0, 30.0))
    with pytest.raises(TypeError, match="`mesh` must be None or a mesh object"):
        bispectrum(field, box, mesh=(6, 6, 6))
    # default configurations without any closed triangle (one shell of the unit vectors)
    with pytest.raises(ValueError, match="no configuration of the shells"):
        bispectrum(field, box, bins=[0.5 * k_fundamental, 1.2 * k_fundamental])


# ----------------------------------------------------------------------------- the layer
# torchpm.nn.BispectrumEstimator builds the tables once; its oracle is the function above
# (itself checked against the brute-force sum): the same results to rounding.

LAYER_CASES = [
    ((6, 6, 6), 30.0, dict(window="cic", n_particles=200)),
    ((7, 6, 5), (35.0, 30.0, 20.0), dict(bins=3, shot_noise=2.0)),
    ((9, 6, 10), (45.0, 40.0, 30.0), dict(bins=3, triangles=[(2, 0, 1), (1, 1, 1), (2, 2, 2)], window="tsc")),
]


def _layer(shape, box, dtype=torch.float64, **options):
    from torchpm.nn import BispectrumEstimator

    return BispectrumEstimator(shape, box, dtype=dtype, **options)


def _same_result(got, expected, tolerance, what):
    """Every field of two Bispectrum results: the floating ones within ``tolerance`` of the
    largest value, the integer ones equal."""
    for name in ("k", "bispectrum", "reduced", "power", "edges"):
        value = getattr(got, name)
        _close(value.double(), getattr(expected, name).detach().cpu().numpy(), f"{what}: {name}", tolerance)
    for name in ("triangles", "shells"):
        assert torch.equal(getattr(got, name).cpu(), getattr(expected, name).cpu()), (what, name)


@pytest.mark.parametrize("shape,box,options", LAYER_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_equals_the_function(device, shape, box, options, dtype):
    """Shapes odd and even, cubic and not, default and given configurations, windows and
    noise; a batch and a single field. float32: the layer's results are the function's
    (measured in float64) rounded to float32, so within 2^-23 of the largest value."""
    field = _random_field(shape, batch=2, seed=11).to(device=device, dtype=dtype)
    layer = _layer(shape, box, dtype=dtype, **options).to(device)
    tolerance = TOLERANCE if dtype == torch.float64 else 2.0**-23
    got = layer(field)
    assert got.bispectrum.dtype == dtype and got.k.dtype == dtype and got.bispectrum.device.type == device.type
    _same_result(got, bispectrum(field, box, **options), tolerance, "batch")
    single = layer(field[1])
    assert single.bispectrum.shape == got.bispectrum.shape[1:] and single.power.shape == got.power.shape[1:]
    _same_result(single, bispectrum(field[1], box, **options), tolerance, "single field")


def test_layer_gradients():
    """float64 gradcheck through the layer (6 x 5 x 4, half-cell shifts along every axis;
    window, noise, Q, P), and its gradient of a loss equal to the function's."""
    shape, box = (6, 5, 4), (30.0, 25.0, 20.0)
    options = dict(window="cic", n_particles=50)
    layer = _layer(shape, box, **options)
    field = _random_field(shape, batch=1, seed=4).requires_grad_()

    def measured(x):
        result = layer(x)
        return result.bispectrum, result.reduced, result.power

    torch.autograd.gradcheck(measured, (field,), fast_mode=True)
    # (second derivatives: the function's gradgradcheck runs the same code)

    def loss(result):
        weights = torch.arange(1.0, result.bispectrum.shape[-1] + 1, dtype=torch.float64)
        return (result.bispectrum**2 * weights).sum() + (result.reduced * weights).sum() + result.power.sum()

    (got,) = torch.autograd.grad(loss(layer(field)), field)
    (expected,) = torch.autograd.grad(loss(bispectrum(field, box, **options)), field)
    _close(got, expected.numpy(), "d loss / d field, layer against function")


def test_layer_under_torch_func_grad():
    shape, box = (7, 6, 6), 30.0
    layer = _layer(shape, box, window="cic")
    field = _random_field(shape, batch=1, seed=6)[0]

    def loss(x):
        return (layer(x).bispectrum ** 2).sum()

    leaf = field.clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(leaf), leaf)
    _close(torch.func.grad(loss)(field), expected.numpy(), "torch.func.grad through the layer")


def test_layer_counts_once(monkeypatch):
    """The triangle counts (the plan's ``counts``) run at construction only: never in a
    forward or backward pass; the function runs them at every call."""
    import torchpm.bispectrum as module

    calls = []
    original = module._TrianglePlan.counts

    def counted(self, k_magnitude):
        calls.append(self.count)
        return original(self, k_magnitude)

    monkeypatch.setattr(module._TrianglePlan, "counts", counted)
    shape, box = (6, 6, 6), 30.0
    layer = _layer(shape, box)
    assert len(calls) == 1
    field = _random_field(shape, batch=1, seed=2).requires_grad_()
    for _ in range(3):
        (layer(field).bispectrum ** 2).sum().backward()
    assert len(calls) == 1, "the layer's forward or backward recomputed the triangle counts"
    bispectrum(field, box)
    bispectrum(field, box)
    assert len(calls) == 3, "the check counts the function's calls"


def test_layer_buffers_follow_to_and_state_dict_is_empty():
    """The buffers are non-persistent (an empty state_dict, loadable); ``.to(float64)`` makes
    a float32 layer take float64 fields and give the float64 layer's B, Q and P; the
    tables it measures with are integers, so a round trip through float16 changes B, Q
    and P not at all (only the reported k and edges are rounded)."""
    shape, box = (7, 6, 5), (35.0, 30.0, 20.0)
    options = dict(window="cic", bins=3)
    layer = _layer(shape, box, dtype=torch.float32, **options)
    reference = _layer(shape, box, **options)
    assert len(list(layer.buffers())) > 10 and layer.state_dict() == {}
    layer.load_state_dict({})
    assert layer.k.dtype == torch.float32 and layer.edges.dtype == torch.float32
    field = _random_field(shape, batch=2, seed=8)
    expected = reference(field)
    with pytest.raises(ValueError, match=r"`field` must be torch.float32 \(the layer's dtype\), got torch.float64"):
        layer(field)
    layer.to(torch.float64)
    assert layer.dtype == torch.float64 and layer.k.dtype == torch.float64 and layer.triangles.dtype == torch.int64
    moved = layer(field)
    for name in ("bispectrum", "reduced", "power"):
        _close(getattr(moved, name), getattr(expected, name).numpy(), f"float32 layer moved to float64: {name}")
    # (the reported k and edges keep the float32 rounding they were held in)
    _same_result(moved, expected, 2.0**-23, "float32 layer moved to float64")
    with pytest.raises(ValueError, match="`field` must be torch.float64"):
        layer(field.float())
    reference.half().double()
    again = reference(field)
    for name in ("bispectrum", "reduced", "power"):
        assert torch.equal(getattr(again, name), getattr(expected, name)), name


def test_layer_refuses_fields_it_was_not_built_for():
    shape = (6, 6, 6)
    layer = _layer(shape, 30.0, dtype=torch.float32)
    good = torch.zeros(2, *shape)
    cases = [
        (good[..., :-1], r"`field` must be a tensor of shape \(B, 6, 6, 6\) or \(6, 6, 6\) \(the mesh the layer was "
                         r"built for\), got \(2, 6, 6, 5\)"),
        (good.unsqueeze(0), r"`field` must be a tensor of shape \(B, 6, 6, 6\)"),
        (good[0, 0], r"`field` must be a tensor of shape"),
        (good.tolist(), r"`field` must be a tensor of shape .* got list"),
        (good.double(), r"`field` must be torch.float32 \(the layer's dtype\), got torch.float64; convert the "
                        r"field, or the layer with .to\(torch.float64\)"),
        (good.to(torch.complex64), r"`field` must be a real torch.float32 tensor"),
        (good.to(torch.int32), r"`field` must be a real torch.float32 tensor"),
        (torch.zeros(2, *shape, device="meta"), r"`field` is on meta but the layer was built for cpu; move the field, "
                                                r"or the layer with .to\('meta'\)"),
        (torch.full(shape, math.nan), r"`field` contains NaN or infinite values"),
    ]
    for field, message in cases:
        with pytest.raises(ValueError, match="BispectrumEstimator: " + message):
            layer(field)
    assert layer(_random_field(shape, seed=1).float()).bispectrum.shape == (2, layer.shells.shape[0])


def test_layer_warns_at_the_callers_line():
    """Q undefined (a field without power): the warning names the line that called the layer."""
    layer = _layer((6, 6, 6), 30.0)
    with pytest.warns(UserWarning, match=r"BispectrumEstimator: the reduced bispectrum Q is undefined") as caught:
        result = layer(torch.zeros(6, 6, 6, dtype=torch.float64))
    assert caught[0].filename == __file__, caught[0].filename
    assert torch.isnan(result.reduced).all()


def test_layer_bad_arguments():
    from torchpm.nn import BispectrumEstimator

    shape, box = (6, 6, 6), 30.0
    k_nyquist = math.pi * 6 / 30.0
    cases = [
        (dict(bins=[0.1, 0.3, k_nyquist * 1.01]), ValueError, r"BispectrumEstimator: `bins` must lie in \(0, k_Nyq"),
        (dict(triangles=[(0, 1, 5)]), ValueError, "BispectrumEstimator: `triangles` must be None or a non-empty"),
        (dict(window="quadratic"), ValueError, "BispectrumEstimator: `window` must be one of"),
        (dict(window="tsc", compensate_cic=True), ValueError, "BispectrumEstimator: `compensate_cic=True` contradicts"),
        (dict(n_particles=0), ValueError, "BispectrumEstimator: `n_particles` must be a positive integer"),
        (dict(dtype=torch.int64), ValueError, "BispectrumEstimator: `dtype` must be a real floating-point"),
        (dict(mesh=LocalMesh((6, 6, 5))), ValueError, r"BispectrumEstimator: `mesh` has the global shape \(6, 6, 5\)"),
        (dict(mesh=(6, 6, 6)), TypeError, "BispectrumEstimator: `mesh` must be None or a torchpm.distributed"),
        (dict(box_size=-1.0), ValueError, "BispectrumEstimator: `box_size` must be positive"),
    ]
    for options, kind, message in cases:
        arguments = dict(box_size=box) | options
        with pytest.raises(kind, match=message):
            BispectrumEstimator(shape, **arguments)
    with pytest.raises(ValueError, match="`shape`"):
        BispectrumEstimator((6, 6), box)
    # decided from the counts, at construction
    k_fundamental = 2 * math.pi / box
    with pytest.raises(ValueError, match="BispectrumEstimator: no configuration of the shells"):
        BispectrumEstimator(shape, box, bins=[0.5 * k_fundamental, 1.2 * k_fundamental])
