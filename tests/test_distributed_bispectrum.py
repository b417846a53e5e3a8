"""The bispectrum on gloo process grids (2x1, 1x2, 3x1, 2x2), the function and the layer
(torchpm.nn.BispectrumEstimator): equal on every rank to the single-device result of the
whole field, its gradient equal to the single-device one, and one rank's bad argument
raising on every rank.

One pool of processes per world size runs every case of that size (see _spawn.py);
every rank also measures the whole field itself without a process group (the oracle,
which tests/test_bispectrum.py checks against a brute-force sum over mode triples).
"""

from __future__ import annotations

import pytest
import torch

from _spawn import expect_error_everywhere, grid_context, rank_errors, run_grid_case, world_results_fixture

pytestmark = pytest.mark.distributed

GRIDS = {2: [(2, 1), (1, 2)], 3: [(3, 1)], 4: [(2, 2)]}
# Uneven blocks over 3 ranks and on the 2 x 2 grid's transposed Fourier side (nz = 6: 4
# rfft planes); unequal cells; default shells reaching past two thirds of the Nyquist
# frequency (the half-cell shifts run on the grid too).
SHAPE, BOX = (10, 8, 6), (50.0, 40.0, 30.0)
TOLERANCE = 1e-12


def case_ids(world_size):
    ids = []
    for p0, p1 in GRIDS[world_size]:
        grid = f"{p0}x{p1}"
        ids += [f"field-{grid}", f"painted-{grid}", f"bad_input-{grid}", f"layer-{grid}", f"layer_bad_input-{grid}"]
    return ids


def make_context(world_size):
    return grid_context(world_size, GRIDS)


def run_case(case_id, ctx):
    run_grid_case(globals(), case_id, ctx)


def global_random(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def assert_small(got, expected, what):
    error = float((got - expected).abs().max())
    scale = float(expected.abs().max())
    assert error <= TOLERANCE * scale, f"{what}: max abs difference {error:.3e} > {TOLERANCE:g} x {scale:.3e}"


def assert_same(got, expected):
    for name in ("k", "bispectrum", "reduced", "power", "edges"):
        assert_small(getattr(got, name).detach(), getattr(expected, name).detach(), name)
    assert torch.equal(got.triangles, expected.triangles), (got.triangles, expected.triangles)
    assert torch.equal(got.shells, expected.shells)


def loss_gradient(field, result):
    """The gradient in ``field`` of a loss of the bispectrum and Q (weighted by configuration)."""
    weights = torch.arange(1.0, result.bispectrum.shape[-1] + 1, dtype=torch.float64)
    loss = (result.bispectrum**2 * weights).sum() + (result.reduced * weights).sum()
    (grad,) = torch.autograd.grad(loss, field)
    return grad


def case_field(grid, ctx):
    """A batch of random fields: every output on every rank equals one device's, with the
    CIC window and shot noise, default and given configurations; the gradient of a loss
    of B and Q in each rank's block equals the block of one device's gradient."""
    from torchpm.bispectrum import bispectrum
    from torchpm.distributed import PencilDecomposition

    mesh = PencilDecomposition(SHAPE, ctx["groups"][grid])
    whole = global_random((2, *SHAPE), 1)
    for options in (dict(window="cic", n_particles=300), dict(bins=3, triangles=[(2, 0, 1), (1, 1, 1), (2, 2, 2)])):
        fields = [whole.clone().requires_grad_(), mesh.local_real_part(whole).clone().requires_grad_()]
        results = [bispectrum(fields[0], BOX, **options), bispectrum(fields[1], BOX, mesh=mesh, **options)]
        assert_same(results[1], results[0])
        grads = [loss_gradient(field, result) for field, result in zip(fields, results)]
        assert_small(grads[1], mesh.local_real_part(grads[0]), f"d loss / d field ({options})")


def case_painted(grid, ctx):
    """Particles painted with TSC and interlacing on a simulation's force mesh (each rank
    given a share of them regardless of position): the bispectrum with the TSC window and
    the particles' shot noise equals one device's."""
    import torchpm
    from torchpm.analysis import paint_density
    from torchpm.bispectrum import bispectrum
    from torchpm.mesh import LocalMesh

    sim = torchpm.Simulation(n_particles=(5, 4, 3), box_size=BOX, mesh_factor=2, steps=1, dtype=torch.float64,
                             mesh=ctx["groups"][grid])
    mesh = sim.force_mesh
    assert tuple(mesh.global_shape) == SHAPE
    particles = 500
    positions = torch.rand(1, particles, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    positions = positions * torch.tensor(SHAPE, dtype=torch.float64)
    mine = torch.arange(particles) % ctx["world"] == ctx["rank"]
    serial = paint_density(positions, LocalMesh(SHAPE), order="tsc", interlacing=True)
    local = paint_density(positions[:, mine], mesh, order="tsc", interlacing=True)
    expected = bispectrum(serial, BOX, window="tsc", n_particles=particles)
    got = bispectrum(local, BOX, window="tsc", n_particles=particles, mesh=mesh)
    assert_same(got, expected)


def case_bad_input(grid, ctx):
    """One rank's bad or different argument: every rank raises, naming that rank (none is
    left waiting in the sums' all-reduce or in a transform)."""
    import math

    from torchpm.bispectrum import bispectrum
    from torchpm.distributed import PencilDecomposition

    mesh = PencilDecomposition(SHAPE, ctx["groups"][grid])
    field = mesh.local_real_part(global_random((1, *SHAPE), 2))
    last = ctx["rank"] == ctx["world"] - 1
    rank = f"rank {ctx['world'] - 1}"
    k_nyquist = min(math.pi * n / b for n, b in zip(SHAPE, BOX))
    expect_error_everywhere(lambda: bispectrum(field, BOX, bins=[0.1, 0.3, k_nyquist * (2 if last else 1)], mesh=mesh),
                            "`bins` must lie in (0, k_Nyquist]", rank)
    expect_error_everywhere(lambda: bispectrum(field, BOX, triangles=[(0, 1, 9 if last else 2)], mesh=mesh),
                            "`triangles` must be", rank)
    expect_error_everywhere(lambda: bispectrum(field, BOX, triangles=[(0, 1, 1) if last else (0, 1, 2)], mesh=mesh),
                            "the ranks disagree on `triangles`", rank)
    expect_error_everywhere(lambda: bispectrum(field, BOX, bins=4 if last else 3, mesh=mesh),
                            "the ranks disagree on `bins`", rank)
    expect_error_everywhere(lambda: bispectrum(field, BOX, window="tsc" if last else "cic", mesh=mesh),
                            "the ranks disagree on `window`", rank)
    expect_error_everywhere(lambda: bispectrum(field, BOX, n_particles=0 if last else 100, mesh=mesh),
                            "`n_particles` must be a positive integer", rank)
    expect_error_everywhere(lambda: bispectrum(field, BOX, shot_noise=2.0 if last else 1.0, mesh=mesh),
                            "the ranks disagree on the shot noise subtracted", rank)
    broken = field.clone()
    if last:
        broken[0, 0, 0, 0] = float("nan")
    expect_error_everywhere(lambda: bispectrum(broken, BOX, mesh=mesh), "`field` contains NaN or infinite values",
                            rank)
    expect_error_everywhere(lambda: bispectrum(field[..., :-1] if last else field, BOX, mesh=mesh),
                            "does not match this rank's block", rank)
    # an empty shell is seen from the all-reduced mode counts: every rank raises it alone
    k_fundamental = 2 * math.pi / max(BOX)
    expect_error_everywhere(lambda: bispectrum(field, BOX, bins=[0.5 * k_fundamental, 1.02 * k_fundamental,
                                                                 1.05 * k_fundamental, 2.5 * k_fundamental],
                                               mesh=mesh), "hold no mode")
    # and after all of these, the ranks still measure together
    assert_same(bispectrum(field, BOX, mesh=mesh),
                bispectrum(global_random((1, *SHAPE), 2), BOX))


def case_layer(grid, ctx):
    """The layer built on the grid (collective: the counts all-reduced once): every output
    on every rank equals the function's on one device, for a batch and a single field,
    and so does the gradient of a loss of B and Q in each rank's block; its forward and
    backward passes run no triangle count."""
    import torchpm.bispectrum as module
    from torchpm.bispectrum import bispectrum
    from torchpm.distributed import PencilDecomposition
    from torchpm.nn import BispectrumEstimator

    mesh = PencilDecomposition(SHAPE, ctx["groups"][grid])
    options = dict(window="cic", n_particles=300)
    calls = []
    original = module._TrianglePlan.counts
    module._TrianglePlan.counts = lambda plan, k: calls.append(1) or original(plan, k)
    try:
        layer = BispectrumEstimator(SHAPE, BOX, dtype=torch.float64, mesh=mesh, **options)
        assert len(calls) == 1
        whole = global_random((2, *SHAPE), 4)
        fields = [whole.clone().requires_grad_(), mesh.local_real_part(whole).clone().requires_grad_()]
        results = [bispectrum(fields[0], BOX, **options), layer(fields[1])]
        assert len(calls) == 2  # (the function's own)
        assert_same(results[1], results[0])
        grads = [loss_gradient(field, result) for field, result in zip(fields, results)]
        assert len(calls) == 2, "the layer's forward or backward ran the triangle counts"
        assert_small(grads[1], mesh.local_real_part(grads[0]), "d loss / d field through the layer")
        assert_same(layer(mesh.local_real_part(whole[1])), bispectrum(whole[1], BOX, **options))
    finally:
        module._TrianglePlan.counts = original


def case_layer_bad_input(grid, ctx):
    """One rank's bad or different argument to the layer's construction, or one rank's bad
    block or batch size in its forward pass: every rank raises, naming that rank; the
    layer then still measures."""
    from torchpm.bispectrum import bispectrum
    from torchpm.distributed import PencilDecomposition
    from torchpm.nn import BispectrumEstimator

    mesh = PencilDecomposition(SHAPE, ctx["groups"][grid])
    last = ctx["rank"] == ctx["world"] - 1
    rank = f"rank {ctx['world'] - 1}"

    def build(**options):
        return lambda: BispectrumEstimator(SHAPE, BOX, dtype=torch.float64, mesh=mesh, **options)

    expect_error_everywhere(build(bins=4 if last else 3), "the ranks disagree on `bins`", rank)
    expect_error_everywhere(build(triangles=[(0, 1, 9 if last else 2)]), "`triangles` must be", rank)
    expect_error_everywhere(build(window="tsc" if last else "cic"), "the ranks disagree on `window`", rank)
    expect_error_everywhere(build(shot_noise=2.0 if last else 1.0), "the ranks disagree on the shot noise", rank)
    expect_error_everywhere(lambda: BispectrumEstimator((10, 8, 7) if last else SHAPE, BOX, mesh=mesh),
                            "`mesh` has the global shape", rank)
    layer = build()()
    whole = global_random((2, *SHAPE), 5)
    block = mesh.local_real_part(whole)
    expect_error_everywhere(lambda: layer(block[..., :-1] if last else block), "`field` must be a tensor of shape",
                            "this rank's block", rank)
    expect_error_everywhere(lambda: layer(block.float() if last else block), "`field` must be torch.float64", rank)
    broken = block.clone()
    if last:
        broken[0, 0, 0, 0] = float("inf")
    expect_error_everywhere(lambda: layer(broken), "`field` contains NaN or infinite values", rank)
    expect_error_everywhere(lambda: layer(block[:1] if last else block), "the ranks disagree on the batch size", rank)
    assert_same(layer(block), bispectrum(whole, BOX))


# ----------------------------------------------------------------------------
# The pytest side: one spawn per world size, one test per case.

world_results = world_results_fixture(__name__, case_ids, "bispectrum_world", timeout_s=600)


@pytest.mark.parametrize("world_size,case_id", [(w, c) for w in sorted(GRIDS) for c in case_ids(w)])
def test_distributed_bispectrum(world_results, world_size, case_id):
    errors = rank_errors(world_results(world_size)[case_id])
    if errors:
        pytest.fail(errors)
