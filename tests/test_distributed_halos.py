"""Friends-of-friends halos on gloo process grids: the labels and the catalogue equal the
one-device ones for the same particles.

One pool of processes per world size runs every case (see _spawn.py). Each rank makes
the same global particle set (same seed), keeps its share, and compares with oracles
computed on the whole set: scipy's cKDTree pairs and connected components for the
labels (exact equality, by particle id), numpy sums for the catalogue, and the
one-device torchpm catalogue and find_halos of the same particles or run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _spawn import expect_error_everywhere, grid_context, rank_errors, run_grid_case, world_results_fixture

pytestmark = pytest.mark.distributed

GRIDS = {2: [(2, 1), (1, 2)], 3: [(3, 1)], 4: [(2, 2)]}
BOX = (30.0, 24.0, 18.0)
MESH = (15, 12, 9)  # cells 2 Mpc/h: blocks 7-8 or 5 cells wide over 2 or 3 ranks
N = 3000


def case_ids(world_size):
    ids = []
    for p0, p1 in GRIDS[world_size]:
        grid = f"{p0}x{p1}"
        ids += [f"owned-{grid}", f"scattered-{grid}", f"catalog-{grid}", f"simulation-{grid}",
                f"bad_input-{grid}", f"spherical_overdensity-{grid}"]
        if (p0, p1) in ((2, 1), (3, 1)):
            ids.append(f"thin_blocks-{grid}")
    return ids


# ----------------------------------------------------------------------------
# Helpers (inside the spawned processes).


def make_context(world_size):
    return grid_context(world_size, GRIDS)


def run_case(case_id, ctx):
    run_grid_case(globals(), case_id, ctx)


def clustered(seed, n=N, box=BOX, batch=2):
    """``(batch, n, 3)`` float64: half uniform, half in Gaussian blobs, on a box corner
    and on the block faces of every grid (x = 10, 16, 20 and y = 12 Mpc/h), so groups
    straddle the periodic edges and the ranks' blocks."""
    rng = np.random.default_rng(seed)
    box = np.asarray(box)
    out = []
    for _ in range(batch):
        centres = rng.uniform(0, box, (8, 3))
        centres[:4] = [[0.2, 0.1, box[2] - 0.3], [16.0, 12.0, 9.0], [10.0, 5.0, 3.0], [20.0, 20.0, 15.0]]
        blobs = centres[rng.integers(0, 8, n // 2)] + rng.normal(0, 0.8, (n // 2, 3))
        out.append(np.mod(np.concatenate([rng.uniform(0, box, (n - n // 2, 3)), blobs]), box))
    return torch.tensor(np.stack(out))


def spacing_b(box, n, length):
    """The linking distance in Mpc/h, here (not ``linking_distance``: an oracle that used
    it would share its error): ``length`` times the mean spacing ``(V / n)^(1/3)``."""
    return length * (float(np.prod(np.broadcast_to(np.asarray(box, dtype=float), 3))) / n) ** (1 / 3)


def oracle_labels(points, box, b):
    """Smallest index of each particle's FoF group (scipy)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    points = np.asarray(points)
    n = len(points)
    pairs = cKDTree(points, boxsize=box).query_pairs(b, output_type="ndarray")
    graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    _, component = connected_components(graph, directed=False)
    smallest = np.full(component.max() + 1, n)
    np.minimum.at(smallest, component, np.arange(n))
    return smallest[component]


def mesh_of(grid, ctx, shape=MESH):
    from torchpm.distributed import PencilDecomposition

    return PencilDecomposition(shape, ctx["groups"][grid])


def owned_share(mesh, points, box=BOX):
    """This rank's particles by position, padded with empty slots (id -1) to a width
    that differs between ranks: ``(positions, ids)``."""
    batch, n, _ = points.shape
    keep = torch.ones(batch, n, dtype=torch.bool)
    for axis in (0, 1):
        cells = torch.floor(points[..., axis] / box[axis] * mesh.global_shape[axis])
        low = mesh.local_real_offset[axis]
        keep &= (cells >= low) & (cells < low + mesh.local_real_shape[axis])
    return pad_share(points, keep, extra=3 + mesh.grid.rank)


def pad_share(points, keep, extra):
    batch, n, _ = points.shape
    width = int(keep.sum(1).max()) + extra
    positions = torch.full((batch, width, 3), 0.5, dtype=points.dtype)
    ids = torch.full((batch, width), -1, dtype=torch.int64)
    for m in range(batch):
        index = torch.nonzero(keep[m]).reshape(-1)
        slots = torch.randperm(width, generator=torch.Generator().manual_seed(m))[: len(index)]
        positions[m, slots] = points[m, index]
        ids[m, slots] = index
    return positions, ids


def check_labels(labels, ids, expected):
    """Each held particle's label equals the oracle's for its id; every id held once."""
    import torch.distributed as dist

    valid = ids >= 0
    for m in range(ids.shape[0]):
        got = labels[m][valid[m]].numpy()
        want = expected[m][ids[m][valid[m]].numpy()]
        assert np.array_equal(got, want), f"member {m}: {int((got != want).sum())} labels differ"
        assert bool((labels[m][~valid[m]] == -1).all())
    counts = torch.zeros(ids.shape[0], expected.shape[1], dtype=torch.int64)
    for m in range(ids.shape[0]):
        counts[m].index_add_(0, ids[m][valid[m]], torch.ones(int(valid[m].sum()), dtype=torch.int64))
    dist.all_reduce(counts)
    assert bool((counts == 1).all()), "particles lost or duplicated"


def with_min_members(labels, min_members):
    out = labels.copy()
    for m in range(out.shape[0]):
        values, counts = np.unique(out[m], return_counts=True)
        small = values[counts < min_members]
        out[m][np.isin(out[m], small)] = -1
    return out


# ----------------------------------------------------------------------------
# Cases.


def case_owned(grid, ctx):
    """Particles held by the rank owning their position: labels equal scipy's, also with
    min_members (a group split between ranks is counted over the grid)."""
    from torchpm.halos import friends_of_friends

    mesh = mesh_of(grid, ctx)
    points = clustered(1)
    b = spacing_b(BOX, N, 0.2)
    expected = np.stack([oracle_labels(p, BOX, b) for p in points.numpy()])
    positions, ids = owned_share(mesh, points)
    labels = friends_of_friends(positions, BOX, 0.2, ids=ids, mesh=mesh)
    check_labels(labels, ids, expected)
    labels = friends_of_friends(positions, BOX, 0.2, ids=ids, mesh=mesh, min_members=5, chunk_size=777)
    check_labels(labels, ids, with_min_members(expected, 5))
    # float32 positions: linked in float64 from the same values
    single = points.float()
    expected = np.stack([oracle_labels(p, BOX, b) for p in single.double().numpy()])
    positions, ids = owned_share(mesh, single)
    check_labels(friends_of_friends(positions, BOX, 0.2, ids=ids, mesh=mesh), ids, expected)


def case_scattered(grid, ctx):
    """Particles dealt to the ranks at random, whatever their position (a particle's
    friends may all be elsewhere), then all on one rank: the labels still equal scipy's."""
    from torchpm.halos import friends_of_friends, halo_catalog

    mesh = mesh_of(grid, ctx)
    points = clustered(2)
    b = spacing_b(BOX, N, 0.25)
    expected = np.stack([oracle_labels(p, BOX, b) for p in points.numpy()])
    dealt = torch.randint(0, mesh.grid.size, points.shape[:2], generator=torch.Generator().manual_seed(5))
    positions, ids = pad_share(points, dealt == mesh.grid.rank, extra=mesh.grid.rank)
    labels = friends_of_friends(positions, BOX, 0.25, ids=ids, mesh=mesh, min_members=3)
    check_labels(labels, ids, with_min_members(expected, 3))
    # every particle on the last rank, the others hold only empty slots (or no slot)
    last = mesh.grid.rank == mesh.grid.size - 1
    positions, ids = pad_share(points, torch.full(points.shape[:2], last), extra=0)
    labels = friends_of_friends(positions, BOX, 0.25, ids=ids, mesh=mesh, min_members=3)
    check_labels(labels, ids, with_min_members(expected, 3))
    catalog = halo_catalog(positions, labels, BOX, ids=ids, mesh=mesh)
    serial = halo_catalog(points, torch.tensor(with_min_members(expected, 3)), BOX)
    assert torch.equal(catalog.labels, serial.labels) and torch.allclose(catalog.positions, serial.positions)


def case_thin_blocks(grid, ctx):
    """A chain of particles zigzagging along x across the blocks (not closing around the
    box): right from x = 1 to 3.9, back to 0.3, right again to 5.5, its smallest id at
    the start, so its label crosses block faces several times, each leg linked to the
    next only inside another rank's block (two rounds of the exchange on 3 ranks); then
    linking distances wider than a block (a particle is a ghost of several ranks)."""
    from torchpm.halos import friends_of_friends

    box = (6.0, 10.0, 10.0)
    mesh = mesh_of(grid, ctx, shape=(12, 4, 4))  # x blocks of 2 or 3 Mpc/h
    n = 400
    b = spacing_b(box, n, 0.2)  # 0.23 Mpc/h
    rng = np.random.default_rng(3)
    corners = np.array([[1.0, 5.0], [3.9, 5.0], [3.9, 6.0], [0.3, 6.0], [0.3, 7.0], [5.5, 7.0]])
    chain = []
    for start, end in zip(corners[:-1], corners[1:]):
        steps = int(np.ceil(np.linalg.norm(end - start) / (0.9 * b)))
        chain += [start + (end - start) * t for t in np.arange(steps) / steps]
    chain = np.array(chain + [corners[-1]])
    chain = np.concatenate([chain, np.full((len(chain), 1), 5.0)], 1)
    background = rng.uniform(0, box, (n - len(chain), 3))
    background[:, 2] = np.where(np.abs(background[:, 2] - 5.0) < 1.0, background[:, 2] + 2.0, background[:, 2])
    points = torch.tensor(np.concatenate([chain, background])).unsqueeze(0)
    expected = oracle_labels(points[0].numpy(), box, b)[None]
    assert (expected[0][: len(chain)] == 0).all() and (expected[0][len(chain):] > 0).all()
    positions, ids = owned_share(mesh, points, box)
    labels = friends_of_friends(positions, box, 0.2, ids=ids, mesh=mesh)
    check_labels(labels, ids, expected)
    for length in (1.0, 1.7):  # b = 1.15 and 1.95 Mpc/h
        expected = oracle_labels(points[0].numpy(), box, spacing_b(box, n, length))[None]
        labels = friends_of_friends(positions, box, length, ids=ids, mesh=mesh, n_particles=n)
        check_labels(labels, ids, expected)


def _numpy_catalog(points, labels, box, masses, velocities):
    """Per label: count, mass, periodic centre (around the smallest-index member), mean
    velocity; dict label -> tuple."""
    out = {}
    for label in np.unique(labels[labels >= 0]):
        members = np.nonzero(labels == label)[0]
        x = points[members]
        ref = points[members.min()]
        d = x - ref
        d -= box * np.round(d / box)
        m = masses[members]
        centre = np.mod(ref + (m[:, None] * d).sum(0) / m.sum(), box)
        out[int(label)] = (len(members), m.sum(), centre, (m[:, None] * velocities[members]).sum(0) / m.sum())
    return out


def case_catalog(grid, ctx):
    """The catalogue on the grid (replicated on every rank) equals a numpy computation on
    the whole set and the one-device catalogue; gradients of a loss of the centres equal
    the one-device gradients at this rank's particles."""
    from torchpm.halos import friends_of_friends, halo_catalog

    mesh = mesh_of(grid, ctx)
    points = clustered(4)
    rng = np.random.default_rng(9)
    velocities = torch.tensor(rng.normal(0, 300, points.shape))
    masses = torch.tensor(rng.uniform(0.5, 2.0, points.shape[:2]))
    positions, ids = owned_share(mesh, points)
    labels = friends_of_friends(positions, BOX, 0.2, ids=ids, mesh=mesh, min_members=10)
    safe = ids.clamp(min=0)
    mine_v = torch.stack([velocities[m][safe[m]] for m in range(2)])
    mine_m = torch.stack([masses[m][safe[m]] for m in range(2)]) * (ids >= 0) + (ids < 0)
    x = positions.clone().requires_grad_()
    catalog = halo_catalog(x, labels, BOX, particle_mass=mine_m, velocities=mine_v, ids=ids, mesh=mesh)
    serial_labels = friends_of_friends(points, BOX, 0.2, min_members=10)
    x_serial = points.clone().requires_grad_()
    serial = halo_catalog(x_serial, serial_labels, BOX, particle_mass=masses, velocities=velocities)
    assert torch.equal(catalog.labels, serial.labels) and torch.equal(catalog.members, serial.members)
    for a, b in ((catalog.masses, serial.masses), (catalog.positions, serial.positions),
                 (catalog.velocities, serial.velocities)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-10), float((a - b).abs().max())
    for m in range(2):
        expected = _numpy_catalog(points[m].numpy(), serial_labels[m].numpy(), np.asarray(BOX), masses[m].numpy(),
                                  velocities[m].numpy())
        assert len(expected) == int((catalog.labels[m] >= 0).sum())
        for h, label in enumerate(catalog.labels[m].tolist()):
            if label < 0:
                continue
            count, mass, centre, velocity = expected[label]
            assert int(catalog.members[m, h]) == count
            np.testing.assert_allclose(float(catalog.masses[m, h]), mass, rtol=1e-12)
            np.testing.assert_allclose(catalog.positions[m, h].detach().numpy(), centre, rtol=0, atol=1e-10)
            np.testing.assert_allclose(catalog.velocities[m, h].numpy(), velocity, rtol=1e-12, atol=1e-9)
    # d(sum of centre coordinates * weights)/dx: every rank computes the same replicated loss
    weights = torch.linspace(0.5, 1.5, catalog.positions[..., 0].numel()).reshape(catalog.positions.shape[:2])
    (catalog.positions * weights.unsqueeze(-1)).sum().backward()
    (serial.positions * weights.unsqueeze(-1)).sum().backward()
    for m in range(2):
        valid = ids[m] >= 0
        assert torch.allclose(x.grad[m][valid], x_serial.grad[m][ids[m][valid]], rtol=1e-12, atol=1e-14)


def case_simulation(grid, ctx):
    """find_halos of a run on the grid equals find_halos of the same run on one device."""
    import torchpm

    config = dict(n_particles=(12, 10, 8), box_size=(36.0, 30.0, 24.0), mesh_factor=2, a_start=0.1, steps=6,
                  dtype=torch.float64)
    serial = torchpm.Simulation(**config)
    distributed = torchpm.Simulation(**config, mesh=ctx["groups"][grid])
    results, states = [], []
    for sim in (serial, distributed):
        state = sim(sim.white_noise(batch=2, seed=3))
        states.append(state)
        results.append((torchpm.find_halos(sim, state, min_members=5, return_labels=True), state.ids))
    serial_state, grid_state = states
    ((serial_catalog, serial_labels), _), ((catalog, labels), ids) = results
    assert int((serial_catalog.labels >= 0).sum()) > 2, "too few halos for a test"
    assert torch.equal(catalog.labels, serial_catalog.labels)
    assert torch.equal(catalog.members, serial_catalog.members)
    assert torch.allclose(catalog.masses, serial_catalog.masses, rtol=1e-12)
    assert torch.allclose(catalog.positions, serial_catalog.positions, rtol=0, atol=1e-9)
    assert torch.allclose(catalog.velocities, serial_catalog.velocities, rtol=1e-10, atol=1e-8)
    valid = ids >= 0
    for m in range(2):
        assert torch.equal(labels[m][valid[m]], serial_labels[m][ids[m][valid[m]]])
    # M_200m and M_500c about the FoF centres: the one-device values
    from torchpm.halos import spherical_overdensity_masses

    for delta, reference in ((200.0, "mean"), (500.0, "critical")):
        one, on_grid = (spherical_overdensity_masses(sim, state, halos, delta=delta, reference=reference)
                        for sim, state, halos in ((serial, serial_state, serial_catalog),
                                                  (distributed, grid_state, catalog)))
        assert torch.equal(on_grid.members, one.members), (reference, on_grid.members, one.members)
        assert torch.allclose(on_grid.masses, one.masses, rtol=1e-12, atol=0)
        assert int(one.members.max()) > 0
    # one rank's bad argument raises on every rank (it raised there alone, the others
    # waiting in the agreement), and so do other thresholds on one rank
    odd = ctx["rank"] == ctx["world"] - 1
    expect_error_everywhere(lambda: torchpm.find_halos(distributed, grid_state.positions if odd else grid_state),
                            "find_halos: `state` must be a torchpm.SimulationState", f"rank {ctx['world'] - 1}")
    for arguments, fragment in ((dict(delta=-1.0), "`delta` must be a positive number"),
                                (dict(reference="virial"), "`reference` must be 'mean' or 'critical'"),
                                (dict(catalog=catalog.masses), "`catalog` must be a HaloCatalog"),
                                (dict(delta=500.0), "the ranks disagree on `delta`"),
                                (dict(reference="critical"), "the ranks disagree on `reference`")):
        arguments = {"catalog": catalog, **(arguments if odd else {})}
        expect_error_everywhere(lambda: spherical_overdensity_masses(distributed, grid_state, **arguments),
                                "spherical_overdensity_masses", fragment)


def case_spherical_overdensity(grid, ctx):
    """Spherical-overdensity masses on the grid (each rank its particles, every rank the
    same centres: the blob centres, on block faces and a box corner, one masked) equal
    the one-device ones, which test_spherical_overdensity.py checks against a brute
    force; the search starts small, so it doubles (collectively) several times. A bad
    threshold, or other centres or mask on one rank, raises on every rank."""
    from torchpm.halos import spherical_overdensity

    mesh = mesh_of(grid, ctx)
    points = clustered(7)
    centres = torch.tensor([[[0.2, 0.1, BOX[2] - 0.3], [16.0, 12.0, 9.0], [10.0, 5.0, 3.0], [20.0, 20.0, 15.0],
                             [5.0, 18.0, 9.0]]] * 2, dtype=torch.float64)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, 2] = False
    density = 50.0 * N / (BOX[0] * BOX[1] * BOX[2])
    positions, ids = owned_share(mesh, points)
    got = spherical_overdensity(positions, centres, BOX, density, particle_mass=2.0, ids=ids, valid=valid,
                                radius=0.05, mesh=mesh, chunk_size=500)
    serial = spherical_overdensity(points, centres, BOX, density, particle_mass=2.0, valid=valid, radius=0.05)
    assert torch.equal(got.members, serial.members), (got.members, serial.members)
    assert int(serial.members.max()) > 50, "the blobs must hold spheres"
    assert torch.equal(got.masses, serial.masses) and torch.equal(got.radii, serial.radii)
    first = mesh.grid.rank == 0
    expect_error_everywhere(lambda: spherical_overdensity(positions, centres, BOX, -1.0 if first else density,
                                                          radius=1.0, ids=ids, mesh=mesh), "`density`", "rank 0")
    moved, other_mask = centres.clone(), valid.clone()
    if not first:
        moved[0, 0, 0] += 1.0
        other_mask[0, 1] = False
    for changed in (dict(centres=moved), dict(valid=other_mask)):
        arguments = {"centres": centres, "valid": valid, **changed}
        expect_error_everywhere(lambda: spherical_overdensity(positions, arguments["centres"], BOX, density,
                                                              radius=1.0, ids=ids, valid=arguments["valid"],
                                                              mesh=mesh), "the same on every rank")


def case_bad_input(grid, ctx):
    """One rank's bad argument raises on every rank (none waits in a collective)."""
    from torchpm.halos import friends_of_friends, halo_catalog

    mesh = mesh_of(grid, ctx)
    first = mesh.grid.rank == 0
    positions, ids = owned_share(mesh, clustered(6))
    expect_error_everywhere(lambda: friends_of_friends(positions, BOX, -0.2 if first else 0.2, ids=ids, mesh=mesh),
                            "`linking_length` must be a positive number", "rank 0")
    expect_error_everywhere(lambda: friends_of_friends(positions, BOX, 0.2 if first else 0.3, ids=ids, mesh=mesh),
                            "`linking_length`", "rank 1")
    broken = positions.clone()
    if not first:
        broken[0, ids[0].argmax(), 1] = float("nan")
    expect_error_everywhere(lambda: friends_of_friends(broken, BOX, 0.2, ids=ids, mesh=mesh),
                            "`positions` must be finite", "rank 1")
    expect_error_everywhere(lambda: friends_of_friends(positions, BOX, 0.2, mesh=mesh), "pass `ids`")
    expect_error_everywhere(lambda: friends_of_friends(positions, BOX, 0.2, ids=ids[:, :3] if first else ids,
                                                       mesh=mesh), "`ids` must be an int64 tensor", "rank 0")
    expect_error_everywhere(lambda: friends_of_friends(positions, BOX, 5.0, ids=ids, mesh=mesh),
                            "at most a third of the shortest box side")
    # ids unique on each rank but held by two ranks (each rank numbered its own from 0):
    # the groups were wrong without an error
    renumbered = torch.where(ids >= 0, torch.cumsum((ids >= 0).long(), 1) - 1, ids)
    expect_error_everywhere(lambda: friends_of_friends(positions, BOX, 0.2, ids=renumbered, mesh=mesh),
                            "`ids` must be unique within each batch member over all ranks", "on two ranks")
    labels = friends_of_friends(positions, BOX, 0.2, ids=ids, mesh=mesh)
    expect_error_everywhere(lambda: halo_catalog(positions, labels, BOX, ids=ids, mesh=mesh,
                                                 particle_mass=-1.0 if not first else 1.0),
                            "`particle_mass` must be a positive number", "rank 1")
    # and the grid still works afterwards
    assert friends_of_friends(positions, BOX, 0.2, ids=ids, mesh=mesh).shape == ids.shape


# ----------------------------------------------------------------------------
# The pytest side: one spawn per world size, one test per case.

world_results = world_results_fixture(__name__, case_ids, "halo_world", timeout_s=600)


@pytest.mark.parametrize("world_size,case_id", [(w, c) for w in sorted(GRIDS) for c in case_ids(w)])
def test_distributed_halos(world_results, world_size, case_id):
    errors = rank_errors(world_results(world_size)[case_id])
    if errors:
        pytest.fail(errors)
