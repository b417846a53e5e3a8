"""The cell list behind friends_of_friends (torchpm.halos): the cases its layout makes
special. A slab of x-planes at a time with a dense cell table (slabs that start inside a
batch member, so the x-wrap plane is outside the slab), z padded with periodic images,
3 or 4 cells per axis, coarser cells when b is tiny next to the mean separation, one
cell holding every point (candidate pairs split across chunks), points on cell faces
and at the box edges, and the float32 prefilter of distances (pairs at b (1 -+ 1e-6)
and a band of pairs around b, in float32 and float64 positions, in small and large boxes).

Oracle: scipy's periodic cKDTree ``query_pairs`` and ``connected_components`` on the
positions as given (in float64), labels as the smallest index of each component.
"""

import numpy as np
import pytest
import torch

from torchpm import halos
from torchpm.halos import friends_of_friends

from test_halos import oracle_labels, spacing_b

pytest.importorskip("scipy.spatial")


def check(points, box, length, device, dtype=torch.float64, n_particles=None, **kwargs):
    """friends_of_friends of (B, N, 3) numpy points equals the oracle for each member."""
    positions = torch.tensor(np.asarray(points), dtype=dtype, device=device)
    as_given = positions.double().cpu().numpy()
    n = n_particles or positions.shape[-2]
    b = spacing_b(box, n, length)
    labels = friends_of_friends(positions, box, length, n_particles=n_particles, **kwargs).cpu().numpy()
    if positions.dim() == 2:
        labels, as_given = labels[None], as_given[None]
    for member in range(len(as_given)):
        np.testing.assert_array_equal(labels[member], oracle_labels(as_given[member], box, b))
    return labels


def clumps(rng, n, box, blobs, sigma):
    box = np.asarray(box)
    centres = rng.uniform(0, box, (blobs, 3))
    half = n // 2
    return np.concatenate([rng.uniform(0, box, (n - half, 3)),
                           centres[rng.integers(0, blobs, half)] + rng.normal(0, sigma, (half, 3))])


@pytest.fixture
def small_slabs(monkeypatch):
    """Slabs of a few planes (the default would hold these tests' points in one)."""
    monkeypatch.setattr(halos, "_SLAB_CELLS", 40)
    monkeypatch.setattr(halos, "_TABLE_ENTRIES_PER_POINT", 8)


def test_many_slabs_and_batch_members_match_scipy(device, small_slabs):
    """Slabs of a few planes, starting inside a member (the x-wrap plane of that member
    outside the slab), over 3 members with groups across every face."""
    box = (20.0, 16.0, 12.0)
    rng = np.random.default_rng(3)
    members = [clumps(rng, 700, box, 6, 0.5) for _ in range(3)]
    members[1][:40] = rng.normal(0, 0.4, (40, 3))  # a group on the corner of the box
    members[2][:40, 0] = rng.normal(0, 0.3, 40)  # a group across the x face
    grid = halos._CellList(torch.tensor(members[0], device=device), torch.zeros(700, dtype=torch.int64,
                                                                                  device=device),
                           box, spacing_b(box, 700, 0.3))
    assert len(grid.slabs) > 3 and max(high - low for low, high in grid.slabs) < grid.cells[0]
    labels = check(np.stack(members), box, 0.3, device, chunk_size=97)
    assert len(np.unique(labels[1])) < 0.8 * 700


@pytest.mark.parametrize("length", [0.05, 0.2])
def test_one_cell_holds_every_point(device, length):
    """All points in one cell (its pairs split across chunks of a few pairs); the rest
    of the table empty."""
    box = (30.0, 30.0, 30.0)
    rng = np.random.default_rng(4)
    n = 200
    b = spacing_b(box, 10_000, length)
    points = 12.0 + rng.uniform(0, b, (n, 3)) * 0.999
    points[:10] += [0.0, 0.0, 0.5 * b]  # some pairs just beyond each other's reach
    for chunk_size in (1 << 20, 97, 5):
        check(points, box, length, device, n_particles=10_000, chunk_size=chunk_size)


def test_blocks_past_the_int32_limit_take_int64_indices(device, monkeypatch):
    """A block of candidate pairs (two neighbouring cells) with 2^31 pairs or more would
    overflow the int32 index arithmetic: such calls compute the indices in int64. With the
    limit lowered to 50 pairs, the crowded cells below take that path (and the groups
    still equal scipy's)."""
    monkeypatch.setattr(halos, "_INT32_LIMIT", 50)
    box = (30.0, 30.0, 30.0)
    rng = np.random.default_rng(7)
    b = spacing_b(box, 10_000, 0.2)
    points = np.concatenate([12.0 + rng.uniform(0, b, (60, 3)) * 0.999, rng.uniform(0, 30.0, (300, 3))])
    for chunk_size in (1 << 20, 13):
        check(points, box, 0.2, device, n_particles=10_000, chunk_size=chunk_size)


def test_three_and_four_cells_per_axis(device):
    """b a third (then a quarter) of the side: every cell is a neighbour of every other
    along that axis; pairs straddle each face and sit half a box apart."""
    rng = np.random.default_rng(5)
    for cells in (3, 4):
        box = (float(cells) * 4.0, 12.0, 16.0)
        n = 60
        length = 4.0 / (np.prod(box) / n) ** (1 / 3)  # b = 4: `cells` cells along x
        b = spacing_b(box, n, length)
        assert halos._cell_grid(box, b, n)[0] == cells
        points = rng.uniform(0, box, (n, 3))
        points[:4, 0] = [0.01, box[0] - 0.01, box[0] / 2 - 0.01, box[0] / 2 + 0.01]
        check(points, box, length, device)


def test_coarse_cells_for_a_tiny_linking_length(device):
    """b tiny next to the mean separation given by n_particles: cells wider than b (at
    most about _CELLS_PER_POINT per point), still exact."""
    box = (50.0, 40.0, 30.0)
    rng = np.random.default_rng(6)
    points = clumps(rng, 500, box, 4, 0.05)
    b = spacing_b(box, 500, 0.02)
    cells = halos._cell_grid(box, b, 500)
    assert all(length / n > 1.5 * b for n, length in zip(cells, box))
    assert np.prod(cells) <= halos._CELLS_PER_POINT * 500 * 1.01
    labels = check(points, box, 0.02, device)
    assert len(np.unique(labels)) < 480


def test_points_on_cell_faces_and_box_edges(device):
    """Points exactly on cell faces, at 0, at L (wraps to 0), just below L, at -0.0 and
    a whole box away; pairs across those faces at b (1 -+ 1e-6)."""
    box = (10.0, 10.0, 10.0)
    n = 1000
    b = spacing_b(box, n, 0.2)  # 0.2: 50 cells of exactly 0.2 per axis
    width = box[0] / halos._cell_grid(box, b, n)[0]
    faces = np.arange(0, 10.0 + width / 2, width)[:12]
    rng = np.random.default_rng(7)
    points = rng.uniform(0, 10.0, (40, 3))
    points[:12, 0] = faces
    points[:12, 1:] = 5.0
    points[12:16] = [[0.0, 2.0, 2.0], [10.0, 2.0, 2.0 + b * (1 - 1e-6)], [np.nextafter(10.0, 0), 3.0, 3.0],
                     [-0.0, 3.0, 3.0 + b * (1 + 1e-6)]]
    points[16:18] = [[20.0 + 1.0, 7.0, 7.0], [-10.0 + 1.0 + b * (1 - 1e-6), 7.0, 7.0]]
    check(points, box, 0.2, device, n_particles=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("side", [8.0, 5000.0])
def test_pairs_in_a_band_around_b(device, dtype, side):
    """Pairs at distances b (1 + u), u uniform in [-1e-4, 1e-4], and at b (1 -+ 1e-6),
    along random directions, some across faces: the float32 prefilter decides the clear
    ones and float64 the rest, as scipy does from the positions as given."""
    box = (side, side, side)
    n = 2 * 4000
    b = spacing_b(box, n, 0.2)
    rng = np.random.default_rng(8)
    centres = rng.uniform(0, side, (n // 2, 3))
    centres[: n // 8, 0] = rng.uniform(-b, b, n // 8)  # across the x face
    direction = rng.normal(0, 1, (n // 2, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    scale = 1 + rng.uniform(-1e-4, 1e-4, n // 2)
    scale[:200] = 1 - 1e-6
    scale[200:400] = 1 + 1e-6
    second = centres + direction * (b * scale)[:, None]
    points = np.concatenate([centres, second])
    positions = torch.tensor(points, dtype=dtype).double().numpy()  # as the dtype rounds them
    given = positions - np.asarray(box) * np.floor(positions / np.asarray(box))
    distance = np.linalg.norm((given[: n // 2] - given[n // 2:] + side / 2) % side - side / 2, axis=1)
    assert ((distance > b * (1 - 2e-4)) & (distance < b * (1 + 2e-4))).mean() > 0.9  # the band is hit
    labels = check(points, box, 0.2, device, dtype=dtype)
    linked = labels[0][: n // 2] == labels[0][n // 2:]
    assert 0.2 < linked.mean() < 0.8


def test_float32_bounds_are_ordered():
    """The prefilter's bounds bracket b^2 and widen with the box."""
    for box, b in [((10.0, 10.0, 10.0), 0.2), ((5000.0, 100.0, 100.0), 1.0), ((1e6, 1e6, 1e6), 0.5)]:
        surely, maybe = halos._float32_bounds(box, b)
        assert surely < b * b < maybe
    small = halos._float32_bounds((10.0,) * 3, 0.2)
    large = halos._float32_bounds((1000.0,) * 3, 0.2)
    assert large[0] < small[0] and large[1] > small[1]
