"""Ranks that disagree about a collective raise the same clear error on every rank, on 2
and 3 gloo processes, before any mismatched all-to-all can run (gloo would abort a
process with "Received data size doesn't match expected size" or return wrong numbers).

Each case makes one rank (the last) pass another global shape, process grid, dtype,
batch, halo width, operation or per-particle attribute, and checks on every rank that
the error is a ValueError naming the argument and every rank's value. Then the ranks
run a correct distributed FFT and compare it with ``torch.fft.rfftn`` of the whole
field, which shows that no process died, the groups still work, and the check lets
agreeing calls through. A process that aborts or hangs shows up as "never reported"
(bounded by the pool's collective timeout).
"""

from __future__ import annotations

import pytest
import torch

from _spawn import grid_context, rank_errors, world_results_fixture

pytestmark = pytest.mark.distributed

GRIDS = {2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)]}
SHAPE = (8, 7, 6)  # uneven over 2 and 3 ranks
PER_GRID = ["global_shape", "dtype_rfftn", "dtype_irfftn", "batch_rfftn", "batch_irfftn", "halo_fill",
            "halo_add", "halo_paint", "operation", "local_error", "transpose_axis", "migrate_attribute_dtype",
            "migrate_attribute_shape", "migrate_debug_checks", "migrate_arguments", "plan_calls", "migrate_batch", "migrate_positions_dtype", "spectrum_bins", "spectrum_box",
            "paint_density_batch", "paint_not_owned", "paint_not_owned_deferred", "readout_bad_field", "setting", "check_off",
            "simulation_integrator", "simulation_cosmology", "simulation_power_alias", "gather_batch", "gather_no_ids", "density_ids",
            "thin_blocks", "resume_no_ids", "resume_step", "run_agreement", "readout_not_owned", "different_checks",
            "different_labels", "noise_agreement", "hand_written_loop", "simulation_bad_argument",
            "decomposition_bad_argument", "simulation_callables", "same_tensor_twice", "layer_arguments",
            "run_callback", "huge_integers", "paint_density_arguments", "values_after_construction", "run_input"]
PER_WORLD = ["grid_axis", "simulation_grid_arguments", "grid_groups_arguments"]


def case_ids(world_size):
    ids = [f"{kind}-{p0}x{p1}" for p0, p1 in GRIDS[world_size] for kind in PER_GRID]
    return ids + [f"{kind}-{GRIDS[world_size][0][0]}x{GRIDS[world_size][0][1]}" for kind in PER_WORLD]


# ----------------------------------------------------------------------------
# Inside the spawned processes.


def make_context(world_size):
    return grid_context(world_size, GRIDS)


def run_case(case_id, ctx):
    kind, grid_text = case_id.rsplit("-", 1)
    grid = tuple(int(p) for p in grid_text.split("x"))
    ctx["odd"] = ctx["rank"] == ctx["world"] - 1  # the rank that disagrees
    globals()[f"case_{kind}"](grid, ctx)
    check_still_works(grid, ctx)


def decomposition(grid, ctx, shape=SHAPE, **kwargs):
    from torchpm.distributed import PencilDecomposition

    return PencilDecomposition(shape, ctx["groups"][grid], **kwargs)


def expect_error(call, ctx, *fragments, exception=ValueError, ranks=None):
    """``call()`` must raise ``exception`` on this rank, naming every fragment (the argument,
    each rank's value) and every rank of the world (or of ``ranks``)."""
    try:
        call()
    except exception as error:
        text = str(error)
        ranks = range(ctx["world"]) if ranks is None else ranks
        for fragment in (*fragments, *(f"rank {r}" for r in ranks)):
            assert fragment in text, f"{fragment!r} missing from the error: {text}"
        return text
    raise AssertionError(f"rank {ctx['rank']}: the disagreeing call did not raise {exception.__name__}")


def odd_rank(ctx):
    """The rank that fails alone: the error names it (the others, with nothing wrong, are
    not listed)."""
    return [ctx["world"] - 1]


def check_still_works(grid, ctx):
    """After the error: a correct FFT on the same groups equals the serial one."""
    mesh = decomposition(grid, ctx)
    whole = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    local = mesh.rfftn(mesh.local_real_part(whole))
    expected = mesh.local_fourier_part(torch.fft.rfftn(whole, dim=(-3, -2, -1)))
    assert torch.allclose(local, expected, rtol=0, atol=1e-12), "distributed FFT after the error is wrong"


def field(mesh, batch=1, dtype=torch.float64):
    return torch.ones(batch, *mesh.local_real_shape, dtype=dtype)


def case_global_shape(grid, ctx):
    shape = (16, 7, 6) if ctx["odd"] else SHAPE
    expect_error(lambda: decomposition(grid, ctx, shape), ctx, "disagree", "(16, 7, 6)", "(8, 7, 6)")


def case_grid_axis(grid, ctx):
    """The same group used as grid axis 0 on some ranks and axis 1 on another: x slabs
    against y slabs."""
    import torch.distributed as dist

    from torchpm.distributed import PencilDecomposition

    world = dist.group.WORLD
    groups = (None, world) if ctx["odd"] else (world, None)
    p = ctx["world"]
    expect_error(lambda: PencilDecomposition(SHAPE, groups), ctx, "disagree", f"grid ({p}, 1)", f"grid (1, {p})")


def case_dtype_rfftn(grid, ctx):
    mesh = decomposition(grid, ctx)
    dtype = torch.float32 if ctx["odd"] else torch.float64
    expect_error(lambda: mesh.rfftn(field(mesh, dtype=dtype)), ctx,
                 "dtype of `field`", "torch.float32", "torch.float64", "rfftn")


def case_dtype_irfftn(grid, ctx):
    mesh = decomposition(grid, ctx)
    dtype = torch.complex64 if ctx["odd"] else torch.complex128
    field_k = torch.ones(1, *mesh.local_fourier_shape, dtype=dtype)
    expect_error(lambda: mesh.irfftn(field_k), ctx, "dtype of `field_k`", "torch.complex64", "torch.complex128")


def case_batch_rfftn(grid, ctx):
    mesh = decomposition(grid, ctx)
    batch = 1 if ctx["odd"] else 2
    expect_error(lambda: mesh.rfftn(field(mesh, batch)), ctx, "leading (batch) shape of `field`", "(1,)", "(2,)")


def case_batch_irfftn(grid, ctx):
    """Same number of elements, other leading shape: (2, 3) against (3, 2)."""
    mesh = decomposition(grid, ctx)
    leading = (3, 2) if ctx["odd"] else (2, 3)
    field_k = torch.ones(*leading, *mesh.local_fourier_shape, dtype=torch.complex128)
    expect_error(lambda: mesh.irfftn(field_k), ctx, "leading (batch) shape of `field_k`", "(3, 2)", "(2, 3)")


def case_halo_fill(grid, ctx):
    mesh = decomposition(grid, ctx)
    width = 2 if ctx["odd"] else 1
    expect_error(lambda: mesh.fill_halo(mesh.pad_halo(field(mesh), width), width), ctx,
                 "halo `width`", "((2, 2), (2, 2))", "((1, 1), (1, 1))", "fill_halo")


def case_halo_add(grid, ctx):
    """Widths that differ only on one side of one axis."""
    mesh = decomposition(grid, ctx)
    width = ((1, 1), (0, 1)) if ctx["odd"] else ((1, 1), (1, 1))
    expect_error(lambda: mesh.add_halo(mesh.pad_halo(field(mesh), width), width), ctx,
                 "halo `width`", "((1, 1), (0, 1))", "((1, 1), (1, 1))", "add_halo")


def case_halo_paint(grid, ctx):
    """Painting with another stencil on one rank: the halo exchanges behind them differ."""
    mesh = decomposition(grid, ctx)
    positions = torch.rand(1, 10, 3, dtype=torch.float64) * torch.tensor(mesh.local_real_shape, dtype=torch.float64)
    positions = positions + torch.tensor(mesh.local_real_offset, dtype=torch.float64)
    order = "pcs" if ctx["odd"] else "cic"
    expect_error(lambda: mesh.paint(positions, order=order), ctx, "halo widths of `order`", "paint", "(1, 2)",
                 "(0, 1)")


def case_operation(grid, ctx):
    mesh = decomposition(grid, ctx)
    if ctx["odd"]:
        call = lambda: mesh.fill_halo(mesh.pad_halo(field(mesh), 1), 1)  # noqa: E731
    else:
        call = lambda: mesh.rfftn(field(mesh))  # noqa: E731
    expect_error(call, ctx, "different collective operations", "PencilDecomposition.rfftn",
                 "PencilDecomposition.fill_halo")


def case_local_error(grid, ctx):
    """A bad argument on one rank: the others raise too instead of waiting in the all-to-all."""
    mesh = decomposition(grid, ctx)
    value = torch.ones(1, 3, 3, 3) if ctx["odd"] else field(mesh)
    expect_error(lambda: mesh.rfftn(value), ctx, "expected `field` of shape", "(1, 3, 3, 3)", ranks=odd_rank(ctx))


def case_transpose_axis(grid, ctx):
    """The exposed transpose step: one rank transposes along the other grid axis."""
    mesh = decomposition(grid, ctx)
    lx, ly, nz = mesh.local_real_shape
    t = torch.ones(1, lx, ly, nz // 2 + 1, dtype=torch.complex128)
    axis = 0 if ctx["odd"] else 1
    # Rank-local shape errors for the unexpected axis are reported together as well.
    text = expect_error(lambda: mesh.transpose(t, axis), ctx, "transpose", ranks=odd_rank(ctx))
    assert "`axis`" in text or "does not match the layout" in text, text


def particles(mesh, batch=1, count=12, dtype=torch.float64):
    generator = torch.Generator().manual_seed(7)
    positions = torch.rand(batch, count, 3, generator=generator, dtype=dtype) * torch.tensor(SHAPE, dtype=dtype)
    ids = torch.arange(batch * count, dtype=torch.int64).view(batch, count)
    return positions, ids


def case_migrate_attribute_dtype(grid, ctx):
    mesh = decomposition(grid, ctx)
    positions, ids = particles(mesh)
    attribute = torch.zeros(1, 12, 3, dtype=torch.float32 if ctx["odd"] else torch.float64)
    expect_error(lambda: mesh.migrate(positions, ids, attribute), ctx,
                 "attributes (dtype, per-particle shape)", "torch.float32", "torch.float64", "migrate")


def case_migrate_attribute_shape(grid, ctx):
    mesh = decomposition(grid, ctx)
    positions, ids = particles(mesh)
    attribute = torch.zeros(1, 12, 2 if ctx["odd"] else 3, dtype=torch.float64)
    expect_error(lambda: mesh.migrate(positions, ids, attribute), ctx,
                 "attributes (dtype, per-particle shape)", "(2,)", "(3,)")


def case_migrate_debug_checks(grid, ctx):
    """The migration's debug checks (more collectives) on some ranks only."""
    from torchpm.distributed import debug_checks

    mesh = decomposition(grid, ctx)
    positions, ids = particles(mesh)
    before = debug_checks()
    debug_checks(bool(ctx["odd"]))
    try:
        expect_error(lambda: mesh.migrate(positions, ids), ctx, "debug checks (TORCHPM_DEBUG_MIGRATION", "False", "True")
    finally:
        debug_checks(before)


def case_migrate_batch(grid, ctx):
    """Different batch sizes (the slot count n may differ; the batch may not)."""
    mesh = decomposition(grid, ctx)
    positions, ids = particles(mesh, batch=1 if ctx["odd"] else 2, count=5 + ctx["rank"])
    expect_error(lambda: mesh.migrate(positions, ids), ctx, "batch size", "rank 0 (grid (0, 0)): 2")


def case_migrate_arguments(grid, ctx):
    """A bad `destination` or `capacity` on one rank raises on every rank before the
    exchange (an int32 destination made the ranks pack their messages differently and
    wait until the timeout; a rank out of range, a wrong shape or a string capacity
    raised on that rank alone, mid-exchange). A capacity exceeded on one rank is named
    with that rank's capacity (every rank named its own: "the capacity None")."""
    mesh = decomposition(grid, ctx)
    positions, ids = particles(mesh)
    home = torch.zeros_like(ids)
    last = ctx["world"] - 1
    for destination, fragment in [(home.int(), "expected `destination` as int64 of shape (1, 12)"),
                                  (home[:, :3], "expected `destination` as int64 of shape (1, 12)"),
                                  (home + ctx["world"], f"grid ranks 0 .. {last}"),
                                  (home - 1, f"grid ranks 0 .. {last}")]:
        expect_error(lambda: mesh.migrate(positions, ids, destination=destination if ctx["odd"] else home), ctx,
                     "PencilDecomposition.migrate", fragment, ranks=odd_rank(ctx))
    for capacity in ["100", 0, -5, 2.5, True]:
        expect_error(lambda: mesh.migrate(positions, ids, capacity=capacity if ctx["odd"] else None), ctx,
                     f"`capacity` must be a positive integer or None, got {capacity!r}", ranks=odd_rank(ctx))
    expect_error(lambda: mesh.migrate(positions.half(), ids), ctx, "expected float32 or float64 `positions`")
    # empty slots may hold any destination
    _, _, moved, *_ = mesh.migrate(positions, torch.where(ids % 2 == 0, ids, -1),
                                   destination=torch.where(ids % 2 == 0, home, 99))
    assert int((moved >= 0).sum()) == (6 * ctx["world"] if ctx["rank"] == 0 else 0)
    expect_error(lambda: mesh.migrate(positions, ids, capacity=2 if ctx["odd"] else None), ctx,
                 f"rank {last} (grid", "more than the capacity 2", exception=RuntimeError, ranks=odd_rank(ctx))


def case_plan_calls(grid, ctx):
    """A migration plan's exchange and gather with another dtype, per-particle shape or
    shape on one rank raise on every rank (gloo aborted one rank; the other returned
    wrong values); agreeing calls move the values with their particles."""
    mesh = decomposition(grid, ctx)
    positions, ids = particles(mesh)
    ids = ids * ctx["world"] + ctx["rank"]
    plan, moved, moved_ids = mesh.migrate(positions, ids)
    odd = ctx["odd"]
    expect_error(lambda: plan.exchange(positions.float() if odd else positions), ctx, "MigrationPlan.exchange",
                 "tensors (dtype, per-particle shape)", "torch.float32", "torch.float64")
    expect_error(lambda: plan.exchange(positions[..., :2] if odd else positions), ctx, "(2,)", "(3,)")
    expect_error(lambda: plan.exchange(positions[:, :3] if odd else positions), ctx,
                 "MigrationPlan.exchange: expected a per-particle tensor of shape (1, 12, ...)", ranks=odd_rank(ctx))
    expect_error(lambda: plan.gather(moved.float() if odd else moved), ctx, "MigrationPlan.gather",
                 "torch.float32", "torch.float64")
    valid = moved_ids >= 0
    assert torch.equal(plan.exchange(ids.double(), fill=-1)[valid], moved_ids[valid].double())
    assert torch.equal(plan.gather(moved), positions)


def case_migrate_positions_dtype(grid, ctx):
    mesh = decomposition(grid, ctx)
    positions, ids = particles(mesh, dtype=torch.float32 if ctx["odd"] else torch.float64)
    expect_error(lambda: mesh.migrate(positions, ids), ctx, "dtype of `positions`", "torch.float32",
                 "torch.float64")


def case_spectrum_bins(grid, ctx):
    """The shell sums are all-reduced: another number of bins would mismatch them."""
    from torchpm.analysis import power_spectrum

    mesh = decomposition(grid, ctx)
    bins = 3 if ctx["odd"] else 4
    expect_error(lambda: power_spectrum(field(mesh), 100.0, bins=bins, mesh=mesh), ctx, "`bins`", ": 3", ": 4")


def case_spectrum_box(grid, ctx):
    """Another box gives another default number of shells."""
    from torchpm.analysis import cross_power

    mesh = decomposition(grid, ctx)
    box = 50.0 if ctx["odd"] else 100.0
    expect_error(lambda: cross_power(field(mesh), field(mesh), box, mesh=mesh), ctx, "`box_size`", "50.0", "100.0")


def case_paint_density_batch(grid, ctx):
    from torchpm.analysis import paint_density

    mesh = decomposition(grid, ctx)
    positions, _ = particles(mesh, batch=1 if ctx["odd"] else 2)
    expect_error(lambda: paint_density(positions, mesh), ctx, "batch size", "paint_density")


def simulation(grid, ctx, **overrides):
    import torchpm

    config = dict(n_particles=(6, 5, 4), box_size=24.0, steps=1, dtype=torch.float64, mesh=ctx["groups"][grid])
    return torchpm.Simulation(**dict(config, **overrides))


def case_simulation_integrator(grid, ctx):
    """Ranks that build their Simulation with different physics raise together (the
    shapes alone agree, so the run would otherwise mix two configurations)."""
    integrator = "leapfrog" if ctx["odd"] else "fastpm"
    expect_error(lambda: simulation(grid, ctx, integrator=integrator), ctx, "disagree", "`integrator`",
                 "leapfrog", "fastpm", "Simulation")


def case_simulation_bad_argument(grid, ctx):
    """One rank's invalid constructor argument raises on every rank together, with that
    rank's own message and error type (it raised on that rank alone, at once, while the
    others waited in the construction's first collective until the timeout)."""
    from torchpm.config import SettingError

    odd = [ctx["world"] - 1]
    text = expect_error(lambda: simulation(grid, ctx, box_size=-1.0 if ctx["odd"] else 24.0), ctx,
                        "`box_size` must be a finite number", "every rank of the", ranks=odd, exception=SettingError)
    assert "rank 0 (" not in text, text  # only the failing rank is named
    expect_error(lambda: simulation(grid, ctx, dtype="float32" if ctx["odd"] else torch.float64), ctx,
                 "`dtype` must be torch.float32 or torch.float64", ranks=odd)
    # every rank failing: each rank's message, once
    expect_error(lambda: simulation(grid, ctx, memory_check=f"rank{ctx['rank']}"), ctx,
                 *(f"got 'rank{r}'" for r in range(ctx["world"])))
    assert simulation(grid, ctx).particle_shape == (6, 5, 4)  # the groups still work


def case_decomposition_bad_argument(grid, ctx):
    """One rank's invalid PencilDecomposition argument, or a mesh too small for the grid
    on one rank alone, raises on every rank together (it raised on that rank alone while
    the others waited in the construction's agreement until the timeout)."""
    odd = [ctx["world"] - 1]
    expect_error(lambda: decomposition(grid, ctx, shape=(8, 7.5, 6) if ctx["odd"] else SHAPE), ctx,
                 "`global_shape` must be 3 integers, got (8, 7.5, 6)", ranks=odd)
    expect_error(lambda: decomposition(grid, ctx, check_agreement="no" if ctx["odd"] else None), ctx,
                 "`check_agreement` must be None, True or False", ranks=odd, exception=TypeError)
    thin = (1, 1, 6) if ctx["odd"] else SHAPE
    expect_error(lambda: decomposition(grid, ctx, shape=thin), ctx, "is too small for the", ranks=odd)


def case_grid_groups_arguments(grid, ctx):
    """process_grid_groups makes groups over the world (new_group is collective): one rank
    with another grid or timeout, or a bad grid, raises on every rank before any group."""
    import datetime

    import torch.distributed as dist

    from torchpm.distributed import process_grid_groups

    world = ctx["world"]
    expect_error(lambda: process_grid_groups((1, world) if ctx["odd"] else (world, 1)), ctx,
                 "process_grid_groups: the ranks disagree on `grid`", f"({world}, 1)", f"(1, {world})")
    expect_error(lambda: process_grid_groups((world, 1.0) if ctx["odd"] else (world, 1)), ctx,
                 "`grid` must be 2 positive integers (P0, P1), got (%d, 1.0)" % world, ranks=[world - 1])
    expect_error(lambda: process_grid_groups((world, 1), backend="mpi" if ctx["odd"] else None), ctx,
                 "process_grid_groups: the ranks disagree on `backend`", "mpi", "None")
    # a rank's own timeout may differ (each rank's groups are its own)
    groups = process_grid_groups((world, 1), timeout=datetime.timedelta(seconds=50 + ctx["odd"]))
    assert groups[1] is None and dist.get_world_size(groups[0]) == world


def case_simulation_callables(grid, ctx):
    """Callables the ranks build a Simulation with are compared by more than their type or
    name: two lambdas of one line with other constants, and a NeuralSplineCorrection of
    another k_max (equal weights), ran mixed physics without an error; the same callable
    built on every rank runs."""
    import torchpm
    from torchpm.cosmology import linear_power
    from torchpm.nn import NeuralSplineCorrection

    correction = (lambda k, a: 2.0 + 0 * k) if ctx["odd"] else (lambda k, a: 1.0 + 0 * k)
    expect_error(lambda: simulation(grid, ctx, force_correction=correction), ctx,
                 "the ranks disagree on `force_correction`", "<lambda>")
    power = (lambda k, c: 4 * linear_power(k, c)) if ctx["odd"] else (lambda k, c: linear_power(k, c))
    expect_error(lambda: simulation(grid, ctx, power_spectrum=power), ctx, "the ranks disagree on `power_spectrum`")
    torch.manual_seed(0)
    spline = NeuralSplineCorrection(k_max=0.5 if ctx["odd"] else 2.0)
    expect_error(lambda: simulation(grid, ctx, force_correction=spline), ctx,
                 "the ranks disagree on `force_correction`", "module NeuralSplineCorrection")
    scale = 0.5
    sim = simulation(grid, ctx, force_correction=lambda k, a: 1.0 + scale * 0 * k,
                     power_spectrum=lambda k, c: linear_power(k, c))
    assert isinstance(sim, torchpm.Simulation)


def case_same_tensor_twice(grid, ctx):
    """A cross spectrum of one tensor passed twice on some ranks and as two equal tensors on
    others (a transform fewer on the first: gloo aborted a rank) equals the auto spectrum."""
    from torchpm.analysis import correlation_coefficient, cross_power, power_spectrum

    mesh = decomposition(grid, ctx)
    whole = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    block = mesh.local_real_part(whole)
    other = block if ctx["odd"] else block.clone()
    auto = power_spectrum(block, 24.0, mesh=mesh).power
    assert torch.allclose(cross_power(block, other, 24.0, mesh=mesh).power, auto, rtol=1e-12, atol=0)
    assert torch.allclose(correlation_coefficient(block, other, 24.0, mesh=mesh).power, torch.ones_like(auto),
                          rtol=1e-12, atol=0)


def case_layer_arguments(grid, ctx):
    """torchpm.nn layers on a grid: `other` passed on one rank only (one more FFT there:
    gloo aborted a rank), a bad shape on one rank at construction (it raised there alone)."""
    from torchpm.nn import BispectrumEstimator, CICPaint, CorrelationFunction, PowerSpectrum

    mesh = decomposition(grid, ctx)
    block = field(mesh)
    for layer in (PowerSpectrum(SHAPE, 24.0, mesh=mesh, dtype=torch.float64),
                  CorrelationFunction(SHAPE, 24.0, mesh=mesh, dtype=torch.float64)):
        expect_error(lambda: layer(block, block.clone() if ctx["odd"] else None), ctx,
                     "the ranks disagree on `other`", "None", "a field")
    expect_error(lambda: CICPaint((0, 7, 6) if ctx["odd"] else SHAPE, mesh=mesh), ctx,
                 "CICPaint: `shape` must be positive integers", ranks=odd_rank(ctx))
    expect_error(lambda: BispectrumEstimator("x" if ctx["odd"] else SHAPE, 24.0, mesh=mesh), ctx,
                 "BispectrumEstimator: `shape` must be", ranks=odd_rank(ctx))


def case_run_callback(grid, ctx):
    """A run's callback raising on one rank raises a RuntimeError naming it on every rank
    (the others waited in the next step's collectives), in a run and in evolve; the ranks
    must all pass a callback or none; a state gathered in other units on one rank is named."""
    sim = simulation(grid, ctx, steps=2)
    noise = sim.white_noise(seed=2)

    def callback(step, a):
        if ctx["odd"] and step == 1:
            raise KeyError("a failing callback")

    expect_error(lambda: sim(noise, callback=callback), ctx, "`callback` raised at step 1", "KeyError",
                 "a failing callback", exception=RuntimeError, ranks=odd_rank(ctx))
    # a callback on some ranks only (a progress bar on rank 0) runs, with the checks on and off,
    # and a raising one on one of them still raises on every rank
    seen = []
    for checked in (True, False):
        sim.force_mesh.check_agreement = sim.particle_mesh.check_agreement = checked
        sim(noise, callback=(lambda step, a: seen.append(step)) if ctx["rank"] == 0 else None)
        expect_error(lambda: sim(noise, callback=callback if ctx["odd"] else None), ctx,
                     "`callback` raised at step 1", exception=RuntimeError, ranks=odd_rank(ctx))
    sim.force_mesh.check_agreement = sim.particle_mesh.check_agreement = True
    assert seen == ([0, 1, 2] * 2 if ctx["rank"] == 0 else []), seen
    state = sim(noise, until=sim.scale_factors[1], return_mesh_units=True)

    def last_step(step, a):
        if ctx["odd"] and step == 2:
            raise KeyError("after the last step")

    # (raised after the last step: the other ranks returned a result while this one raised)
    expect_error(lambda: sim.evolve(state.positions, state.momenta, sim.growth_table(), last_step, ids=state.ids,
                                    start=1), ctx, "`callback` raised at step 2", "after the last step",
                 exception=RuntimeError, ranks=odd_rank(ctx))
    steps = []
    sim.evolve(state.positions, state.momenta, sim.growth_table(), lambda step, a: steps.append(step), ids=state.ids,
               start=1)
    assert steps == [2], steps
    # an observer or callback calling a collective on one rank only: each side's check
    # meets the other's, and every rank raises at once (the rank whose own call failed
    # then waited in the follow-up check for ranks that had raised already)
    def observe(state):
        return sim.density(state).sum() if ctx["odd"] else None

    expect_error(lambda: sim.trajectory(noise, at=[sim.scale_factors[1]], observe=observe), ctx,
                 "the ranks called different collective operations", "Simulation.density", exception=RuntimeError,
                 ranks=[])

    def collective_callback(step, a):
        if ctx["odd"] and step == 1:
            sim.white_noise(seed=3)

    expect_error(lambda: sim(noise, callback=collective_callback), ctx,
                 "the ranks called different collective operations", "Simulation.white_noise",
                 exception=RuntimeError, ranks=[])
    mixed = sim(noise, return_mesh_units=ctx["odd"])
    expect_error(lambda: sim.gather(mixed), ctx, "the ranks disagree on the state's units (its type)",
                 "MeshUnitsState", "SimulationState")


def case_huge_integers(grid, ctx):
    """An integer beyond int64 on one rank is named in the disagreement (it raised 'Overflow
    when unpacking long long' there alone, the others waiting)."""
    from torchpm.analysis import power_spectrum

    mesh = decomposition(grid, ctx)
    expect_error(lambda: power_spectrum(field(mesh), 24.0, mesh=mesh, bins=2**70 if ctx["odd"] else 3), ctx,
                 "the ranks disagree on `bins`", str(2**70))
    expect_error(lambda: power_spectrum(field(mesh), 24.0, mesh=mesh, bins=2**70), ctx,
                 f"`bins` must be at most {2**24} (2**24), got {2**70}", ranks=[])  # (each rank's own, alike)


def case_paint_density_arguments(grid, ctx):
    """paint_density: one rank's bad `order`, `interlacing` or positions raise on every rank
    (they raised on that rank alone); a rank without particles paints weights (its weights'
    reshape failed) and the field equals the one-device one."""
    from torchpm.analysis import paint_density

    mesh = decomposition(grid, ctx)
    positions, _ = particles(mesh)
    expect_error(lambda: paint_density(positions, mesh, order="bogus" if ctx["odd"] else "cic"), ctx,
                 "`order` must be one of", ranks=odd_rank(ctx))
    expect_error(lambda: paint_density(positions, mesh, interlacing="no" if ctx["odd"] else False), ctx,
                 "`interlacing` must be a bool", ranks=odd_rank(ctx), exception=TypeError)  # (the type kept)
    expect_error(lambda: paint_density(positions[..., :2] if ctx["odd"] else positions, mesh), ctx,
                 "expected `positions` of shape (B, N, 3)", ranks=odd_rank(ctx))
    weights = torch.arange(1.0, 13.0, dtype=torch.float64).reshape(1, 12, 1).expand(1, 12, 2)
    mine = (positions, weights) if ctx["rank"] == 0 else (positions[:, :0], weights[:, :0])
    block = paint_density(mine[0], mesh, weights=mine[1])
    expected = mesh.local_real_part(paint_density(positions, shape=SHAPE, weights=weights))
    assert block.shape == expected.shape and torch.allclose(block, expected, rtol=0, atol=1e-12)


def case_values_after_construction(grid, ctx):
    """A Simulation made float64 on one rank after construction is named at the noise (its
    memory check, once per dtype, ran on that rank alone: a MemoryError there and 'other
    operations' elsewhere); a string scale factor to forces on one rank is named (it was
    torch's "invalid data type 'str'"); write_fields takes a = 1 and a = 1.0 as one value."""
    import os
    import shutil
    import tempfile

    from torchpm.io import write_fields

    sim = simulation(grid, ctx, dtype=torch.float32)
    changed = sim.double() if ctx["odd"] else sim
    expect_error(lambda: changed.white_noise(seed=1), ctx, "the ranks disagree on `dtype` (now)", "torch.float64",
                 "torch.float32")
    sim = simulation(grid, ctx)
    state = sim(sim.white_noise(seed=1), return_mesh_units=True)
    expect_error(lambda: sim.forces(state.positions, "1.0" if ctx["odd"] else 1.0, state.ids), ctx,
                 "forces: `a` must be a scale factor (a number or a tensor), got '1.0'", ranks=odd_rank(ctx))
    folder = os.path.join(tempfile.gettempdir(), f"torchpm-agreement-{os.getppid()}-{grid[0]}x{grid[1]}")
    os.makedirs(folder, exist_ok=True)
    path = write_fields(os.path.join(folder, "fields.hdf5"), {"rho": sim.density(state)}, 24.0, mesh=sim.force_mesh,
                        a=1 if ctx["odd"] else 1.0, overwrite=True)
    assert os.path.exists(path)
    sim.force_mesh.all_reduce(torch.zeros(1))  # (every rank has checked the file before it goes)
    if ctx["rank"] == 0:
        shutil.rmtree(folder)
    # one rank's float16 module, or another memory_check, is named at the noise (the dtype
    # property raised there alone; the memory check ran on one rank only)
    half = simulation(grid, ctx, dtype=torch.float32)
    if ctx["odd"]:
        half = half.half()
    expect_error(lambda: half.white_noise(seed=1), ctx, "the ranks disagree on `dtype` (now)", "torch.float16")
    warned = simulation(grid, ctx)
    warned.memory_check = "warn" if ctx["odd"] else "error"
    expect_error(lambda: warned.white_noise(seed=1, batch=2), ctx, "the ranks disagree on `memory_check` (now)")


def case_simulation_grid_arguments(grid, ctx):
    """With ``grid=`` the groups are made from the world (``new_group`` is collective):
    one rank's bad argument, bad or different grid, or another particle grid under
    ``grid="auto"`` raises on every rank before any group is made, naming it; then the
    same world builds a grid run."""
    import torchpm

    world = ctx["world"]
    odd = [world - 1]

    def build(**overrides):
        config = dict(n_particles=(6, 5, 4), box_size=24.0, steps=1, dtype=torch.float64, grid=(world, 1))
        return torchpm.Simulation(**dict(config, **overrides))

    expect_error(lambda: build(a_start=2.0 if ctx["odd"] else 0.1), ctx, "`a_start`",
                 f"every rank of the world ({world} processes)", ranks=odd)
    expect_error(lambda: build(grid="bogus" if ctx["odd"] else (world, 1)), ctx,
                 "`grid` must be (P0, P1) or 'auto', got 'bogus'", ranks=odd)
    expect_error(lambda: build(grid=(1, world) if ctx["odd"] else (world, 1)), ctx,
                 "the ranks disagree on `grid` as (P0, P1)", f"({world}, 1)", f"(1, {world})", ranks=range(world))
    expect_error(lambda: build(grid="auto", n_particles=(6, 5, 6) if ctx["odd"] else (6, 5, 4)), ctx,
                 "the ranks disagree on `n_particles`", "(6, 5, 6)", "(6, 5, 4)")
    sim = build(grid="auto")
    assert sim.force_mesh.grid.size == world and not sim.force_mesh.is_local
    noise = sim.white_noise(seed=3)
    assert sim(noise).positions.shape[0] == 1


def case_noise_agreement(grid, ctx):
    """Ranks asking for the white noise of different seeds (each rank makes its block of the
    field of its seed: the run would mix fields), or passing different whole fields (each
    its own unseeded draw), raise on every rank; the same whole field on every rank runs,
    as its blocks do."""
    sim = simulation(grid, ctx)
    expect_error(lambda: sim.white_noise(seed=ctx["rank"]), ctx, "Simulation.white_noise", "`seed`")
    expect_error(lambda: sim.white_noise(batch=2 if ctx["odd"] else 1), ctx, "Simulation.white_noise", "`batch`")
    shape = sim.particle_shape
    own = torch.randn(1, *shape, generator=torch.Generator().manual_seed(ctx["rank"]), dtype=torch.float64)
    expect_error(lambda: sim(own), ctx, "the whole `white_noise` each rank passed (sums of its values")
    expect_error(lambda: sim(own.to(torch.bfloat16)), ctx, "the whole `white_noise` each rank passed")
    same = torch.randn(1, *shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    whole_run = sim(same)
    block_run = sim(sim.particle_mesh.local_real_part(same))
    assert torch.equal(whole_run.positions, block_run.positions)
    assert sim(same.to(torch.bfloat16)).positions.shape == whole_run.positions.shape  # (converted, as before)


def case_run_agreement(grid, ctx):
    """What one rank changes after construction, or asks differently of a run, raises on
    every rank at the run's start (it used to run two configurations mixed, raise on one
    rank alone, or abort gloo in the backward pass)."""
    import torchpm
    from _models import AmplifiedPower
    from torchpm.nn import PGDCorrection

    sim = simulation(grid, ctx)
    noise = sim.white_noise(seed=1)
    if ctx["odd"]:
        sim.cosmology = torchpm.Planck15(Omega_c=0.3)
    expect_error(lambda: sim(noise), ctx, "Simulation.forward", "`cosmology` (its parameters now)", "'Omega_c': 0.3,")
    sim.cosmology = torchpm.Planck15()
    expect_error(lambda: sim(noise, until=0.55 if ctx["odd"] else None), ctx, "Simulation.forward",
                 "`until` = 0.55 is not one of the simulation's scale factors", ranks=odd_rank(ctx))
    expect_error(lambda: sim(noise.clone().requires_grad_(ctx["odd"])), ctx, "gradients needed")
    # another batch size on one rank: one ValueError naming it (was a MemoryError on one
    # rank and a ValueError on the others, neither naming the batch)
    expect_error(lambda: sim(noise.expand(2, *noise.shape[1:]) if ctx["odd"] else noise), ctx,
                 "the batch size of the input")
    omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=ctx["odd"])
    sim.cosmology = torchpm.Planck15(Omega_c=omega_c)
    expect_error(lambda: sim(noise), ctx, "gradients needed")
    sim.cosmology = torchpm.Planck15()
    sim.force_correction = PGDCorrection(k_long=0.1, k_short=0.8, alpha=0.3 if ctx["odd"] else 0.2, dtype=torch.float64)
    expect_error(lambda: sim(noise), ctx, "`force_correction` weights (now)")
    sim.force_correction = PGDCorrection(k_long=0.1, k_short=0.8, alpha=0.2, dtype=torch.float64)
    sim.force_correction.requires_grad_(not ctx["odd"])
    expect_error(lambda: sim(noise), ctx, "gradients needed")
    # conditions without gradients (set as plain values) are weights too: different ones
    # ran a mixed correction without a word
    from torchpm.nn import NeuralSplineCorrection

    torch.manual_seed(0)
    spline = NeuralSplineCorrection(k_max=2.0, conditions=1, dtype=torch.float64)
    spline.set_conditions([0.8 if ctx["odd"] else 0.3])
    sim.force_correction = spline
    expect_error(lambda: sim(noise), ctx, "`force_correction` weights (now)")
    sim.force_correction = None
    if ctx["odd"]:
        sim.float()
    expect_error(lambda: sim(noise), ctx, "`dtype` (now)", "torch.float32", "torch.float64")
    sim.double()
    power = AmplifiedPower()
    if ctx["odd"]:
        with torch.no_grad():
            power.amplitude.fill_(1.2)
    sim.power = power
    expect_error(lambda: sim(noise), ctx, "`power_spectrum` weights (now)")
    sim.power = AmplifiedPower()
    assert sim(noise).positions.shape[0] == 1  # agreed again: runs
    sim.force_correction = None
    state = sim(noise, until=sim.scale_factors[0], return_mesh_units=True)
    if ctx["odd"]:
        sim.cosmology = torchpm.Planck15(Omega_c=0.3)
    expect_error(lambda: sim.resume(state, mesh_units=True), ctx, "Simulation.resume", "`cosmology` (its parameters now)")


def case_run_input(grid, ctx):
    """A run from `state` on one rank and from white noise (or the linear field) on the
    others names the input, and nothing that merely follows from it (the message named the
    state's step, or the operation the linear field's FFT met)."""
    sim = simulation(grid, ctx, steps=2)
    noise = sim.white_noise(seed=3)
    state = sim(noise, until=sim.scale_factors[1])
    last = [sim.scale_factors[-1]]
    text = expect_error(lambda: sim.trajectory(state=state, at=last) if ctx["odd"] else sim.trajectory(noise, at=last),
                        ctx, "Simulation.trajectory", "the ranks disagree on the run's input", ": state", ": white_noise")
    assert "state's step" not in text and "batch size" not in text, text
    field = sim.linear_field(noise)
    text = expect_error(lambda: sim(linear_field=field) if ctx["odd"] else sim(noise), ctx, "Simulation.forward",
                        "the ranks disagree on the run's input", ": linear_field", ": white_noise")
    assert "different collective operations" not in text, text


def case_simulation_power_alias(grid, ctx):
    """Two names of one built-in spectrum are one setting: no error."""
    sim = simulation(grid, ctx, power_spectrum="eh" if ctx["odd"] else "eisenstein_hu")
    assert sim.steps == 1


def case_simulation_cosmology(grid, ctx):
    import torchpm

    parameters = {key: float(value) for key, value in torchpm.Planck15().parameters().items()}
    parameters["sigma8"] += 1e-9 if ctx["odd"] else 0.0
    cosmology = torchpm.Cosmology(**parameters)
    expect_error(lambda: simulation(grid, ctx, cosmology=cosmology), ctx, "disagree", "`cosmology`",
                 "'sigma8': 0.8159000009999999", "'sigma8': 0.8159,", "Simulation")


def case_gather_batch(grid, ctx):
    """gather with another batch on one rank: an error on every rank, not a gloo abort."""
    sim = simulation(grid, ctx, steps=0)
    state = sim(sim.white_noise(batch=2, seed=3))
    if ctx["odd"]:
        state = state._replace(positions=state.positions[:1], momenta=state.momenta[:1], ids=state.ids[:1])
    expect_error(lambda: sim.gather(state), ctx, "disagree", "batch size of the state", "Simulation.gather")


def case_gather_no_ids(grid, ctx):
    sim = simulation(grid, ctx, steps=0)
    state = sim(sim.white_noise(seed=3))
    if ctx["odd"]:
        state = state._replace(ids=None)
    expect_error(lambda: sim.gather(state), ctx, "`state.ids` is required", "Simulation.gather", ranks=odd_rank(ctx))


def case_density_ids(grid, ctx):
    """density's `ids` of the wrong shape on one rank: every rank raises before the migration."""
    sim = simulation(grid, ctx, steps=0)
    state = sim(sim.white_noise(seed=3))
    ids = state.ids[:, :1] if ctx["odd"] else state.ids
    expect_error(lambda: sim.density(state.positions, ids=ids), ctx, "`ids`", "density", "every rank",
                 ranks=[ctx["world"] - 1])


def case_resume_no_ids(grid, ctx):
    """resume with a state without ids on one rank: every rank raises, none waits."""
    sim = simulation(grid, ctx, steps=2)
    state = sim(sim.white_noise(seed=3), until=sim.scale_factors[1])
    if ctx["odd"]:
        state = state._replace(ids=None)
    expect_error(lambda: sim.resume(state), ctx, "`state.ids` is required on a process grid", "Simulation.resume",
                 "every rank", ranks=[ctx["world"] - 1])


def case_resume_step(grid, ctx):
    """Ranks resuming from different steps (they would run other numbers of steps) are named."""
    sim = simulation(grid, ctx, steps=2)
    state = sim(sim.white_noise(seed=3), until=sim.scale_factors[1])
    until = sim.scale_factors[1] if ctx["odd"] else None
    expect_error(lambda: sim.resume(state, until=until), ctx, "disagree", "the last step (`until`)",
                 "Simulation.resume")


def case_hand_written_loop(grid, ctx):
    """A hand-written loop's evolve and forces: ranks asking for other steps, another
    cosmology or table, or another `a`, raise together naming it (one rank returned while
    the other waited in a migration until the timeout; two cosmologies were mixed without
    a word; a correction read two scale factors). Bad step numbers are named."""
    import torchpm

    sim = simulation(grid, ctx, steps=2)
    state = sim(sim.white_noise(seed=3), until=sim.scale_factors[0], return_mesh_units=True)
    table = sim.growth_table()
    x, p, ids = state.positions, state.momenta, state.ids
    expect_error(lambda: sim.evolve(x, p, table, ids=ids, stop=1 if ctx["odd"] else 2), ctx, "`stop`",
                 "Simulation.evolve")
    expect_error(lambda: sim.evolve(x, p, table, ids=ids, start=1 if ctx["odd"] else 0), ctx, "`start`")
    other = torchpm.Planck15(Omega_c=0.3) if ctx["odd"] else None
    expect_error(lambda: sim.evolve(x, p, table, ids=ids, cosmology=other), ctx, "`cosmology` (its parameters)")
    other_table = torchpm.cosmology.growth_table(torchpm.Planck15(Omega_c=0.3)) if ctx["odd"] else table
    expect_error(lambda: sim.evolve(x, p, other_table, ids=ids), ctx, "`table` (its values, to 10 digits)")
    expect_error(lambda: sim.evolve(x, p, table, ids=ids, stop=5 if ctx["odd"] else 2), ctx,
                 "`stop` must be a step number from 0 to 2", ranks=[ctx["world"] - 1])
    expect_error(lambda: sim.forces(x, 0.2 if ctx["odd"] else 1.0, ids), ctx, "`a`", "Simulation.forces")
    expect_error(lambda: sim.forces(x, 1.0, ids, cosmology=other), ctx, "`cosmology` (its parameters)")
    # agreed: both run, as before
    forces = sim.forces(x, 1.0, ids)
    assert forces.shape == x.shape
    x2, _, _ = sim.evolve(x, p, table, ids=ids)
    assert x2.shape[0] == 1
    # equal tables built with other thread counts differ in their last bits: agreed
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if ctx["odd"] else 2)
    rebuilt = torchpm.cosmology.growth_table(sim.cosmology)
    torch.set_num_threads(threads)
    assert sim.evolve(x, p, rebuilt, ids=ids, stop=torch.tensor(1))[0].shape[::2] == (1, 3)
    # without a correction `a` is not read: a batch of them, or None, as on one device
    assert sim.forces(x, torch.full((1,), 0.5, dtype=torch.float64), ids).shape == x.shape
    assert sim.forces(x, None, ids).shape == x.shape

    # and under torch.func.grad (the table's values are the transform's wrappers)
    def loss(omega_c):
        cosmology = torchpm.Planck15(Omega_c=omega_c)
        grown = sim.growth_table(cosmology)
        moved, _, moved_ids = sim.evolve(x, p, grown, ids=ids, cosmology=cosmology)
        return (moved**2 * (moved_ids >= 0).unsqueeze(-1)).sum()

    omega_c = torch.tensor(0.2589, dtype=torch.float64)
    by_func = torch.func.grad(loss)(omega_c)
    leaf = omega_c.clone().requires_grad_()
    by_autograd, = torch.autograd.grad(loss(leaf), leaf)
    torch.testing.assert_close(by_func, by_autograd, rtol=1e-12, atol=0)


def case_thin_blocks(grid, ctx):
    """A stencil wider than a rank's block (3 planes over 2 or 3 ranks; TSC reaches 2) is
    refused when the Simulation is built, on every rank, naming `paint_order` and the
    blocks (not at the first force, as a halo width); CIC on the same grid runs."""
    expect_error(lambda: simulation(grid, ctx, n_particles=(3, 3, 4), paint_order="tsc"), ctx,
                 "`paint_order` 'tsc'", "blocks of 1 plane(s)", "[2, 1]" if max(grid) == 2 else "[1, 1, 1]", ranks=[])
    sim = simulation(grid, ctx, n_particles=(3, 3, 4), paint_order="cic")
    assert sim(sim.white_noise(seed=1)).ids.shape[0] == 1
    # a particle grid with fewer planes than ranks is named as such (not as "mesh")
    expect_error(lambda: simulation(grid, ctx, n_particles=(1, 1, 4)), ctx,
                 "the particle grid `n_particles` (1, 1, 4)", "is too small", ranks=[])


def case_paint_not_owned(grid, ctx):
    """One rank paints particles it does not own: its local error reaches every rank before
    the halo exchange (no rank waits for it)."""
    mesh = decomposition(grid, ctx)
    (lx, ly, _), (ox, oy, _) = mesh.local_real_shape, mesh.local_real_offset
    inside = torch.tensor([[[ox + 0.5, oy + 0.5, 0.5]]], dtype=torch.float64)
    far = torch.tensor([[[(ox + lx + 2.5) % SHAPE[0], (oy + ly + 2.5) % SHAPE[1], 0.5]]], dtype=torch.float64)
    text = expect_error(lambda: mesh.paint(far if ctx["odd"] else inside), ctx, "cannot be deposited", "paint",
                        ranks=odd_rank(ctx))
    # the failing rank's own error leads (its other descriptor values are placeholders)
    assert text.startswith(f"PencilDecomposition.paint: rank {ctx['world'] - 1} (grid"), text


def case_paint_not_owned_deferred(grid, ctx):
    """The same with deferred error checking (the CUDA default, torchpm.ops.error_checking),
    where the local paint returns before its error is raised: the agreement still reports
    it on every rank."""
    import torchpm

    mesh = decomposition(grid, ctx)
    (lx, ly, _), (ox, oy, _) = mesh.local_real_shape, mesh.local_real_offset
    inside = torch.tensor([[[ox + 0.5, oy + 0.5, 0.5]]], dtype=torch.float64)
    far = torch.tensor([[[(ox + lx + 2.5) % SHAPE[0], (oy + ly + 2.5) % SHAPE[1], 0.5]]], dtype=torch.float64)
    previous = torchpm.set_error_checking("deferred")
    try:
        mesh.paint(far if ctx["odd"] else inside)
    except ValueError as error:
        text = str(error)
    else:
        raise AssertionError("the paint of a particle the rank does not own did not raise")
    finally:
        torchpm.set_error_checking(previous)
    odd = ctx["world"] - 1
    for fragment in (f"rank {odd}", "torchpm.paint: 1 of 1 particles cannot be deposited", "every rank of the"):
        assert fragment in text, f"{fragment!r} missing from the error: {text}"
    torchpm.check()  # raised once: nothing left behind


def case_readout_bad_field(grid, ctx):
    mesh = decomposition(grid, ctx)
    positions = torch.tensor([[[mesh.local_real_offset[0] + 0.5, mesh.local_real_offset[1] + 0.5, 0.5]]],
                             dtype=torch.float64)
    value = torch.ones(1, 2, 2, 2, dtype=torch.float64) if ctx["odd"] else field(mesh)
    expect_error(lambda: mesh.readout(value, positions), ctx, "`field`", "(1, 2, 2, 2)", "readout", ranks=odd_rank(ctx))


def case_readout_not_owned(grid, ctx):
    """A readout (collective: it fills the halo) of a particle one rank does not own raises
    on every rank, not on that rank alone (the others returned)."""
    mesh = decomposition(grid, ctx)
    (lx, ly, _), (ox, oy, _) = mesh.local_real_shape, mesh.local_real_offset
    inside = torch.tensor([[[ox + 0.5, oy + 0.5, 0.5]]], dtype=torch.float64)
    far = torch.tensor([[[(ox + lx + 2.5) % SHAPE[0], (oy + ly + 2.5) % SHAPE[1], 0.5]]], dtype=torch.float64)
    expect_error(lambda: mesh.readout(field(mesh), far if ctx["odd"] else inside), ctx, "torchpm.readout",
                 "cannot be read", ranks=[ctx["world"] - 1])
    # the same with deferred error checking (the CUDA default): the count is taken before
    # the ranks compare, so it is not left to raise later on that rank alone
    import torchpm

    previous = torchpm.set_error_checking("deferred")
    try:
        expect_error(lambda: mesh.readout(field(mesh), far if ctx["odd"] else inside), ctx, "torchpm.readout",
                     "cannot be read", ranks=[ctx["world"] - 1])
    finally:
        torchpm.set_error_checking(previous)
    torchpm.check()  # raised once: nothing left behind
    # a TypeError on one rank stays a TypeError on every rank
    expect_error(lambda: mesh.readout(field(mesh), [[0.5, 0.5, 0.5]] if ctx["odd"] else inside), ctx,
                 "`positions`", exception=TypeError, ranks=[ctx["world"] - 1])


def case_different_checks(grid, ctx):
    """One rank in a check raised together (a simulation's density) while the other is in a
    collective's agreement (an FFT): one error naming both calls on every rank, not a gloo
    abort (the two all-reduces used to differ in size)."""
    sim = simulation(grid, ctx)
    mesh = sim.force_mesh
    state = sim(sim.white_noise(seed=1))
    if ctx["odd"]:
        call = lambda: sim.density(state)  # noqa: E731
    else:
        call = lambda: mesh.rfftn(torch.ones(1, *mesh.local_real_shape, dtype=torch.float64))  # noqa: E731
    expect_error(call, ctx, "the ranks called different collective operations", "Simulation.density",
                 "PencilDecomposition.rfftn")


def case_different_labels(grid, ctx):
    """Two different checks raised together do not pass each other (they used to: a flag
    each), with the agreement on or off."""
    mesh = decomposition(grid, ctx)
    label = "the odd rank's check" if ctx["odd"] else "the other ranks' check"
    expect_error(lambda: mesh.raise_together(None, operation=label), ctx,
                 "the ranks called different collective operations", "the odd rank's check", "the other ranks' check")
    off = decomposition(grid, ctx, check_agreement=False)
    expect_error(lambda: off.agree("cross_power" if ctx["odd"] else "paint_density", [], None), ctx,
                 "the ranks called different collective operations", "cross_power", "paint_density")


def case_setting(grid, ctx):
    """The ranks must agree on whether they check (one checking rank would wait alone)."""
    expect_error(lambda: decomposition(grid, ctx, check_agreement=not ctx["odd"]), ctx,
                 "check_agreement True", "check_agreement False")


def case_check_off(grid, ctx):
    """With the check off, agreeing calls still give the serial results (FFT, halo fill,
    migration): the switch changes nothing but the check."""
    mesh = decomposition(grid, ctx, check_agreement=False)
    assert not mesh.check_agreement
    whole = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    local = mesh.irfftn(mesh.rfftn(mesh.local_real_part(whole)))
    assert torch.allclose(local, mesh.local_real_part(whole), rtol=0, atol=1e-12)
    filled = mesh.fill_halo(mesh.pad_halo(mesh.local_real_part(whole), 1), 1)
    (lx, ly, _), (ox, oy, _) = mesh.local_real_shape, mesh.local_real_offset
    rows = torch.arange(ox - 1, ox + lx + 1) % SHAPE[0]
    columns = torch.arange(oy - 1, oy + ly + 1) % SHAPE[1]
    assert torch.equal(filled, whole[:, rows][:, :, columns])
    positions, ids = particles(mesh)
    _, moved, moved_ids = mesh.migrate(positions, ids)
    total = mesh.all_reduce(torch.tensor([int((moved_ids >= 0).sum())]))
    assert int(total) == 12 * ctx["world"], f"migration without the check lost particles: {int(total)}"


# ----------------------------------------------------------------------------
# The pytest side: one pool of processes per world size, one test per case.

world_results = world_results_fixture(__name__, case_ids, "agreement_world", timeout_s=300)


@pytest.mark.parametrize("world_size,case_id", [(w, c) for w in sorted(GRIDS) for c in case_ids(w)])
def test_ranks_disagree(world_results, world_size, case_id):
    errors = rank_errors(world_results(world_size)[case_id])
    if errors:
        pytest.fail(errors)


def test_setting_from_environment(monkeypatch):
    """TORCHPM_CHECK_AGREEMENT=0 turns the check off for decompositions built afterwards."""
    from torchpm.distributed import PencilDecomposition
    from torchpm.distributed.groups import agreement_checks

    monkeypatch.setenv("TORCHPM_CHECK_AGREEMENT", "0")
    assert not agreement_checks() and not PencilDecomposition((4, 4, 4)).check_agreement
    monkeypatch.setenv("TORCHPM_CHECK_AGREEMENT", "1")
    assert agreement_checks() and PencilDecomposition((4, 4, 4)).check_agreement
    monkeypatch.delenv("TORCHPM_CHECK_AGREEMENT")
    assert agreement_checks()
    with pytest.raises(TypeError, match="check_agreement"):
        PencilDecomposition((4, 4, 4), check_agreement="no")
