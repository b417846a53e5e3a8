"""Friends-of-friends halos on one device (torchpm.halos); the grid cases are in
test_distributed_halos.py.

Oracles: scipy's periodic cKDTree ``query_pairs`` and ``connected_components`` (exact
equality of the partitions, labels compared as the smallest index of each component);
hand cases (pairs at b (1 -+ 1e-6) across each periodic face, a chain around the box,
a halo across a box corner with its centre by hand); numpy sums for the catalogue;
gradcheck for the centres, velocities and masses.
"""

import math

import numpy as np
import pytest
import torch

import torchpm
from torchpm.halos import (HaloCatalog, find_halos, friends_of_friends, halo_catalog, linking_distance,
                           spherical_overdensity)

spatial = pytest.importorskip("scipy.spatial")
csgraph = pytest.importorskip("scipy.sparse.csgraph")
sparse = pytest.importorskip("scipy.sparse")

BOX = (40.0, 32.0, 24.0)


def spacing_b(box, n, length):
    """The linking distance in Mpc/h, here (not ``linking_distance``: an oracle that used
    it would share its error): ``length`` times the mean spacing ``(V / n)^(1/3)``."""
    return length * (float(np.prod(np.broadcast_to(np.asarray(box, dtype=float), 3))) / n) ** (1 / 3)


def oracle_labels(points, box, b):
    """Smallest index of each particle's FoF group: scipy's periodic pairs within b and
    their connected components."""
    points = np.mod(np.asarray(points, dtype=np.float64), box)
    points = np.where(points >= np.asarray(box), 0.0, points)  # (np.mod may round up to L)
    n = len(points)
    pairs = spatial.cKDTree(points, boxsize=box).query_pairs(b, output_type="ndarray")
    graph = sparse.coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    _, component = csgraph.connected_components(graph, directed=False)
    smallest = np.full(component.max() + 1, n)
    np.minimum.at(smallest, component, np.arange(n))
    return smallest[component]


def clustered(seed, n, box=BOX, blobs=8, sigma=0.8):
    """Half uniform, half in Gaussian blobs; the first blob on a box corner, the second on
    a face, so groups straddle the periodic edges. Not wrapped (FoF wraps)."""
    rng = np.random.default_rng(seed)
    box = np.asarray(box)
    centres = rng.uniform(0, box, (blobs, 3))
    centres[0] = [0.1, box[1] - 0.2, 0.05]
    centres[1] = [box[0] / 2, 0.0, box[2] / 2]
    members = centres[rng.integers(0, blobs, n // 2)] + rng.normal(0, sigma, (n // 2, 3))
    return np.concatenate([rng.uniform(0, box, (n - n // 2, 3)), members])


# ----------------------------------------------------------------------------- labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_and_clustered_particles_match_scipy(device, dtype):
    n = 4000
    batch = np.stack([np.random.default_rng(0).uniform(0, BOX, (n, 3)), clustered(1, n)])
    positions = torch.tensor(batch, dtype=dtype, device=device)
    as_given = positions.double().cpu().numpy()  # linked in float64 from the values as given
    for length in (0.2, 0.35):
        b = spacing_b(BOX, n, length)
        expected = np.stack([oracle_labels(p, BOX, b) for p in as_given])
        for chunk_size in (1 << 20, 1000, 7):
            labels = friends_of_friends(positions, BOX, length, chunk_size=chunk_size)
            assert labels.dtype == torch.int64 and labels.device == positions.device
            np.testing.assert_array_equal(labels.cpu().numpy(), expected)
    assert len(np.unique(expected[1])) < 0.8 * n  # the blobs make real groups


def test_evolved_simulation_particles_match_scipy(device):
    sim = torchpm.Simulation(n_particles=32, box_size=64.0, mesh_factor=1, a_start=0.1, steps=8).to(device)
    state = sim(sim.white_noise(seed=2))
    b = spacing_b(sim.box_size, sim.n_total, 0.2)
    expected = oracle_labels(state.positions[0].double().cpu().numpy(), sim.box_size, b)
    labels = friends_of_friends(state.positions, sim.box_size, 0.2, ids=state.ids)
    # the state's ids are the slot indices on one device: labels are oracle labels
    assert torch.equal(state.ids[0].cpu(), torch.arange(sim.n_total))
    np.testing.assert_array_equal(labels[0].cpu().numpy(), expected)
    sizes = np.bincount(expected)
    assert sizes.max() > 100, "the run made no halo to find"


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_pairs_at_the_linking_distance_across_each_face(device, axis):
    """Pairs at b (1 - 1e-6) link and at b (1 + 1e-6) do not, straddling the periodic
    face of each axis of a non-cubic box, and inside it."""
    n = 1000  # sets the mean separation only
    b = spacing_b(BOX, n, 0.2)
    length = BOX[axis]
    below, above = b * (1 - 1e-6), b * (1 + 1e-6)
    # (coordinate along `axis` of both particles, transverse shift of the pair)
    pairs = [((0.3 * below, length - 0.7 * below), 0.0),  # across the face: linked
             ((0.4 * above, length - 0.6 * above), 3 * b),  # across the face: not linked
             ((length / 2, length / 2 + below), 6 * b),  # inside: linked
             ((length / 2, length / 2 + above), 9 * b)]  # inside: not linked
    points = np.zeros((8, 3))
    for k, ((first, second), shift) in enumerate(pairs):
        for j, coordinate in enumerate((first, second)):
            points[2 * k + j] = [5.0 + shift] * 3
            points[2 * k + j, axis] = coordinate
    positions = torch.tensor(points, dtype=torch.float64, device=device)
    labels = friends_of_friends(positions, BOX, 0.2, n_particles=n)
    assert labels.tolist() == [0, 0, 2, 3, 4, 4, 6, 7]
    np.testing.assert_array_equal(labels.cpu().numpy(), oracle_labels(points, BOX, b))


def test_chain_around_the_box_is_one_group(device):
    """A chain along y with spacing 0.95 b closes around the periodic box; with one link
    stretched to 1.05 b it is still one group (the other way round), with two it splits."""
    n = 2000
    b = spacing_b(BOX, n, 0.2)
    count = int(math.ceil(BOX[1] / (0.95 * b)))
    spacing = BOX[1] / count  # <= 0.95 b: closes exactly
    y = np.arange(count) * spacing
    chain = np.stack([np.full(count, 5.0), y, np.full(count, 7.0)], 1)
    labels = friends_of_friends(torch.tensor(chain, device=device), BOX, 0.2, n_particles=n)
    assert labels.tolist() == [0] * count
    one_gap = chain.copy()
    one_gap[count // 2:, 1] += 1.2 * b - spacing  # one link of 1.2 b, the wrap link shortened
    one_gap[:, 1] = np.mod(one_gap[:, 1], BOX[1])
    labels = friends_of_friends(torch.tensor(one_gap, device=device), BOX, 0.2, n_particles=n)
    np.testing.assert_array_equal(labels.cpu().numpy(), oracle_labels(one_gap, BOX, b))
    assert labels.tolist() == [0] * count  # a ring with one link broken is still connected
    two_gaps = chain.copy()
    two_gaps[count // 3:, 1] += 0.2 * b
    two_gaps[2 * count // 3:, 1] += 0.2 * b
    expected = oracle_labels(two_gaps, BOX, b)
    labels = friends_of_friends(torch.tensor(two_gaps, device=device), BOX, 0.2, n_particles=n)
    np.testing.assert_array_equal(labels.cpu().numpy(), expected)
    assert len(set(labels.tolist())) == 2


def test_labels_are_the_smallest_id_and_empty_slots_are_skipped(device):
    """Custom ids: each label is the smallest id of its group; empty slots (id -1, even
    with NaN positions) get -1 and link nothing; min_members drops small groups; the
    unbatched call gives the batched call's first row."""
    n = 1500
    points = clustered(5, n)
    b = spacing_b(BOX, n, 0.2)
    expected = oracle_labels(points, BOX, b)
    rng = np.random.default_rng(1)
    ids = rng.permutation(10**12 + np.arange(n) * 7919)  # large, unordered
    positions = torch.tensor(points, device=device).unsqueeze(0)
    labels = friends_of_friends(positions, BOX, 0.2, ids=torch.tensor(ids, device=device).unsqueeze(0))[0]
    group_min = {}
    for index, group in enumerate(expected):
        group_min[group] = min(group_min.get(group, ids[index]), ids[index])
    assert labels.tolist() == [group_min[g] for g in expected]
    # empty slots among the particles
    padded = torch.full((1, n + 5, 3), float("nan"), dtype=torch.float64, device=device)
    padded_ids = torch.full((1, n + 5), -1, dtype=torch.int64, device=device)
    slots = torch.randperm(n + 5, generator=torch.Generator().manual_seed(0))[:n].to(device)
    padded[0, slots] = positions[0]
    padded_ids[0, slots] = torch.arange(n, device=device)
    labels = friends_of_friends(padded, BOX, 0.2, ids=padded_ids)
    assert labels[0, slots].tolist() == expected.tolist()
    assert (labels[padded_ids < 0] == -1).all()
    # min_members
    labels = friends_of_friends(torch.tensor(points, device=device), BOX, 0.2, min_members=4)
    sizes = np.bincount(expected, minlength=n)
    assert labels.tolist() == [int(g) if sizes[g] >= 4 else -1 for g in expected]


def test_arguments_are_checked():
    positions = torch.rand(2, 50, 3, dtype=torch.float64) * 10
    with pytest.raises(ValueError, match="`positions` must be a floating-point tensor of shape"):
        friends_of_friends(positions[..., :2], 10.0)
    with pytest.raises(ValueError, match="`positions` must be a floating-point tensor"):
        friends_of_friends((positions * 0).long(), 10.0)
    broken = positions.clone()
    broken[1, 3, 2] = float("inf")
    with pytest.raises(ValueError, match="`positions` must be finite, got 1 particles"):
        friends_of_friends(broken, 10.0)
    # far beyond the box: wrapping 1e31 keeps no digit of the position (every particle
    # was put in one group); an empty slot's position is not read
    broken[1, 3, 2] = 1e31
    for call in (lambda p: friends_of_friends(p, 10.0), lambda p: halo_catalog(p, torch.zeros(2, 50).long(), 10.0),
                 lambda p: spherical_overdensity(p, p[:, :2].clamp(0, 9), 10.0, 1.0, radius=1.0)):
        with pytest.raises(ValueError, match="`positions` must lie within 1e\\+06 box lengths of the box .* got 1 "
                                             "particles beyond"):
            call(broken)
    ids = torch.arange(50).expand(2, 50).clone()
    ids[1, 3] = -1
    assert friends_of_friends(broken, 10.0, ids=ids, n_particles=50)[1, 3] == -1
    broken[1, 3, 2] = 0.999e7  # (within the limit: wrapped)
    wrapped = positions.clone()
    wrapped[1, 3, 2] = float(torch.remainder(torch.tensor(0.999e7, dtype=torch.float64), 10.0))
    assert torch.equal(friends_of_friends(broken, 10.0), friends_of_friends(wrapped, 10.0))
    for length in (0.0, -0.2, float("nan"), True, "0.2"):
        with pytest.raises(ValueError, match="`linking_length` must be a positive number"):
            friends_of_friends(positions, 10.0, length)
    with pytest.raises(ValueError, match="at most a third of the shortest box side"):
        friends_of_friends(positions, (10.0, 10.0, 0.5), 0.2)  # b = 0.2 > 0.5 / 3
    with pytest.raises(ValueError, match="`box_size`"):
        friends_of_friends(positions, -1.0)
    with pytest.raises(ValueError, match=r"`ids` must be an int64 tensor of shape \(2, 50\)"):
        friends_of_friends(positions, 10.0, ids=torch.arange(50))
    with pytest.raises(ValueError, match="`ids` must be an int64 tensor"):
        friends_of_friends(positions, 10.0, ids=torch.zeros(2, 50, dtype=torch.int32))
    repeated = torch.arange(50).repeat(2, 1)
    repeated[1, 7] = 3
    with pytest.raises(ValueError, match="`ids` must be unique within each batch member, got id 3 twice in member 1"):
        friends_of_friends(positions, 10.0, ids=repeated)
    fewer = torch.arange(50).repeat(2, 1)
    fewer[0, :5] = -1
    with pytest.raises(ValueError, match=r"hold \[45, 50\] particles; pass `n_particles`"):
        friends_of_friends(positions, 10.0, ids=fewer)
    assert friends_of_friends(positions, 10.0, ids=fewer, n_particles=50).shape == (2, 50)
    for name in ("n_particles", "min_members", "chunk_size"):
        with pytest.raises(ValueError, match=f"`{name}` must be a positive integer"):
            friends_of_friends(positions, 10.0, **{name: 0})


def test_linking_distance_by_hand():
    # 1000 particles in a 10 Mpc/h cube: spacing 1; in a 10 x 20 x 40 box: V / n = 8, spacing 2
    assert linking_distance(10.0, 1000, 0.2) == pytest.approx(0.2, rel=1e-12)
    assert linking_distance((10.0, 20.0, 40.0), 1000, 0.25) == pytest.approx(0.5, rel=1e-12)
    assert linking_distance(10.0, 1000) == pytest.approx(0.2, rel=1e-12)  # the conventional 0.2 by default


def test_too_long_linking_length_names_the_limit():
    """b may be at most a third of the shortest side: 27 points in a 3-cell box link at
    exactly b = L/3 and the next linking length is refused."""
    grid = np.stack(np.meshgrid(*[np.arange(3) * 10 / 3] * 3, indexing="ij"), -1).reshape(-1, 3)
    positions = torch.tensor(grid)
    length = (10 / 3) / (1000 / 27) ** (1 / 3)  # b = 10/3
    assert friends_of_friends(positions, 10.0, length).tolist() == [0] * 27
    with pytest.raises(ValueError, match=r"b = 3.4\d* Mpc/h; it must be at most a third of the shortest box side "
                                         r"\(3.33333 Mpc/h\)"):
        friends_of_friends(positions, 10.0, length * 1.03)


# -------------------------------------------------------------------------- catalogue


def numpy_catalog(points, labels, box, masses, velocities):
    """{label: (members, mass, centre, mean velocity)} with numpy: centre of mass of the
    members' images nearest the smallest-index member, wrapped."""
    out = {}
    for label in np.unique(labels[labels >= 0]):
        members = np.nonzero(labels == label)[0]
        d = points[members] - points[members.min()]
        d -= box * np.round(d / box)
        m = masses[members]
        centre = np.mod(points[members.min()] + (m[:, None] * d).sum(0) / m.sum(), box)
        out[int(label)] = (len(members), m.sum(), centre, (m[:, None] * velocities[members]).sum(0) / m.sum())
    return out


def test_catalog_matches_numpy(device):
    n = 3000
    points = np.stack([clustered(7, n), clustered(8, n, blobs=4)])
    rng = np.random.default_rng(2)
    masses = rng.uniform(0.5, 2.0, (2, n))
    velocities = rng.normal(0, 300, (2, n, 3))
    positions = torch.tensor(points, device=device)
    labels = friends_of_friends(positions, BOX, 0.2, min_members=8)
    catalog = halo_catalog(positions, labels, BOX, particle_mass=torch.tensor(masses, device=device),
                           velocities=torch.tensor(velocities, device=device))
    assert isinstance(catalog, HaloCatalog)
    box = np.array(BOX)
    for m in range(2):
        expected = numpy_catalog(np.mod(points[m], box), labels[m].cpu().numpy(), box, masses[m], velocities[m])
        found = catalog.labels[m].cpu().numpy()
        assert sorted(found[found >= 0].tolist()) == sorted(expected)
        mass = catalog.masses[m].cpu().numpy()
        assert (np.diff(mass[found >= 0]) <= 0).all(), "not sorted by mass"
        for h, label in enumerate(found):
            if label < 0:
                assert catalog.members[m, h] == 0 and mass[h] == 0  # padding of the shorter list
                continue
            count, total, centre, velocity = expected[label]
            assert int(catalog.members[m, h]) == count
            np.testing.assert_allclose(mass[h], total, rtol=1e-12)
            np.testing.assert_allclose(catalog.positions[m, h].cpu().numpy(), centre, atol=1e-10)
            np.testing.assert_allclose(catalog.velocities[m, h].cpu().numpy(), velocity, rtol=1e-11, atol=1e-9)
    assert (catalog.members[catalog.labels >= 0] >= 8).all()
    # a number as the mass, no velocities, unbatched
    single = halo_catalog(positions[1], labels[1], BOX, particle_mass=2.5)
    assert single.velocities is None and single.labels.dim() == 1
    keep = single.labels >= 0
    assert torch.equal(single.masses[keep], 2.5 * single.members[keep].double())


def test_halo_across_a_box_corner_has_its_centre_by_hand(device):
    """Four particles around the corner (0, 0, 0), one group: their centre of mass by
    hand is at (-0.05, 0.05, -0.1) mod L; with equal masses and a min_members cut."""
    box = (10.0, 8.0, 6.0)
    points = torch.tensor([[9.9, 0.1, 5.9], [0.1, 7.9, 5.8], [9.8, 0.1, 0.1], [0.1, 0.1, 5.8],
                           [5.0, 4.0, 3.0]], dtype=torch.float64, device=device)
    labels = friends_of_friends(points, box, 0.2, n_particles=1000)  # b = 0.0969... too short
    assert labels.tolist() == [0, 1, 2, 3, 4]
    labels = torch.tensor([0, 0, 0, 0, -1], device=device)
    catalog = halo_catalog(points, labels, box, velocities=torch.ones(5, 3, dtype=torch.float64, device=device))
    expected = torch.tensor([[(9.9 + 10.1 + 9.8 + 10.1) / 4 - 10, (0.1 - 0.1 + 0.1 + 0.1) / 4,
                              (5.9 + 5.8 + 6.1 + 5.8) / 4]], dtype=torch.float64)
    expected = torch.remainder(expected, torch.tensor(box, dtype=torch.float64))
    torch.testing.assert_close(catalog.positions.cpu(), expected, rtol=0, atol=1e-12)
    assert catalog.labels.tolist() == [0] and catalog.members.tolist() == [4]
    assert catalog.velocities.tolist() == [[1.0, 1.0, 1.0]]
    assert halo_catalog(points, labels, box, min_members=5).labels.numel() == 0


def test_catalog_gradcheck(device):
    """Centre and velocity are differentiable in positions, velocities and masses for a
    fixed membership (a halo across the x face of the box among them)."""
    box = (6.0, 5.0, 4.0)
    generator = torch.Generator().manual_seed(0)
    points = torch.rand(12, 3, generator=generator, dtype=torch.float64) * 0.6
    points[:4, 0] = torch.remainder(points[:4, 0] - 0.3, 6.0)
    points[6:] += torch.tensor([3.0, 2.0, 2.0], dtype=torch.float64)
    points = points.to(device).unsqueeze(0)
    labels = torch.tensor([[0] * 6 + [6] * 5 + [-1]], device=device)
    velocities = torch.randn(1, 12, 3, generator=generator, dtype=torch.float64).to(device)
    masses = (1 + torch.rand(1, 12, generator=generator, dtype=torch.float64)).to(device)

    def function(x, v, m):
        catalog = halo_catalog(x, labels, box, particle_mass=m, velocities=v)
        return catalog.positions, catalog.velocities, catalog.masses

    inputs = (points.clone().requires_grad_(), velocities.clone().requires_grad_(), masses.clone().requires_grad_())
    assert torch.autograd.gradcheck(function, inputs)


def test_catalog_arguments_are_checked():
    positions = torch.rand(1, 10, 3, dtype=torch.float64)
    labels = torch.zeros(1, 10, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"`labels` must be an int64 tensor of shape \(1, 10\)"):
        halo_catalog(positions, labels[:, :5], 1.0)
    with pytest.raises(ValueError, match="`labels` must be >= 0"):
        halo_catalog(positions, labels - 2, 1.0)
    with pytest.raises(ValueError, match="`velocities` must be a floating-point tensor of shape"):
        halo_catalog(positions, labels, 1.0, velocities=positions[..., :2])
    nan = positions.clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="`velocities` must be finite"):
        halo_catalog(positions, labels, 1.0, velocities=nan)
    for mass in (0.0, -1.0, float("inf"), torch.zeros(1, 10), torch.ones(3)):
        with pytest.raises(ValueError, match="`particle_mass` must be"):
            halo_catalog(positions, labels, 1.0, particle_mass=mass)
    ids = torch.arange(10).unsqueeze(0)
    ids[0, 0] = -1
    with pytest.raises(ValueError, match="empty slots"):
        halo_catalog(positions, labels, 1.0, ids=ids)


# ------------------------------------------------------------------------- find_halos


def test_find_halos_of_a_run(device):
    """The catalogue of a run in Msun/h, Mpc/h and km/s: the members' sum of the particle
    mass 27.7536627e10 Omega_m V / N, velocities 100 p / a; the same from a state in mesh
    units; labels equal scipy's groups of at least 20 particles."""
    sim = torchpm.Simulation(n_particles=32, box_size=(64.0, 64.0, 48.0), mesh_factor=1, a_start=0.1, steps=8,
                             dtype=torch.float64).to(device)
    noise = sim.white_noise(seed=4)
    state = sim(noise)
    catalog, labels = find_halos(sim, state, return_labels=True)
    b = spacing_b(sim.box_size, sim.n_total, 0.2)
    expected = oracle_labels(state.positions[0].cpu().numpy(), sim.box_size, b)
    sizes = np.bincount(expected, minlength=sim.n_total)
    np.testing.assert_array_equal(labels[0].cpu().numpy(), np.where(sizes[expected] >= 20, expected, -1))
    omega_m = float(sim.cosmology.Omega_m)
    mass = 27.7536627e10 * omega_m * 64 * 64 * 48 / 32**3
    keep = catalog.labels[0] >= 0
    assert int(keep.sum()) >= 3
    torch.testing.assert_close(catalog.masses[0][keep], mass * catalog.members[0][keep].double(), rtol=1e-12, atol=0)
    heaviest = labels[0] == catalog.labels[0, 0]
    torch.testing.assert_close(catalog.velocities[0, 0], (100 * state.momenta[0][heaviest] / state.a).mean(0))
    in_cells = sim(noise, return_mesh_units=True)
    again = find_halos(sim, in_cells)
    assert torch.equal(again.labels, catalog.labels)
    torch.testing.assert_close(again.positions, catalog.positions)
    with pytest.raises(ValueError, match="`sim` must be a torchpm.Simulation"):
        find_halos(None, state)
    with pytest.raises(ValueError, match="`state` must be a torchpm.SimulationState"):
        find_halos(sim, state.positions)
