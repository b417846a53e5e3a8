"""Spherical-overdensity masses (torchpm.halos.spherical_overdensity): against a numpy
brute force over every particle (sorted distances, the first k with k m < rho 4/3 pi
r_k^3), hand-built spheres, the search's doubling and chunking, gradients, the run-level
helper's thresholds, and errors naming the argument. The process-grid cases are in
test_distributed_halos.py (case_spherical_overdensity)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torchpm
from torchpm.halos import CRITICAL_DENSITY_MSUN, spherical_overdensity, spherical_overdensity_masses

BOX = (30.0, 24.0, 18.0)


def brute_force(points, centres, box, density, radius, mass=1.0):
    """Particles inside each centre's sphere from all distances, sorted: the search radius
    ``radius`` doubles (up to half the shortest side) while the next particle beyond it
    could be above the threshold; then the last k with k m >= density 4/3 pi r_k^3."""
    box = np.asarray(box)
    limit = 0.5 * box.min()
    radii = np.broadcast_to(np.asarray(radius, dtype=np.float64), (len(centres),))
    out = []
    for centre, start in zip(centres, radii):
        offset = points - centre
        offset -= box * np.round(offset / box)
        r = np.sort(np.sqrt((offset**2).sum(1)))
        search = min(start, limit)
        while True:
            inside = r[r <= search]
            if (len(inside) + 1) * mass < density * 4.0 / 3.0 * np.pi * search**3:
                break
            assert search < limit, "open at half the box"
            search = min(2 * search, limit)
        above = np.nonzero(np.arange(1, len(inside) + 1) * mass >= density * 4.0 / 3.0 * np.pi * inside**3)[0]
        out.append(int(above[-1]) + 1 if len(above) else 0)
    return np.array(out)


def clustered(seed, n=6000, box=BOX, sigma=0.3):
    """Half uniform, half in 8 tight blobs (two across box faces); the blob centres."""
    rng = np.random.default_rng(seed)
    box = np.asarray(box)
    centres = rng.uniform(0, box, (8, 3))
    centres[0] = [0.1, 0.2, box[2] - 0.1]
    centres[1] = [box[0] - 0.05, 12.0, 9.0]
    blobs = centres[rng.integers(0, 8, n // 2)] + rng.normal(0, sigma, (n // 2, 3))
    points = np.concatenate([rng.uniform(0, box, (n - n // 2, 3)), blobs]) % box
    return points, centres


@pytest.mark.parametrize("delta", [50.0, 200.0, 1000.0])
def test_matches_the_brute_force(delta):
    points, centres = clustered(1)
    mean = len(points) / math.prod(BOX)
    expected = brute_force(points, centres, BOX, delta * mean, 1.0)
    got = spherical_overdensity(torch.tensor(points), torch.tensor(centres), BOX, delta * mean, radius=1.0)
    assert got.members.tolist() == expected.tolist()
    assert expected.max() > 50, "the blobs must hold spheres"
    np.testing.assert_array_equal(got.masses.numpy(), expected)
    radii = (3.0 * expected / (4.0 * np.pi * delta * mean)) ** (1.0 / 3.0)
    np.testing.assert_allclose(got.radii.numpy(), radii, rtol=1e-14)


def test_batch_empty_slots_masked_centres_and_mass_unit():
    """Two members with empty slots (id -1, anywhere) and a mask; the particle mass is the
    masses' unit and enters the threshold as mass per volume."""
    (a, ca), (b, cb) = clustered(2, n=3000), clustered(3, n=2000)
    width = 3100
    positions = torch.full((2, width, 3), 5.0, dtype=torch.float64)
    ids = torch.full((2, width), -1)
    for m, pts in enumerate((a, b)):
        slots = torch.randperm(width, generator=torch.Generator().manual_seed(m))[: len(pts)]
        positions[m, slots] = torch.tensor(pts)
        ids[m, slots] = torch.arange(len(pts))
    centres = torch.tensor(np.stack([ca, cb]))
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 3] = False
    mass, density = 2.5e10, 200.0 * 2.5e10 * 3000 / math.prod(BOX)
    radius = torch.linspace(0.2, 3.0, 16, dtype=torch.float64).reshape(2, 8)  # one per centre
    got = spherical_overdensity(positions, centres, BOX, density, radius=radius, particle_mass=mass, ids=ids,
                                valid=valid)
    for m, (pts, cs) in enumerate(((a, ca), (b, cb))):
        expected = brute_force(pts, cs, BOX, density / mass, radius[m].numpy())
        if m == 1:
            expected[3] = 0
        assert got.members[m].tolist() == expected.tolist()
        np.testing.assert_allclose(got.masses[m].numpy(), expected * mass, rtol=1e-15)


def test_hand_built_spheres():
    """Particles at distances 1, 2, ..., 10 from the centre (random directions), m = 1:
    the k-th is below when k < rho 4/3 pi k^3, i.e. k^2 > 3 / (4 pi rho). rho = 0.05:
    k^2 > 4.77, the 3rd ends the sphere (2 inside); rho = 0.2: k^2 > 1.19, the 2nd (1
    inside); rho = 0.3: k^2 > 0.80, the 1st (none). The search starts at 0.5, inside the
    first particle, where an empty sphere must not count as closed."""
    rng = np.random.default_rng(4)
    directions = rng.normal(size=(10, 3))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    centre = np.array([50.0, 50.0, 50.0])
    points = torch.tensor(centre + directions * np.arange(1, 11)[:, None])
    box = 200.0
    for density, inside in ((0.05, 2), (0.2, 1), (0.3, 0)):
        got = spherical_overdensity(points, torch.tensor(centre[None]), box, density, radius=0.5)
        assert got.members.shape == (1,)
        assert int(got.members[0]) == inside, density
        assert math.isclose(float(got.radii[0]), (3 * inside / (4 * math.pi * density)) ** (1 / 3), rel_tol=1e-14)
    # a dense core: 5 particles at 0.1 and the shells beyond; rho = 1: 5 * 1 >= 4/3 pi 0.001,
    # the 6th at distance 1: 6 >= 4.19 still inside, the 7th at 2: 7 < 33.5: six inside
    core = centre + directions[:5] * 0.1
    points = torch.tensor(np.concatenate([core, centre + directions * np.arange(1, 11)[:, None]]))
    assert int(spherical_overdensity(points, torch.tensor(centre[None]), box, 1.0, radius=3.0).members[0]) == 6
    # a sparse centre inside a dense shell: one particle at 0.5 (1 < 5 * 4/3 pi 0.125 = 2.6,
    # below) and 50 at 1 (k >= 20.9 above for k = 21..51): the outermost sphere holds 51,
    # the first one grown from the centre would hold none
    shell = centre + rng.normal(size=(50, 3)) * 0 + directions[rng.integers(0, 10, 50)] * 1.0
    points = torch.tensor(np.concatenate([centre[None] + directions[:1] * 0.5, shell]))
    got = spherical_overdensity(points, torch.tensor(centre[None]), box, 5.0, radius=1.5)
    assert int(got.members[0]) == 51


def test_low_thresholds_many_centres_search_radii_and_chunks():
    """Spheres wider than a cell of the table (low thresholds: the 27 neighbour cells must
    hold them), centres anywhere (outside [0, L) too), start radii from tiny to near the
    limit, and candidate chunks of a few pairs: the brute force every time."""
    points, centres = clustered(5)
    rng = np.random.default_rng(9)
    extra = rng.uniform(-1.0, 2.0, (40, 3)) * np.asarray(BOX)  # (wrapped by the function)
    centres = np.concatenate([centres, extra])
    x, c = torch.tensor(points), torch.tensor(centres)
    mean = len(points) / math.prod(BOX)
    for delta in (3.0, 10.0, 200.0):
        for radius, chunk in ((0.05, 1 << 20), (0.3, 97), (2.0, 1 << 20), (8.5, 5000)):
            got = spherical_overdensity(x, c, BOX, delta * mean, radius=radius, chunk_size=chunk)
            expected = brute_force(points, centres, BOX, delta * mean, radius)
            assert got.members.tolist() == expected.tolist(), (delta, radius, chunk)


def test_float32_positions_and_unbatched_shapes():
    points, centres = clustered(6)
    density = 200.0 * len(points) / math.prod(BOX)
    got = spherical_overdensity(torch.tensor(points, dtype=torch.float32), torch.tensor(centres, dtype=torch.float32),
                                BOX, density, radius=1.0)
    assert got.members.shape == (8,) and got.masses.dtype == torch.float32
    expected = brute_force(points.astype(np.float32).astype(np.float64), centres.astype(np.float32), BOX, density,
                           1.0)
    assert got.members.tolist() == expected.tolist()


def test_gradients_in_the_threshold_and_the_particle_mass():
    points, centres = clustered(7)
    density = torch.tensor(200.0 * len(points) / math.prod(BOX), dtype=torch.float64, requires_grad=True)
    mass = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(8, dtype=torch.bool)
    valid[2] = False  # a zero mass: no NaN from the cube root's slope at 0
    got = spherical_overdensity(torch.tensor(points), torch.tensor(centres), BOX, density * mass, radius=1.0,
                                particle_mass=mass, valid=valid)
    (d_density, d_mass) = torch.autograd.grad(got.radii.sum() + got.masses.sum(), (density, mass))
    n = got.members.double()
    # R = (3 n m / (4 pi rho m))^(1/3) with rho m the threshold: dR/drho = -R / (3 rho), and
    # the masses n m: d/dm = n (the threshold's m cancels in R)
    assert torch.isfinite(d_density) and torch.isfinite(d_mass)
    torch.testing.assert_close(d_density, -(got.radii / (3 * density)).sum().detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(d_mass, n.sum(), rtol=1e-12, atol=0)


def test_run_level_masses_take_the_mean_and_critical_thresholds():
    """At a = 0.55 (the critical density's a^3 E(a)^2 differs from other powers of a
    there), each halo searched out to twice the radius of its FoF mass at the threshold."""
    sim = torchpm.Simulation(n_particles=16, box_size=32.0, mesh_factor=2, a_start=0.1, steps=8, dtype=torch.float64)
    state = sim(sim.white_noise(seed=2), until=0.55)
    assert abs(float(state.a) - 0.55) < 1e-12
    catalog = torchpm.find_halos(sim, state, min_members=5)
    assert int((catalog.labels >= 0).sum()) >= 3
    omega_m = float(sim.cosmology.Omega_m)
    particle_mass = omega_m * CRITICAL_DENSITY_MSUN * 32.0**3 / 16**3
    points = state.positions[0].numpy()
    rows = (catalog.labels[0] >= 0).numpy()
    for reference, rho in (("mean", omega_m * CRITICAL_DENSITY_MSUN),
                           # flat LambdaCDM without radiation: rho_crit(a) a^3 = rho_crit,0 (Omega_m + Omega_L a^3)
                           ("critical", CRITICAL_DENSITY_MSUN * (omega_m + (1 - omega_m) * float(state.a) ** 3))):
        got = spherical_overdensity_masses(sim, state, catalog, delta=200.0, reference=reference)
        density = 200.0 * rho / particle_mass  # particles per (Mpc/h)^3
        radius = 2.0 * (3.0 * catalog.members[0].numpy()[rows] / (4.0 * np.pi * density)) ** (1.0 / 3.0)
        expected = brute_force(points, catalog.positions[0].numpy()[rows], (32.0,) * 3, density, radius)
        assert got.members[0][rows].tolist() == expected.tolist(), reference
        assert (got.members[0][~rows] == 0).all()
        assert expected.max() > 0, reference
        np.testing.assert_allclose(got.masses[0][rows].numpy(), expected * particle_mass, rtol=1e-12)
    # the critical density is above the mean, so M200c <= M200m
    m200m = spherical_overdensity_masses(sim, state, catalog).masses
    m200c = spherical_overdensity_masses(sim, state, catalog, reference="critical").masses
    assert bool((m200c <= m200m).all()) and bool((m200m > 0).any())


def test_errors_name_the_argument():
    points, centres = clustered(8, n=500)
    x, c = torch.tensor(points), torch.tensor(centres)
    density = 200.0 * 500 / math.prod(BOX)
    cases = [
        (dict(radius=-1.0), "`radius`"),
        (dict(radius=torch.ones(3)), "`radius`"),
        (dict(radius="1"), "`radius`"),
        (dict(positions=x[..., :2]), "`positions`"),
        (dict(centres=c[:, :2]), "`centres`"),
        (dict(centres=c.unsqueeze(0).expand(2, -1, -1)), "`centres` must have the positions' batch size"),
        (dict(density=-1.0), "`density`"),
        (dict(density=float("nan")), "`density`"),
        (dict(particle_mass=0.0), "`particle_mass`"),
        (dict(radius=0.0), "`radius`"),
        (dict(valid=torch.ones(3, dtype=torch.bool)), "`valid`"),
        (dict(ids=torch.zeros(500, dtype=torch.int32)), "`ids`"),
        (dict(chunk_size=0), "`chunk_size`"),
    ]
    for change, message in cases:
        arguments = dict(positions=x, centres=c, box_size=BOX, density=density, radius=1.0)
        arguments.update(change)
        positional = [arguments.pop(key) for key in ("positions", "centres", "box_size", "density")]
        with pytest.raises(ValueError, match=message):
            spherical_overdensity(*positional, **arguments)
    nan_centres = c.clone()
    nan_centres[0, 0] = float("nan")
    with pytest.raises(ValueError, match="`centres` must be finite"):
        spherical_overdensity(x, nan_centres, BOX, density, radius=1.0)
    # below the box's mean density no sphere closes inside half the box
    with pytest.raises(ValueError, match="still open at half the box"):
        spherical_overdensity(x, c, BOX, 0.5 * 500 / math.prod(BOX), radius=1.0)
    sim = torchpm.Simulation(4, 16.0, steps=1)
    state = sim(sim.white_noise())
    catalog = torchpm.find_halos(sim, state, min_members=1)
    with pytest.raises(ValueError, match="`reference`"):
        spherical_overdensity_masses(sim, state, catalog, reference="virial")
    with pytest.raises(ValueError, match="`delta`"):
        spherical_overdensity_masses(sim, state, catalog, delta=0)
    with pytest.raises(ValueError, match="`catalog`"):
        spherical_overdensity_masses(sim, state, catalog.positions)
