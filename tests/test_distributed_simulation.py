"""The distributed simulation on gloo process groups: equal to the single-device run, and
particle migration that never loses, duplicates or misroutes a particle.

One pool of processes per world size runs every case of that size (see _spawn.py).
Every rank also runs the single-device simulation of the same configuration itself
(no process group) as the oracle; migration cases check ownership against block
bounds computed here with numpy.array_split, independently of torchpm's layout code.
"""

from __future__ import annotations

import datetime
import os
import time

import numpy as np
import pytest
import torch

from _spawn import expect_error_everywhere, grid_context, rank_errors, run_grid_case, world_results_fixture

pytestmark = pytest.mark.distributed

GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1)], 4: [(2, 2)]}
# Uneven over 2 and 3 ranks; the force mesh (B = 2) blocks do not line up with the
# particle-grid blocks.
CONFIG = dict(n_particles=(7, 6, 5), box_size=(35.0, 30.0, 25.0), mesh_factor=2, a_start=0.1, steps=5,
              dtype=torch.float64)
TOLERANCE = 1e-10
# Random migration rounds per grid (five scenarios in turn): 200 in `make test`, 1000 in
# `make test-all` (TORCHPM_TEST_MIGRATION_ROUNDS), which the 2x2 grid takes about a minute for.
MIGRATION_ROUNDS = int(os.environ.get("TORCHPM_TEST_MIGRATION_ROUNDS", "200"))
FAILFAST_TIMEOUT = datetime.timedelta(seconds=3)


def case_ids(world_size):
    ids = []
    for p0, p1 in GRIDS[world_size]:
        grid = f"{p0}x{p1}"
        ids += [f"simulation_b1-{grid}", f"simulation_b2-{grid}", f"gradient_b1-{grid}", f"gradient_b2-{grid}",
                f"adjoint_b2-{grid}", f"adjoint_fused_force_b2-{grid}", f"adjoint_twice-{grid}"]
        if world_size > 1:
            ids += [f"migration-{grid}", f"migration_headroom-{grid}", f"migration_gradcheck-{grid}", f"capacity-{grid}", f"nonfinite-{grid}",
                    f"bad_input-{grid}", f"disagreement-{grid}", f"interlaced_tsc-{grid}", f"power_layer-{grid}", f"paint_layers-{grid}",
                    f"redshift_multipoles-{grid}", f"lightcone-{grid}", f"trajectory-{grid}", f"trajectory_sorted_resume-{grid}",
                    f"migration_ignores_empty_slots-{grid}", f"resume_bits-{grid}", f"forces_box_shifted-{grid}",
                    f"non_gaussian-{grid}", f"correlation-{grid}"]
        if (p0, p1) == (2, 1):
            ids += [f"migration_placement-{grid}", f"migration_dtypes-{grid}", f"replicated_gradients-{grid}", f"unsummed_gradients-{grid}",
                    f"whole_state_refused-{grid}", f"adjoint_explicit_cosmology-{grid}", f"compiled-{grid}",
                    f"func_grad-{grid}", f"func_grad_correction-{grid}", f"redshift_agreement-{grid}",
                    f"memory_check_together-{grid}"]
    if world_size == 3:
        ids.append("subgrid_snapshot-2x1")  # a 2-rank grid inside the 3-rank world
    if world_size == 4:
        ids.append("auto_grid-2x2")
    if world_size > 1:
        ids.append(f"failfast-{GRIDS[world_size][0][0]}x{GRIDS[world_size][0][1]}")  # last: breaks its groups
    return ids


# ----------------------------------------------------------------------------
# Helpers (inside the spawned processes).


def make_context(world_size):
    from torchpm.distributed import process_grid_groups

    ctx = grid_context(world_size, GRIDS)
    if world_size > 1:
        ctx["failfast_groups"] = process_grid_groups(GRIDS[world_size][0], timeout=FAILFAST_TIMEOUT)
    return ctx


def run_case(case_id, ctx):
    run_grid_case(globals(), case_id, ctx)


def simulations(grid, ctx, **overrides):
    import torchpm

    config = dict(CONFIG, **overrides)
    serial = torchpm.Simulation(**config)
    distributed = torchpm.Simulation(**config, mesh=ctx["groups"][grid])
    return serial, distributed


def periodic_difference(a, b, box):
    box = torch.tensor(box, dtype=a.dtype)
    d = a - b
    return d - box * torch.round(d / box)


def block_bounds(n, parts):
    sizes = [len(s) for s in np.array_split(np.arange(n), parts)]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return starts, sizes


def assert_small(error, scale, what):
    assert error <= TOLERANCE * scale, f"{what}: max abs difference {error:.3e} > {TOLERANCE:g} x {scale:.3e}"


def global_random(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ----------------------------------------------------------------------------
# Distributed run == single-device run.


def _compare_runs(grid, ctx, batch):
    from torchpm.analysis import power_spectrum
    from torchpm.nn import PowerSpectrum

    serial, distributed = simulations(grid, ctx)
    noise = serial.white_noise(batch=batch, seed=11)
    local_noise = distributed.white_noise(batch=batch, seed=11)
    # Per-plane streams: the local block is the same whatever the grid.
    assert torch.equal(local_noise, distributed.particle_mesh.local_real_part(noise)), "white noise block"
    expected = serial(noise)
    state = distributed(local_noise)
    assert state.positions.shape[0] == batch and state.ids.shape == state.positions.shape[:2]
    valid = state.ids >= 0
    if batch > 1:
        # Empty slots (padding of the batch members, holes left by the migration) hold zero
        # momentum in the mesh-unit state too (the one a resume starts from).
        raw = distributed(local_noise, return_mesh_units=True)
        assert bool((raw.momenta[raw.ids < 0] == 0).all()), "momentum in an empty slot"
        assert torch.equal(raw.ids, state.ids)
    if grid != (1, 1):
        # every particle sits on the rank owning its position
        mesh = distributed.force_mesh
        cells = state.positions / torch.tensor(distributed.cell_size, dtype=torch.float64)
        for axis in (0, 1):
            starts, sizes = block_bounds(mesh.global_shape[axis], grid[axis])
            r = mesh.grid_coords[axis]
            plane = torch.floor(cells[..., axis])[valid]
            assert bool(((plane >= starts[r]) & (plane < starts[r] + sizes[r])).all()), f"ownership along {axis}"
        # Outside a graph the steps write into their own arrays (the migration into the
        # ids too from the second step on), never into the caller's.
        with torch.no_grad():
            table = distributed.growth_table()
            given = distributed.lpt(distributed.linear_field(local_noise), table)
            kept = [t.clone() for t in given]
            positions, momenta, ids = distributed.evolve(given[0], given[1], table, ids=given[2])
        assert all(torch.equal(a, b) for a, b in zip(given, kept)), "evolve wrote into the caller's arrays"
        assert torch.equal(ids, state.ids), "evolve from the LPT state ended with other slots than the run"
    whole = distributed.gather(state)
    box = distributed.box_size
    assert_small(float(periodic_difference(whole.positions, expected.positions, box).abs().max()), max(box),
                 "positions")
    assert_small(float((whole.momenta - expected.momenta).abs().max()), float(expected.momenta.abs().max()),
                 "momenta")
    density = distributed.density(state)
    # The state's positions with their ids: the empty slots (id -1) carry no mass.
    assert torch.equal(distributed.density(state.positions, ids=state.ids), density), "density of positions + ids"
    expected_density = distributed.force_mesh.local_real_part(serial.density(expected))
    assert_small(float((density - expected_density).abs().max()), float(expected_density.abs().max()), "density")
    spectrum = power_spectrum(density - 1.0, box, mesh=distributed.force_mesh)
    expected_spectrum = power_spectrum(serial.density(expected) - 1.0, box)
    assert torch.equal(spectrum.modes, expected_spectrum.modes), "P(k) modes"
    assert_small(float((spectrum.power - expected_spectrum.power).abs().max()),
                 float(expected_spectrum.power.abs().max()), "P(k)")
    assert_small(float((spectrum.k - expected_spectrum.k).abs().max()), float(expected_spectrum.k.max()), "k")
    # The layer form on the grid (README, hybrid physics + neural networks).
    layer = PowerSpectrum(distributed.force_mesh.global_shape, box, dtype=torch.float64, mesh=distributed.force_mesh)
    assert_small(float((layer(density - 1.0) - expected_spectrum.power).detach().abs().max()),
                 float(expected_spectrum.power.abs().max()), "PowerSpectrum layer")


def case_simulation_b1(grid, ctx):
    _compare_runs(grid, ctx, 1)


def case_simulation_b2(grid, ctx):
    _compare_runs(grid, ctx, 2)


def _compare_gradients(grid, ctx, batch, checkpoint=False, adjoint=False, tolerance=TOLERANCE):
    import torchpm

    serial, _ = simulations(grid, ctx)
    _, distributed = simulations(grid, ctx, checkpoint=checkpoint, adjoint=adjoint)
    field = global_random((batch, *serial.mesh_shape), 5)  # fixed random field of the loss
    results = []
    for sim in (serial, distributed):
        omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
        sim.cosmology = torchpm.Planck15(Omega_c=omega_c)
        noise = sim.white_noise(batch=batch, seed=3).requires_grad_()
        density = sim.density(sim(noise))
        loss = (density * sim.force_mesh.local_real_part(field)).sum()
        loss.backward()
        results.append((noise.grad, omega_c.grad, loss.detach()))
    (noise_grad, omega_grad, _), (local_grad, local_omega_grad, _) = results
    expected = distributed.particle_mesh.local_real_part(noise_grad)
    error = float((local_grad - expected).abs().max())
    assert error <= tolerance * float(expected.abs().max()), f"d loss / d white noise: {error:.3e}"
    error = abs(float(local_omega_grad - omega_grad))
    assert error <= tolerance * abs(float(omega_grad)), f"d loss / d Omega_c: {error:.3e} of {float(omega_grad):.3e}"


def case_non_gaussian(grid, ctx):
    """Local primordial non-Gaussianity (``Cosmology.f_nl``) on the grid equals one device:
    the potential is squared on each rank's block of the particle grid and transferred
    with the distributed FFT. Positions, and the gradients of a loss in the white noise and
    in ``f_nl`` (summed over the ranks), equal the serial run's; the f_nl term moves the
    particles far beyond the tolerance (so a grid ignoring it would fail). With
    ``primordial_kmax`` the Gaussian modes are cut on each rank's Fourier block alike. In
    the uneven box (the spectrum on a folded table of |k|) with autograd, and in a cube
    (one value per integer |k|^2 on each rank's block) with the adjoint."""
    import torchpm

    for options in (dict(primordial_kmax=0.8), dict(n_particles=(6, 6, 6), box_size=(60.0, 60.0, 60.0), adjoint=True)):
        serial, distributed = simulations(grid, ctx, **options)
        field = global_random((1, *serial.mesh_shape), 5)
        results = []
        for sim in (serial, distributed):
            f_nl = torch.tensor(2000.0, dtype=torch.float64, requires_grad=True)
            sim.cosmology = torchpm.Planck15(f_nl=f_nl)
            noise = sim.white_noise(seed=3).requires_grad_()
            state = sim(noise)
            loss = (sim.density(state) * sim.force_mesh.local_real_part(field)).sum()
            loss.backward()
            with torch.no_grad():
                results.append((sim.gather(state).positions, noise.grad, f_nl.grad))
            sim.cosmology = torchpm.Planck15()
        (positions, noise_grad, f_grad), (local_positions, local_noise_grad, local_f_grad) = results
        box = distributed.box_size
        with torch.no_grad():
            gaussian = serial(serial.white_noise(seed=3)).positions  # (f_nl = 0, the same cut)
        moved = float(periodic_difference(positions, gaussian, box).abs().max())
        assert moved > 1e-6 * max(box), f"f_nl moved the particles by only {moved:.3e} Mpc/h"
        assert_small(float(periodic_difference(local_positions, positions, box).abs().max()), max(box), "positions")
        expected = distributed.particle_mesh.local_real_part(noise_grad)
        assert_small(float((local_noise_grad - expected).abs().max()), float(expected.abs().max()),
                     "d loss / d white noise")
        assert float(f_grad) != 0.0
        assert_small(abs(float(local_f_grad - f_grad)), abs(float(f_grad)), "d loss / d f_nl")


def case_func_grad(grid, ctx):
    # torch.func.grad on the grid (the migrations, halo exchanges and grid sums inside
    # the transform) against serial torch.autograd, and grad of grad against the grid's
    # own torch.autograd double backward
    import torchpm

    serial, distributed = simulations(grid, ctx)
    field = global_random((1, *serial.mesh_shape), 5)

    def loss(sim, noise, omega_c):
        sim.cosmology = torchpm.Planck15(Omega_c=omega_c)
        try:
            density = sim.density(sim(noise))
        finally:
            sim.cosmology = torchpm.Planck15()
        return (density * sim.force_mesh.local_real_part(field)).sum() + 1e-3 * (density**2).sum()

    omega_c = torch.tensor(0.2589, dtype=torch.float64)
    noise = serial.white_noise(batch=1, seed=3).requires_grad_()
    leaf = omega_c.clone().requires_grad_()
    noise_grad, omega_grad = torch.autograd.grad(loss(serial, noise, leaf), (noise, leaf))
    local_noise = distributed.white_noise(batch=1, seed=3)
    got_noise, got_omega = torch.func.grad(lambda n, o: loss(distributed, n, o), argnums=(0, 1))(local_noise, omega_c)
    expected = distributed.particle_mesh.local_real_part(noise_grad)
    assert_small(float((got_noise - expected).abs().max()), float(expected.abs().max()), "torch.func.grad: white noise")
    assert_small(abs(float(got_omega - omega_grad)), abs(float(omega_grad)), "torch.func.grad: Omega_c")

    direction = distributed.particle_mesh.local_real_part(global_random(tuple(noise.shape), 6))

    def first(n):
        return torch.func.grad(lambda m: loss(distributed, m, omega_c))(n)

    hvp = torch.func.grad(lambda n: (first(n) * direction).sum())(local_noise)
    leaf = local_noise.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(loss(distributed, leaf, omega_c), leaf, create_graph=True)
    (expected_hvp,) = torch.autograd.grad((gradient * direction).sum(), leaf)
    assert float(expected_hvp.abs().max()) > 0
    assert_small(float((hvp - expected_hvp).abs().max()), float(expected_hvp.abs().max()), "grad of grad")

    # jacrev (vmap over the pull-back: the halo exchanges, grid sums and the all-to-all
    # of the migrations batched) of two losses, row by row against serial gradients
    def losses(sim, n):
        density = sim.density(sim(n))
        return torch.stack([(density * sim.force_mesh.local_real_part(field)).sum(), (density**2).sum()])

    jacobian = torch.func.jacrev(lambda n: losses(distributed, n))(local_noise)
    for row in range(2):
        (expected,) = torch.autograd.grad(losses(serial, noise)[row], noise)
        expected = distributed.particle_mesh.local_real_part(expected)
        assert_small(float((jacobian[row] - expected).abs().max()), float(expected.abs().max()), f"jacrev row {row}")


def case_func_grad_correction(grid, ctx):
    # torch.func.grad in a force correction's weights passed by torch.func.functional_call
    # (a functional training step) on the grid, against serial torch.autograd: the run's
    # agreement check reads the weights' values, which are torch.func wrappers there
    import torchpm
    from torchpm.nn import PGDCorrection

    def make(**mesh):
        correction = PGDCorrection(0.3, 1.0, alpha=0.4, mu=0.5, dtype=torch.float64)
        return torchpm.Simulation(**CONFIG, force_correction=correction, **mesh)

    serial, distributed = make(), make(mesh=ctx["groups"][grid])
    field = global_random((1, *serial.mesh_shape), 5)

    def loss(sim, noise, parameters):
        density = sim.density(torch.func.functional_call(sim, parameters, (noise,)))
        return (density * sim.force_mesh.local_real_part(field)).sum() + 1e-3 * (density**2).sum()

    parameters = {name: p.detach().clone() for name, p in serial.named_parameters()}
    got = torch.func.grad(lambda p: loss(distributed, distributed.white_noise(seed=3), p))(parameters)
    expected = torch.autograd.grad(loss(serial, serial.white_noise(seed=3), dict(serial.named_parameters())),
                                   list(serial.parameters()))
    for (name, value), reference in zip(got.items(), expected):
        assert float(reference.abs()) > 0, name
        assert_small(abs(float(value - reference)), abs(float(reference)), f"torch.func.grad: {name}")

    # A plain callable closing over a transformed tensor: its gradient would hold only this
    # rank's share of the run; refused on every rank, under torch.func as under autograd.
    held = {"alpha": torch.tensor(0.3, dtype=torch.float64)}
    closing = torchpm.Simulation(**CONFIG, force_correction=lambda k, a: 1.0 + held["alpha"] * torch.exp(-k),
                                 mesh=ctx["groups"][grid])

    def closure_loss(alpha):
        held["alpha"] = alpha
        return (closing.density(closing(closing.white_noise(seed=3))) ** 2).sum()

    with pytest.raises(ValueError, match="`force_correction` computes with tensors that need gradients"):
        torch.func.grad(closure_loss)(torch.tensor(0.3, dtype=torch.float64))


def case_gradient_b1(grid, ctx):
    _compare_gradients(grid, ctx, 1)


def case_adjoint_b2(grid, ctx):
    # the adjoint method on the grid (migrations in the backward pass) against serial autograd
    _compare_gradients(grid, ctx, 2, adjoint=True, tolerance=1e-8)


def case_adjoint_twice(grid, ctx):
    """Two backward passes through one adjoint run (retain_graph) give the same gradient
    as the serial run: the second used to start from the layout the first one had
    migrated back to the start, and returned wrong gradients on a grid (and raised an
    AttributeError on one device), for the whole trajectory too."""
    serial, distributed = simulations(grid, ctx, adjoint=True)
    gradients = []
    for sim in (serial, distributed):
        noise = sim.white_noise(seed=4).requires_grad_(True)
        states = sim.trajectory(noise, at=sim.scale_factors[1:])
        loss = sum((sim.density(state) ** 2).sum() for state in states)
        first = torch.autograd.grad(loss, noise, retain_graph=True)[0]
        second = torch.autograd.grad(loss, noise, retain_graph=True)[0]
        assert torch.equal(first, second), float((first - second).abs().max())
        gradients.append(second)
    expected = distributed.particle_mesh.local_real_part(gradients[0])
    error = float((gradients[1] - expected).abs().max())
    assert error <= 1e-8 * float(expected.abs().max()), f"d loss / d white noise: {error:.3e}"


def case_gradient_b2(grid, ctx):
    # with checkpointing: the recomputed steps migrate again in the backward pass
    _compare_gradients(grid, ctx, 2, checkpoint=True)


def case_adjoint_fused_force_b2(grid, ctx):
    # The adjoint's fused evaluation + pull-back (one 4-channel paint of density and
    # cotangent, one halo fill for the readout and the position gradient) on the grid:
    # the forces are the forward pass's bit for bit, and the pull-back equals the
    # separate evaluate + pull_back, for migrated particles with empty (zero-mass) slots.
    import torchpm

    config = dict(CONFIG, paint_order="tsc")
    sim = torchpm.Simulation(**config, mesh=ctx["groups"][grid])
    omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
    sim.cosmology = torchpm.Planck15(Omega_c=omega_c)
    with torch.no_grad():
        x0, _, _ = sim.lpt(sim.linear_field(sim.white_noise(batch=2, seed=3)))
    start_ids = torch.arange(x0.shape[1]).expand(2, -1) + 1000 * ctx["rank"]
    _, x, ids = sim.force_mesh.migrate(x0, start_ids)
    # Empty slots (ids -1) as a migration leaves them, at owned positions: painted with
    # zero mass on a grid (one device never pads: its runs hold none).
    if grid != (1, 1):
        x = torch.cat([x, x[:, :3]], dim=1)
        ids = torch.cat([ids, torch.full((2, 3), -1, dtype=ids.dtype)], dim=1)
    force = sim._adjoint_force(lambda positions, a: sim.forces(positions, a, ids), None, lambda: ids)
    a = torch.tensor(0.4, dtype=torch.float64)
    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(ctx["rank"]), dtype=torch.float64)
    with torch.no_grad():
        plain = sim.forces(x, a, ids)
    value, saved = force.evaluate(x, a)
    grad_x, grad_a, grads = force.pull_back(saved, cotangent, [omega_c])
    fused, fused_x, fused_a, fused_grads = force.evaluate_and_pull(x, a, cotangent, [omega_c])
    assert torch.equal(value, plain) and torch.equal(fused, plain)
    error = float((fused_x - grad_x).abs().max())
    assert error <= 1e-13 * float(grad_x.abs().max()), f"position pull-back: {error:.3e}"
    # 1.5 Omega_m's adjoint (the simulation's cosmology is replicated: summed over the ranks)
    assert abs(float(fused_grads[0] - grads[0])) <= 1e-13 * abs(float(grads[0])) and float(grads[0]) != 0


def case_forces_box_shifted(grid, ctx):
    """``Simulation.forces`` at periodic images of the rank's particles (each shifted by -2 to
    2 whole boxes along every axis) equals the single-device forces at the same positions
    and at the unshifted ones, and so does the gradient of a loss of them in the positions
    (the grid refused an image along a split axis as a particle it does not own)."""
    serial, distributed = simulations(grid, ctx)
    mesh = distributed.force_mesh
    with torch.no_grad():
        x, _, ids = distributed.lpt(distributed.linear_field(distributed.white_noise(batch=2, seed=3)))
    batch, n = 2, serial.n_total
    valid = ids >= 0
    assert not bool(valid.all()), "no empty slot: the zero-mass slots go untested"
    rows = ids.clamp(min=0)

    def by_id(table):  # (2, N, ...) indexed by id -> this rank's slots (zero in empty ones)
        return torch.stack([table[b][rows[b]] for b in range(batch)]) * valid[..., None]

    cells = torch.tensor(mesh.global_shape, dtype=torch.float64)
    boxes = torch.randint(-2, 3, (batch, n, 3), generator=torch.Generator().manual_seed(7)).to(torch.float64)
    weights = global_random((batch, n, 3), 8)
    shifted = x + by_id(boxes * cells)
    assert bool((shifted[valid] != x[valid]).any(0).all()), "some axis not shifted"
    # every particle of the grid, by id, for the single device
    with torch.no_grad():
        every = torch.zeros(batch, n, 3, dtype=torch.float64)
        for b in range(batch):
            every[b].index_put_((ids[b][valid[b]],), x[b][valid[b]])
        every = mesh.all_reduce(every, "sum")
    a = torch.tensor(0.4, dtype=torch.float64)
    leaf = (every + boxes * cells).requires_grad_()
    expected = serial.forces(leaf, a)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), leaf)
    with torch.no_grad():
        unshifted = serial.forces(every, a)
    mine = shifted.clone().requires_grad_()
    forces = distributed.forces(mine, a, ids)
    (grad,) = torch.autograd.grad((forces * by_id(weights)).sum(), mine)
    scale = float(expected.detach().abs().max())
    assert scale > 0 and float(expected_grad.abs().max()) > 0
    for name, reference in (("shifted", expected), ("unshifted", unshifted)):
        error = float((forces - by_id(reference.detach()))[valid].abs().max())
        assert_small(error, scale, f"forces at box-shifted positions against one device's, {name}")
    error = float((grad - by_id(expected_grad))[valid].abs().max())
    assert_small(error, float(expected_grad.abs().max()), "d loss / d positions at box-shifted positions")
    # evolve from the box-shifted LPT state: the run from the unshifted one (modulo the box)
    with torch.no_grad():
        x0, p0, ids0 = distributed.lpt(distributed.linear_field(distributed.white_noise(batch=2, seed=3)))
        table = distributed.growth_table()
        kept = x0 + by_id(boxes * cells)
        given = kept.clone()
        moved_x, moved_p, moved_ids = distributed.evolve(given, p0, table, ids=ids0, stop=2)
        plain_x, plain_p, plain_ids = distributed.evolve(x0, p0, table, ids=ids0, stop=2)
    assert torch.equal(given, kept), "evolve wrote into the caller's positions"
    # (by id: the arrivals' slots follow the positions, which keep their whole boxes
    # along the axes that are not split)
    for b in range(batch):
        moved_valid, plain_valid = moved_ids[b] >= 0, plain_ids[b] >= 0
        moved_order = torch.argsort(moved_ids[b][moved_valid])
        plain_order = torch.argsort(plain_ids[b][plain_valid])
        assert torch.equal(moved_ids[b][moved_valid][moved_order], plain_ids[b][plain_valid][plain_order])
        difference = moved_x[b][moved_valid][moved_order] - plain_x[b][plain_valid][plain_order]
        difference = difference - cells * torch.round(difference / cells)
        assert_small(float(difference.abs().max()), float(cells.max()), "evolve from box-shifted positions")
        momenta_difference = moved_p[b][moved_valid][moved_order] - plain_p[b][plain_valid][plain_order]
        assert_small(float(momenta_difference.abs().max()), float(plain_p.abs().max()),
                     "evolve from box-shifted positions: momenta")
    # A particle of another rank (half a box along a split axis, not a whole one) is still
    # refused on every rank: forces does not migrate.
    axis = 0 if grid[0] > 1 else 1
    moved = shifted.clone()
    if ctx["rank"] == 0:
        slot = int(torch.nonzero(valid[0])[0])
        moved[0, slot, axis] += mesh.global_shape[axis] // 2
    expect_error_everywhere(lambda: distributed.forces(moved, a, ids), "rank 0", "cannot be deposited",
                            "move the particles to the rank that owns them")


def case_replicated_gradients(grid, ctx):
    """Gradients that reach the run through a force correction's conditions (computed from
    the cosmology, and from a tensor of the user's) and through a power-spectrum module's
    parameter are summed over the ranks: grid autograd and grid adjoint equal the serial
    run (each rank used to hold only its share of the conditions' and such paths)."""
    import torchpm
    from _models import AmplifiedPower, perturbed_spline

    config = dict(CONFIG, steps=2)
    field = global_random((1, *[n * config["mesh_factor"] for n in config["n_particles"]]), 5)
    noise_weights = global_random((1, *config["n_particles"]), 6)
    results = []
    for mesh, adjoint in ((None, False), (ctx["groups"][grid], False), (ctx["groups"][grid], True)):
        correction = perturbed_spline(conditions=3, seed=1)
        omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
        other = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        cosmology = torchpm.Planck15(Omega_c=omega_c)
        correction.set_conditions(torch.stack([cosmology.Omega_m, cosmology.sigma8, other * 2]))
        power = AmplifiedPower(1.3)
        sim = torchpm.Simulation(**config, cosmology=cosmology, force_correction=correction, power_spectrum=power,
                                 adjoint=adjoint, **({} if mesh is None else {"mesh": mesh}))
        noise = sim.white_noise(seed=3)
        loss = (sim.density(sim(noise)) * sim.force_mesh.local_real_part(field)).sum()
        loss.backward()
        results.append([omega_c.grad, other.grad, power.amplitude.grad, correction.network[0].weight.grad])
        # the public linear_field on its own (the simulation's cosmology, replicated there too)
        omega_c.grad = None
        (sim.linear_field(noise) * sim.particle_mesh.local_real_part(noise_weights)).sum().backward()
        results[-1].append(omega_c.grad)
    names = ("Omega_c", "the condition's tensor", "the power module's parameter", "a network weight",
             "Omega_c through linear_field alone")
    for label, got in zip(("grid autograd", "grid adjoint"), results[1:]):
        for name, expected, value in zip(names, results[0], got):
            assert value is not None, f"{label}: no gradient for {name}"
            error = float((value - expected).abs().max())
            assert error <= 1e-8 * float(expected.abs().max()), f"{label}: d loss / d {name} off by {error:.3e}"


def case_adjoint_explicit_cosmology(grid, ctx):
    """A hand-written run (lpt, then evolve with an explicit cosmology, as a user composes
    it) under the adjoint on the grid: d/dOmega_c equals serial autograd (the adjoint took
    the simulation's own cosmology and dropped the explicit one's 1.5 Omega_m path)."""
    import torchpm

    config = dict(CONFIG, steps=2)
    weights = global_random((1, *config["n_particles"]), 7)
    results = []
    for mesh, adjoint in ((None, False), (ctx["groups"][grid], True)):
        sim = torchpm.Simulation(**config, adjoint=adjoint, **({} if mesh is None else {"mesh": mesh}))
        omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
        cosmology = torchpm.Planck15(Omega_c=omega_c)
        table = sim.growth_table(cosmology)
        x, p, ids = sim.lpt(sim.linear_field(sim.white_noise(seed=3), cosmology), table)
        x, p, ids = sim.evolve(x, p, table, ids=ids, cosmology=cosmology)
        density = sim.density(sim.to_physical(x, p, 0.0, ids))
        (grad,) = torch.autograd.grad((density * sim.force_mesh.local_real_part(
            torch.nn.functional.interpolate(weights.unsqueeze(0), scale_factor=2).squeeze(0))).sum(), [omega_c])
        results.append(grad)
    error = abs(float(results[1] - results[0]))
    assert error <= 1e-8 * abs(float(results[0])) and float(results[0]) != 0, [float(r) for r in results]


def case_unsummed_gradients(grid, ctx):
    """A gradient that would reach a tensor not summed over the ranks (a plain callable's,
    or a module's unregistered tensor) is refused on every rank, naming the setting; the
    same callables run when nothing needs their gradient."""
    import torchpm

    config = dict(CONFIG, steps=1)
    scale = torch.tensor(1.1, dtype=torch.float64, requires_grad=True)

    class Unregistered(torch.nn.Module):
        def forward(self, k, a):
            return scale * torch.ones_like(k)

    from torchpm.cosmology import linear_power

    cases = [
        ("force_correction", lambda k, a: scale * torch.ones_like(k)),
        ("force_correction", Unregistered()),
        ("power_spectrum", lambda k, cosmology: scale * linear_power(k, cosmology)),
    ]
    for setting, value in cases:
        sim = torchpm.Simulation(**config, mesh=ctx["groups"][grid], **{setting: value})
        noise = sim.white_noise(seed=3)
        expect_error_everywhere(lambda: sim(noise), f"`{setting}` computes with tensors that need gradients",
                                "nn.Module")
        with torch.no_grad():
            assert sim(noise).positions.shape[0] == 1
    # the public forces and evolve, as a hand-written loop uses them, refuse it too
    sim = torchpm.Simulation(**config, mesh=ctx["groups"][grid], force_correction=cases[0][1])
    with torch.no_grad():
        x, p, ids = sim.lpt(sim.linear_field(sim.white_noise(seed=3)))
    a = torch.tensor(0.1, dtype=torch.float64)
    expect_error_everywhere(lambda: sim.forces(x, a, ids), "`force_correction` computes with tensors")
    expect_error_everywhere(lambda: sim.evolve(x, p, sim.growth_table(), ids=ids), "`force_correction` computes")
    # on a grid they need the ids (the empty slots have none of the mass)
    sim.force_correction = None
    expect_error_everywhere(lambda: sim.forces(x, a), "forces: `ids` is required on a process grid")
    expect_error_everywhere(lambda: sim.evolve(x, p, sim.growth_table()), "evolve: `ids` is required")
    # one rank's float32 positions (a float64 simulation) raise on every rank, naming them
    mine = x.float() if ctx["rank"] == 0 else x
    expect_error_everywhere(lambda: sim.forces(mine, a, ids), "forces: `positions` must be a (B, n, 3) torch.float64")
    # a buffer that differs per rank by design (a filter on the rank's own k block) runs
    filtered = torchpm.Simulation(**config, mesh=ctx["groups"][grid])

    class OwnBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("filter", 1 + 0.1 * torch.exp(-filtered.kernels("force").k_magnitude))

        def forward(self, k, a):
            return self.filter

    filtered.force_correction = OwnBlock()
    assert filtered(filtered.white_noise(seed=3)).positions.shape[0] == 1


def case_whole_state_refused(grid, ctx):
    """The whole state on every rank (gathered, or a snapshot read whole by each) would be
    multiplied by the migration: resume and density refuse it on every rank; a share
    given twice (duplicated ids) is refused by resume."""
    import torchpm

    _, sim = simulations(grid, ctx, steps=2)
    state = sim(sim.white_noise(seed=3), until=sim.scale_factors[1])
    whole = sim.gather(state)
    expect_error_everywhere(lambda: sim.resume(whole), "resume: batch member 0 of the state holds 420 particles "
                            "over the 2 ranks, the simulation has 210", "not the whole state on every rank")
    expect_error_everywhere(lambda: sim.density(whole), "density: batch member 0 of the state holds 420", "has 210")
    # each rank its own share, but rank 1's ids all 0: 210 particles, an id many times
    ids = state.ids.clone()
    if ctx["rank"] == 1:
        ids[ids >= 0] = 0
    twice = torchpm.SimulationState(state.positions, state.momenta, state.a, ids)
    expect_error_everywhere(lambda: sim.resume(twice), "resume: the ids of batch member 0 are not each of 0 .. 209 once")
    # Ids on both ranks and as many on none, each rank's ids distinct, 210 in all: one id,
    # and two whose sum is that of the two they replace (the plain sum of ids is blind to it).
    held = sim.gather(state).ids[0]  # (every id, on every rank)
    mine = state.ids[0][state.ids[0] >= 0]
    others = held[~torch.isin(held, mine)].tolist()  # the ids rank 0 holds
    sums = {a + b: (a, b) for i, a in enumerate(others) for b in others[i + 1:]}
    pair = next(((a, b), sums[a + b]) for i, a in enumerate(mine.tolist()) for b in mine.tolist()[i + 1:]
                if a + b in sums)
    for replaced, by in (([int(mine.max())], [others[0]]), pair):
        ids = state.ids.clone()
        if ctx["rank"] == 1:
            for old, new in zip(replaced, by):
                ids[ids == old] = new
        duplicated = torchpm.SimulationState(state.positions, state.momenta, state.a, ids)
        expect_error_everywhere(lambda: sim.resume(duplicated), "resume: the ids of batch member 0 are not each of "
                                "0 .. 209 once over the 2 ranks (an id is held on two ranks, another on none)")
    # a NaN momentum on one rank, with no step to run: every rank raises
    momenta = state.momenta.clone()
    if ctx["rank"] == 1:
        momenta[0, int(torch.nonzero(state.ids[0] >= 0)[0])] = float("nan")
    nan = torchpm.SimulationState(state.positions, momenta, state.a, state.ids)
    expect_error_everywhere(lambda: sim.resume(nan, until=state.a), "resume: the state's momenta are not finite")
    # the run's own state resumes
    assert sim.gather(sim.resume(state)).positions.shape == (1, 210, 3)


# ----------------------------------------------------------------------------
# Migration.


def _attribute(ids):
    """A per-particle attribute that is a known function of the id (checks that values
    travel with their particle)."""
    base = ids.to(torch.float64).unsqueeze(-1)
    return torch.cat([base * 1.5, base * -0.25 + 3.0], dim=-1)


def _owned(mesh, positions, ids, grid):
    valid = ids >= 0
    for axis in (0, 1):
        if grid[axis] == 1:
            continue
        starts, sizes = block_bounds(mesh.global_shape[axis], grid[axis])
        r = mesh.grid_coords[axis]
        plane = torch.floor(positions[..., axis])[valid]
        if not bool(((plane >= starts[r]) & (plane < starts[r] + sizes[r])).all()):
            return False
    return True


def case_migration_dtypes(grid, ctx):
    """Per-particle attributes of every integer, bool and float dtype arrive bit for bit,
    also those that gloo and NCCL cannot send (int16, uint16, uint32, uint64: moved as
    bytes or as the signed integer of the same bits), and go back with the plan."""
    from torchpm.distributed import PencilDecomposition

    mesh = PencilDecomposition((9, 7, 4), ctx["groups"][grid])
    generator = torch.Generator().manual_seed(200 + ctx["rank"])
    count = 10
    positions = torch.rand(1, count, 3, generator=generator, dtype=torch.float64) * torch.tensor([9.0, 7.0, 4.0])
    ids = torch.arange(count).unsqueeze(0) + count * ctx["rank"]

    def bits(ids, dtype):  # every bit of the dtype used, from the id
        mixed = (ids * 0x9E3779B97F4A7C1 + 0x5851F42D4C957F2D) ^ (ids << 40)
        if dtype == torch.bool:
            return (mixed & 1).bool()
        width = torch.empty((), dtype=dtype).element_size()
        return mixed.unsqueeze(-1).view(torch.uint8)[..., :width].contiguous().view(dtype).squeeze(-1)

    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
              torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
    attributes = [bits(ids, dtype) for dtype in dtypes]
    plan, _, new_ids, *moved = mesh.migrate(positions, ids, *attributes)
    # the same written into the caller's tensors (the in-place path)
    _, _, same_ids, *in_place = mesh.migrate(positions.clone(), ids.clone(), *[a.clone() for a in attributes],
                                             overwrite=True)
    assert torch.equal(same_ids, new_ids)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                           b.view(torch.uint8) if b.dtype != torch.bool else b) for a, b in zip(in_place, moved))
    kept = new_ids >= 0
    for dtype, values in zip(dtypes, moved):
        assert values.dtype == dtype
        expected = bits(new_ids.clamp(min=0), dtype)
        assert torch.equal(values[kept].view(torch.uint8) if dtype != torch.bool else values[kept],
                           expected[kept].view(torch.uint8) if dtype != torch.bool else expected[kept]), dtype
        back = plan.gather(values)
        assert torch.equal(back.view(torch.uint8) if dtype != torch.bool else back,
                           bits(ids, dtype).view(torch.uint8) if dtype != torch.bool else bits(ids, dtype)), dtype


def case_migration(grid, ctx):
    import torch.distributed as dist

    from torchpm.distributed import PencilDecomposition

    mesh = PencilDecomposition((9, 7, 4), ctx["groups"][grid])
    rank, world = ctx["rank"], ctx["world"]
    generator = torch.Generator().manual_seed(100 + rank)
    shape = torch.tensor(mesh.global_shape, dtype=torch.float64)
    batch = 2
    per_rank = 12
    ids = (torch.arange(per_rank) + rank * per_rank).repeat(batch, 1)
    ids[1] += 10_000  # members hold different id ranges

    # float32: the int64 ids travel bit-cast in the positions' buffer (two floats each);
    # one lone particle (rank 0 to the last rank) and ids beyond 2**32 must arrive whole.
    corner = [block_bounds(mesh.global_shape[axis], grid[axis])[0][-1] + 0.5 for axis in (0, 1)] + [0.5]
    home = [mesh.local_real_offset[0] + 0.5, mesh.local_real_offset[1] + 0.5, 0.5]
    x32 = torch.tensor(home, dtype=torch.float32).repeat(1, 3, 1)
    if rank == 0:
        x32[0, 1] = torch.tensor(corner, dtype=torch.float32)
    ids32 = 2**40 + torch.arange(3).unsqueeze(0) + 100 * rank
    # No attribute: the ids then sit at an odd float32 column of the packed rows.
    _, x32, ids32 = mesh.migrate(x32, ids32)
    kept = ids32 >= 0
    assert _owned(mesh, x32, ids32, grid), "float32: a particle is not on its owner"
    arrived = [None] * world
    dist.all_gather_object(arrived, ids32[kept].tolist())
    expected = sorted(2**40 + i + 100 * r for r in range(world) for i in range(3))
    assert sorted(i for part in arrived for i in part) == expected, "float32: ids lost or changed"

    positions = torch.rand(batch, per_rank, 3, generator=generator, dtype=torch.float64) * shape
    _, positions, ids = mesh.migrate(positions, ids)
    total = torch.tensor([per_rank * world * batch], dtype=torch.float64)
    for round_ in range(MIGRATION_ROUNDS):
        scenario = round_ % 5
        count = positions.shape[1]
        if scenario == 0:  # small moves
            step = (torch.rand(batch, count, 3, generator=generator, dtype=torch.float64) - 0.5) * 2.0
        elif scenario == 1:  # across several blocks, wrapping the box several times
            step = (torch.rand(batch, count, 3, generator=generator, dtype=torch.float64) - 0.5) * 4.0 * shape
        elif scenario == 2:  # everything to one rank's block
            target = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64) + (round_ // 5 % 3)
            step = target - positions
        elif scenario == 3:  # nothing moves
            step = torch.zeros_like(positions)
        else:  # one member moves far, the other stays
            step = (torch.rand(batch, count, 3, generator=generator, dtype=torch.float64) - 0.5) * 3.0 * shape
            step[0] = 0
        moved = positions + step
        moved = torch.where((ids >= 0).unsqueeze(-1), moved, positions)
        # Odd rounds let the migration write into its inputs (as the simulation's step
        # does), every fourth into its ids too (as the steps after the first do); it must
        # never write into anything when not allowed.
        overwrite = round_ % 2 == 1
        overwrite_ids = round_ % 4 == 3
        given, given_ids, given_attribute = moved.clone(), ids.clone(), _attribute(ids)
        plan, positions, new_ids, attribute = mesh.migrate(moved, ids, given_attribute, overwrite=overwrite,
                                                           overwrite_ids=overwrite_ids)
        if not overwrite_ids:
            assert torch.equal(ids, given_ids), f"round {round_}: the migration wrote into its ids"
        if not overwrite:
            assert torch.equal(moved, given), f"round {round_}: the migration wrote into its positions"
            assert torch.equal(given_attribute, _attribute(given_ids)), f"round {round_}: ... into its attribute"
        elif positions.shape[1] == moved.shape[1] and 1 in grid:
            # One stage and no growth: written in place, no copy.
            assert positions.data_ptr() == moved.data_ptr(), f"round {round_}: positions copied despite overwrite"
            assert attribute.data_ptr() == given_attribute.data_ptr(), f"round {round_}: attribute copied"
            if overwrite_ids:
                assert new_ids.data_ptr() == ids.data_ptr(), f"round {round_}: ids copied despite overwrite_ids"
        old_ids, ids = given_ids, new_ids
        valid = ids >= 0
        assert torch.equal(plan.padding, ~valid), f"round {round_}: the plan's padding is not the empty slots"
        masses = plan.masses(torch.float64)
        assert (masses is None and bool(valid.all())) or torch.equal(masses, valid.to(torch.float64)), (
            f"round {round_}: the plan's masses are not 1 for the particles and 0 for the empty slots")
        assert _owned(mesh, positions, ids, grid), f"round {round_}: a particle is not on its owner"
        assert torch.equal(attribute[valid], _attribute(ids)[valid]), f"round {round_}: attributes lost their particle"
        assert torch.equal(positions, _expected_empty_positions(positions, ids, mesh.padding_position)), (
            f"round {round_}: empty slots not next to their neighbours")
        for axis in (0, 1):
            if grid[axis] > 1:  # split axes are wrapped into [0, n)
                column = positions[..., axis][valid]
                assert bool(((column >= 0) & (column < mesh.global_shape[axis])).all()), f"round {round_}: wrap"
        summary = torch.stack([valid.sum().to(torch.float64), ids[valid].to(torch.float64).sum(),
                               (ids[valid].to(torch.float64) ** 2).sum()])
        dist.all_reduce(summary)
        assert summary[0] == total[0], f"round {round_}: {int(summary[0])} particles instead of {int(total[0])}"
        if round_ % 100 == 0:
            gathered = [None] * world
            dist.all_gather_object(gathered, ids[valid].tolist())
            every = sorted(i for part in gathered for i in part)
            expected = sorted(list(range(per_rank * world)) + list(range(10_000, 10_000 + per_rank * world)))
            assert every == expected, f"round {round_}: ids lost or duplicated"
        # The reverse path brings values back to their slots.
        back = plan.gather(attribute)
        assert back.shape[1] == moved.shape[1]
        was = old_ids >= 0
        assert torch.equal(back[was], _attribute(old_ids)[was]), f"round {round_}: gather did not bring values home"
        if round_ % 50 == 25:
            # The plan moves other tensors exactly as the migration moved ids and attributes.
            again_attribute, again_ids = plan.exchange_many([_attribute(old_ids), old_ids], [0, -1])
            assert torch.equal(again_ids, ids), f"round {round_}: exchange_many put particles elsewhere"
            assert torch.equal(plan.exchange(_attribute(old_ids))[valid], attribute[valid])
            assert torch.equal(again_attribute[valid], attribute[valid])
        if round_ % 50 == 49:
            # Routing by explicit destination: every particle back to the rank that made it.
            home = torch.where(ids >= 10_000, ids - 10_000, ids) // per_rank
            home = torch.where(ids >= 0, home, torch.zeros_like(home))
            _, positions, ids = mesh.migrate(positions, ids, destination=home)
            mine = ids[ids >= 0]
            mine = torch.where(mine >= 10_000, mine - 10_000, mine) // per_rank
            assert bool((mine == rank).all()) and int((ids >= 0).sum()) == batch * per_rank, "routing home"


def _expected_empty_positions(positions, ids, corner):
    """Where the migration leaves empty slots, slot by slot: the centre of the cell of the
    nearest particle before them in their member (after them at its start; ``corner``
    without particles)."""
    expected = positions.clone()
    for b in range(ids.shape[0]):
        slots = ids[b].tolist()
        occupied = [i for i, particle in enumerate(slots) if particle >= 0]
        last = occupied[0] if occupied else None
        for i, particle in enumerate(slots):
            if particle >= 0:
                last = i
            elif last is None:
                expected[b, i] = torch.tensor(corner, dtype=positions.dtype)
            else:
                expected[b, i] = torch.floor(positions[b, last]) + 0.5
    return expected


def case_migration_placement(grid, ctx):
    """Arrivals take the free slots nearest their x plane (the slots hold the lattice's
    order): those coming in across the lower face the lowest free slots, those across
    the upper face the highest, the rest new slots at the end; the slots left empty sit
    next to their neighbours. Hand-made moves on 2 ranks, x split 8 = 4 + 4."""
    from torchpm.distributed import PencilDecomposition

    mesh = PencilDecomposition((8, 8, 4), ctx["groups"][grid])
    rank = ctx["rank"]
    axis = 0
    low = 4.0 * rank
    positions = torch.full((1, 8, 3), 0.5, dtype=torch.float64)
    positions[0, :, axis] = low + torch.tensor([0.5, 0.5, 1.5, 1.5, 2.5, 2.5, 3.5, 3.5], dtype=torch.float64)
    ids = torch.arange(8).unsqueeze(0) + 10 * rank
    other = 10 * (1 - rank)

    def migrate(moves):
        nonlocal positions, ids
        moved = positions.clone()
        for slot, coordinate in moves:
            moved[0, slot, axis] = coordinate
        _, positions, ids = mesh.migrate(moved, ids)

    # 1. Two leave each rank, one across each face; in arrival (slot) order the
    # particle from across one face would land among those at the other.
    migrate([(0, -0.3), (7, 4.2)] if rank == 0 else [(0, 3.8), (7, 8.2)])
    assert ids[0].tolist() == [other + 7] + list(range(10 * rank + 1, 10 * rank + 7)) + [other], ids
    wrapped = [0.2, 3.8] if rank == 0 else [4.2, 7.7]
    assert torch.allclose(positions[0, [0, 7], axis], torch.tensor(wrapped, dtype=torch.float64)), positions

    # 2. Three leave rank 0 (slots 1, 2, 6) and one arrives from above: it takes the
    # highest free slot, and the two left empty sit in the cell of slot 0's particle.
    # Rank 1 frees one slot and receives three: the lowest takes it, the others take
    # new slots at the end.
    migrate([(1, -0.4), (2, 4.1), (6, 4.4)] if rank == 0 else [(1, 3.9)])
    if rank == 0:
        assert ids[0].tolist() == [17, -1, -1, 3, 4, 5, 11, 10], ids
        assert positions[0, 1].tolist() == [0.5, 0.5, 0.5] and positions[0, 2].tolist() == [0.5, 0.5, 0.5]
    else:
        assert ids[0].tolist() == [7, 2, 12, 13, 14, 15, 16, 0, 6, 1], ids
    assert torch.equal(positions, _expected_empty_positions(positions, ids, mesh.padding_position))

    # 3. Three arrive at rank 0 with two slots free: the lower two take them in order of
    # position, the highest a new slot at the end.
    migrate([] if rank == 0 else [(2, 0.3), (3, 1.2), (4, 3.7)])
    if rank == 0:
        assert ids[0].tolist() == [17, 12, 13, 3, 4, 5, 11, 10, 14], ids
    else:  # 3 of 10 slots empty: more than a quarter, compacted in order
        assert ids[0].tolist() == [7, 2, 15, 16, 0, 6, 1], ids
    assert torch.equal(positions, _expected_empty_positions(positions, ids, mesh.padding_position))


def case_migration_ignores_empty_slots(grid, ctx):
    """Where arrivals land depends on the occupied slots only: the empty slots' own
    positions and momenta (which the kicks and drifts since the last migration move,
    and which a returned state resets) change nothing. A run's particles at step 1,
    drifted so that some cross to the other rank, migrated once with the empty slots
    as the run holds them and once with them scattered over the block."""
    import torchpm

    sim = torchpm.Simulation(16, 64.0, 2, steps=5, dtype=torch.float64, mesh=ctx["groups"][grid])
    mesh = sim.force_mesh
    with torch.no_grad():
        state = sim(sim.white_noise(seed=2), until=sim.scale_factors[1], return_mesh_units=True)
    empty = state.ids < 0
    counts = torch.tensor([int(empty.sum())])
    torch.distributed.all_reduce(counts)
    assert int(counts) > 0, "no rank holds empty slots: the case tests nothing"
    drifted = state.positions + 0.5 * state.momenta / state.momenta.abs().max()
    generator = torch.Generator().manual_seed(ctx["rank"])
    scattered = drifted.clone()
    low, size = mesh.local_real_offset, mesh.local_real_shape
    for axis in range(3):
        values = low[axis] + size[axis] * torch.rand(drifted.shape[:2], generator=generator, dtype=torch.float64)
        scattered[..., axis] = torch.where(empty, values, drifted[..., axis])
    momenta = torch.where(empty.unsqueeze(-1), torch.randn(drifted.shape, generator=generator,
                                                            dtype=torch.float64), state.momenta)
    _, positions, ids, moved = mesh.migrate(drifted, state.ids, state.momenta)
    _, other_positions, other_ids, other_moved = mesh.migrate(scattered, state.ids, momenta)
    arrived = torch.tensor([int((~torch.isin(ids[ids >= 0], state.ids[state.ids >= 0])).sum())])
    torch.distributed.all_reduce(arrived)
    assert int(arrived) > 0, "no particle changed rank: the placement of arrivals is not tested"
    assert torch.equal(ids, other_ids), "the empty slots' positions changed where the arrivals went"
    assert torch.equal(positions, other_positions) and torch.equal(moved, other_moved)


def case_resume_bits(grid, ctx):
    """A run stopped with ``until`` and resumed (``resume``, mesh units) equals the
    uninterrupted run bit for bit, float32 and float64, sorted every 2nd step or not
    (stops at sort steps and between them), and so does one stopped twice
    (as the command line does for its snapshots). The empty slots of the stopped state
    have zero momentum, whereas the run's have been kicked and drifted since their
    last migration: the migrations must not read them. (This configuration placed
    arrivals differently, and so painted in another order, before they did not.)"""
    import torchpm

    differ = []
    for dtype, sort_every in ((torch.float32, 0), (torch.float64, 0), (torch.float64, 2)):
        sim = torchpm.Simulation(16, 64.0, 2, steps=5, dtype=dtype, mesh=ctx["groups"][grid], sort_every=sort_every)
        noise = sim.white_noise(seed=2)
        with torch.no_grad():
            whole = sim.gather(sim(noise, return_mesh_units=True))
            runs = {}
            for k in (1, 2, 3):
                middle = sim(noise, until=sim.scale_factors[k], return_mesh_units=True)
                assert bool((middle.momenta[middle.ids < 0] == 0).all()), "momentum in an empty slot"
                runs[f"resumed at step {k}"] = sim.resume(middle, mesh_units=True, return_mesh_units=True)
            first = sim(noise, until=sim.scale_factors[1], return_mesh_units=True)
            second = sim.resume(first, mesh_units=True, until=sim.scale_factors[3], return_mesh_units=True)
            runs["resumed at steps 1 and 3"] = sim.resume(second, mesh_units=True, return_mesh_units=True)
            for name, state in runs.items():
                state = sim.gather(state)
                if not (torch.equal(state.positions, whole.positions) and torch.equal(state.momenta, whole.momenta)):
                    error = float((state.positions - whole.positions).abs().max())
                    differ.append(f"{dtype}, sort_every {sort_every}, {name}: max |dx| {error:.3g}")
    assert not differ, "resumed runs differ from the uninterrupted one: " + "; ".join(differ)


def case_migration_headroom(grid, ctx):
    """A rank that gains a few particles at every migration grows its slots once, not at
    every migration (it would copy every per-particle tensor each time), and the
    migrations that do not grow write in place when allowed."""
    from torchpm.distributed import PencilDecomposition

    mesh = PencilDecomposition((16, 16, 4), ctx["groups"][grid])
    rank, world = ctx["rank"], ctx["world"]
    per_rank = 3200
    generator = torch.Generator().manual_seed(5 + rank)
    low = torch.tensor(mesh.local_real_offset, dtype=torch.float64)
    size = torch.tensor(mesh.local_real_shape, dtype=torch.float64)
    positions = low + torch.rand(1, per_rank, 3, generator=generator, dtype=torch.float64) * size
    ids = torch.arange(per_rank).unsqueeze(0) + rank * per_rank
    target = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)  # in rank 0's block
    counts, in_place = [], []
    rounds = 10  # 50 arrivals: within the headroom of 1/64 of 3200 slots
    for round_ in range(rounds):
        moved = positions.clone()
        if rank == world - 1:  # five particles to rank 0 per round
            sending = torch.nonzero(ids[0] >= 0).reshape(-1)[:5]
            moved[0, sending] = target
        _, positions, ids = mesh.migrate(moved, ids, overwrite=True)
        counts.append(positions.shape[1])
        in_place.append(positions.data_ptr() == moved.data_ptr())
    if rank == 0:
        assert sum(1 for a, b in zip([per_rank] + counts, counts) if b != a) == 1, f"slot counts {counts}"
        assert counts[-1] - per_rank >= rounds * 5, counts
        grown = counts.index(counts[-1])
        assert all(in_place[grown + 1:]) and not in_place[grown], (counts, in_place)
    elif rank == world - 1:
        assert counts == [per_rank] * rounds and all(in_place), (counts, in_place)
    gained = rounds * 5
    assert int((ids >= 0).sum()) == per_rank + (gained if rank == 0 else -gained if rank == world - 1 else 0)


def case_migration_gradcheck(grid, ctx):
    from test_distributed_fft import as_global_function

    from torchpm.distributed import PencilDecomposition

    import torch.distributed as dist

    mesh = PencilDecomposition((8, 6, 4), ctx["groups"][grid])
    world, rank = ctx["world"], ctx["rank"]
    count = 5
    # Positions away from block edges, so small perturbations never change owners.
    generator = torch.Generator().manual_seed(7)
    all_positions = (torch.randint(0, 8, (world, 1, count, 3), generator=generator).to(torch.float64) + 0.5)
    all_positions[..., 1] = all_positions[..., 1] % 6
    all_positions[..., 2] = all_positions[..., 2] % 4
    ids = torch.arange(count).unsqueeze(0) + rank * count
    sizes_after = [None] * world
    _, moved, moved_ids = mesh.migrate(all_positions[rank], ids)
    dist.all_gather_object(sizes_after, moved.shape[1])
    in_shapes = [(1, count, 5) for _ in range(world)]
    out_shapes = [(1, n, 5) for n in sizes_after]

    def function(local):
        positions, attributes = local[..., :3], local[..., 3:]
        _, positions, _, attributes = mesh.migrate(positions, ids, attributes)
        return torch.cat([positions, attributes], dim=-1)

    wrapped, n = as_global_function(function, in_shapes, out_shapes)
    attributes = global_random((world, 1, count, 2), 9)
    x = torch.cat([all_positions, attributes], dim=-1).reshape(-1).clone().requires_grad_()
    assert torch.autograd.gradcheck(wrapped, (x,), atol=1e-8, rtol=1e-6), "gradcheck through a migration"


def case_capacity(grid, ctx):
    from torchpm.distributed import PencilDecomposition

    mesh = PencilDecomposition((8, 6, 4), ctx["groups"][grid])
    ids = torch.arange(6).unsqueeze(0) + 6 * ctx["rank"]
    positions = torch.full((1, 6, 3), 0.5, dtype=torch.float64)  # everything to rank (0, 0)
    try:
        mesh.migrate(positions, ids, capacity=4)
    except RuntimeError as error:
        message = str(error)
        assert "capacity 4" in message and "rank 0" in message and "particle_capacity" in message, message
    else:
        raise AssertionError("overflowing the capacity did not raise")
    # Within capacity it works.
    _, moved, moved_ids = mesh.migrate(positions, ids, capacity=6 * ctx["world"])
    assert moved.shape[1] == (6 * ctx["world"] if ctx["rank"] == 0 else 0)


def case_nonfinite(grid, ctx):
    from torchpm.distributed import PencilDecomposition

    mesh = PencilDecomposition((8, 6, 4), ctx["groups"][grid])
    # NaN, and a finite coordinate beyond +-2^40 cells (the wrap of a split axis would
    # hide it from the paint's check: the run went on with the particle moved)
    for bad in (float("nan"), 1e30, -3e12):
        positions = torch.full((1, 3, 3), 1.5, dtype=torch.float64)
        if ctx["rank"] == ctx["world"] - 1:
            positions[0, 1, 0] = bad
        try:
            mesh.migrate(positions, torch.arange(3).unsqueeze(0))
        except RuntimeError as error:
            assert "NaN or infinite positions, or at or beyond +-2^40 cells" in str(error), str(error)
            assert f"rank {ctx['world'] - 1}" in str(error), str(error)
        else:
            raise AssertionError(f"a position {bad} did not raise on every rank")


def case_bad_input(grid, ctx):
    """White noise with a NaN on one rank: every rank raises the same clear error."""
    _, distributed = simulations(grid, ctx)
    noise = distributed.white_noise(seed=1)
    if ctx["rank"] == 0:
        noise[0, 0, 0, 0] = float("inf")
    try:
        distributed(noise)
    except ValueError as error:
        assert "white_noise" in str(error) and "rank 0" in str(error), str(error)
    else:
        raise AssertionError("non-finite white noise on rank 0 did not raise everywhere")


def case_interlaced_tsc(grid, ctx):
    """TSC painting with interlacing and its compensated P(k) on the grid (particles given
    to ranks regardless of position) equal the serial ones."""
    from torchpm.analysis import paint_density, power_spectrum
    from torchpm.distributed import PencilDecomposition
    from torchpm.mesh import LocalMesh

    shape, box = (10, 8, 6), (50.0, 40.0, 30.0)
    mesh = PencilDecomposition(shape, ctx["groups"][grid])
    positions = torch.rand(2, 300, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    positions = positions * torch.tensor(shape, dtype=torch.float64) * 1.5 - 2.0  # some outside the box
    weights = 0.5 + torch.rand(2, 300, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    mine = torch.arange(300) % ctx["world"] == ctx["rank"]
    serial = paint_density(positions, LocalMesh(shape), weights=weights, order="tsc", interlacing=True)
    local = paint_density(positions[:, mine], mesh, weights=weights[:, mine], order="tsc", interlacing=True)
    expected = mesh.local_real_part(serial)
    assert_small(float((local - expected).abs().max()), float(expected.abs().max()), "interlaced TSC density")
    spectrum = power_spectrum(local, box, window="tsc", mesh=mesh)
    reference = power_spectrum(serial, box, window="tsc")
    assert_small(float((spectrum.power - reference.power).abs().max()), float(reference.power.abs().max()), "P(k)")


def case_redshift_multipoles(grid, ctx):
    """The redshift-space state of a run on the grid, its density and its multipoles (the
    function and the layer) equal the serial ones on every rank, and so does the gradient
    of a loss of the quadrupole in the white noise and Omega_c; a rank with another line
    of sight raises on every rank."""
    import torchpm
    from torchpm.analysis import power_multipoles, power_spectrum
    from torchpm.nn import PowerSpectrum

    # (ending at a = 0.5: at a = 1, E = 1 in a flat universe whatever Omega_c)
    serial, distributed = simulations(grid, ctx, steps=2, a_end=0.5)
    box = serial.box_size
    results = []
    for sim in (serial, distributed):
        omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
        sim.cosmology = torchpm.Planck15(Omega_c=omega_c)
        noise = sim.white_noise(batch=2, seed=7).requires_grad_()
        mesh = sim.force_mesh
        moved = sim.redshift_space(sim(noise, return_mesh_units=True), axis=0)
        delta = sim.density(moved) - 1.0
        multipoles = power_multipoles(delta, box, axis="x", window="cic", mesh=None if mesh.is_local else mesh)
        layer = PowerSpectrum(mesh.global_shape, box, ells=(0, 2, 4), axis=0, compensate_cic=True,
                              dtype=torch.float64, mesh=mesh)
        assert_small(float((layer(delta) - multipoles.power).detach().abs().max()),
                     float(multipoles.power.detach().abs().max()), "layer against the function")
        loss = (multipoles.power[:, 1] ** 2).sum()
        loss.backward()
        results.append((delta.detach(), multipoles, noise.grad, omega_c.grad))
    (density, expected, noise_grad, omega_grad), (local_density, got, local_grad, local_omega_grad) = results
    expected_density = distributed.force_mesh.local_real_part(density)
    assert_small(float((local_density - expected_density).abs().max()), float(expected_density.abs().max()),
                 "redshift-space density")
    assert torch.equal(got.modes, expected.modes) and got.ells == expected.ells
    assert_small(float((got.power - expected.power).detach().abs().max()), float(expected.power.detach().abs().max()),
                 "multipoles")
    expected_grad = distributed.particle_mesh.local_real_part(noise_grad)
    assert_small(float((local_grad - expected_grad).abs().max()), float(expected_grad.abs().max()),
                 "d loss / d white noise")
    assert_small(abs(float(local_omega_grad - omega_grad)), abs(float(omega_grad)), "d loss / d Omega_c")
    field = distributed.force_mesh.local_real_part(global_random((1, *serial.mesh_shape), 8))
    mesh, first = distributed.force_mesh, ctx["rank"] == 0
    expect_error_everywhere(lambda: power_multipoles(field, box, axis=2 if first else 1, mesh=mesh), "`axis`", "rank 0")
    # a bad argument on one rank, or another shot noise: every rank raises (none is left
    # waiting in the agreement, none gets another spectrum)
    expect_error_everywhere(lambda: power_multipoles(field, box, ells=(0, 2) if first else (1,), mesh=mesh),
                            "`ells` must be", "rank 1")
    expect_error_everywhere(lambda: power_multipoles(field, box, axis=2 if first else 7, mesh=mesh),
                            "`axis` (the line of sight) must be", "rank 1")
    expect_error_everywhere(lambda: power_multipoles(field, box, n_particles=None if first else 100, mesh=mesh),
                            "shot noise", "rank 1")
    expect_error_everywhere(lambda: power_spectrum(field, box, shot_noise=1.0 if first else float("nan"), mesh=mesh),
                            "`shot_noise` must be", "rank 1")
    expect_error_everywhere(lambda: PowerSpectrum(mesh.global_shape, box, ells=(0,) if first else (3,), mesh=mesh),
                            "`ells` must be", "rank 1")


def case_lightcone(grid, ctx):
    """Lens planes taken during a run on the grid (line of sight along x, a split axis), the
    Born convergence from them, and the gradient of a convergence loss in the white noise
    and Omega_c equal the serial ones on every rank; a rank asking for other planes, another
    resolution or window, or passing a bad one, raises on every rank, and so does a rank
    with a non-finite particle."""
    import torchpm
    from torchpm import lensing

    planes = lensing.lens_planes(torchpm.Planck15(), CONFIG["box_size"], 3, axis="x")
    serial, distributed = simulations(grid, ctx, steps=lensing.lightcone_steps(planes, 0.1, 2))
    angles = lensing.angular_grid(20.0, 5)
    results = []
    for sim in (serial, distributed):
        omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
        sim.cosmology = torchpm.Planck15(Omega_c=omega_c)
        noise = sim.white_noise(batch=2, seed=7).requires_grad_()
        taken = lensing.lightcone(sim, noise, planes=planes, resolution=(6, 5))
        kappa = lensing.convergence_born(taken, planes, sim.box_size, angles, [0.01, 0.02], sim.cosmology)
        (kappa**2).sum().backward()
        results.append((taken.detach(), kappa.detach(), noise.grad, omega_c.grad))
    (taken, kappa, noise_grad, omega_grad), (local_taken, local_kappa, local_grad, local_omega_grad) = results
    assert_small(float((local_taken - taken).abs().max()), float(taken.abs().max()), "lens planes")
    assert_small(float((local_kappa - kappa).abs().max()), float(kappa.abs().max()), "convergence")
    expected_grad = distributed.particle_mesh.local_real_part(noise_grad)
    assert_small(float((local_grad - expected_grad).abs().max()), float(expected_grad.abs().max()),
                 "d loss / d white noise")
    assert_small(abs(float(local_omega_grad - omega_grad)), abs(float(omega_grad)), "d loss / d Omega_c")
    # one rank's other or bad planes, resolution or window: every rank raises before the run
    first = ctx["rank"] == 0
    noise = distributed.white_noise(seed=7)
    expect_error_everywhere(lambda: lensing.lightcone(distributed, noise, planes=planes, resolution=6 if first else 5),
                            "lightcone", "`resolution`", "rank 1")
    expect_error_everywhere(lambda: lensing.lightcone(distributed, noise, planes=planes, resolution=(6, 0 if first else 5)),
                            "lightcone", "`resolution` must be a positive integer", "rank 0")
    expect_error_everywhere(lambda: lensing.lightcone(distributed, noise, planes=planes, resolution=6,
                                                      order="cic" if first else "quintic"), "lightcone", "rank 1")
    other = lensing.lens_planes(torchpm.Planck15(Omega_c=0.3), CONFIG["box_size"], 3, axis="x")
    expect_error_everywhere(lambda: lensing.lightcone(distributed, noise, planes=planes if first else other,
                                                      resolution=6), "lightcone", "rank 1")
    state = distributed(noise, return_mesh_units=True)
    positions = state.positions * torch.tensor(distributed.cell_size, dtype=torch.float64)
    mesh = distributed.force_mesh
    expect_error_everywhere(lambda: lensing.density_plane(positions, CONFIG["box_size"], 5.0, 0.0 if first else 2.0,
                                                          4, ids=state.ids, mesh=mesh),
                            "`width` must be in", "rank 0")
    # a grid state's empty slots carry no mass: ids are required
    expect_error_everywhere(lambda: lensing.density_plane(positions, CONFIG["box_size"], 5.0, 2.0, 4, mesh=mesh),
                            "pass `ids`")
    # a non-finite particle on one rank: every rank raises (none waits in the plane's sum)
    broken = positions.clone()
    if not first:
        broken[0, 0, 1] = float("nan")
    expect_error_everywhere(lambda: lensing.density_plane(broken, CONFIG["box_size"], 5.0, 2.0, 4, ids=state.ids,
                                                          mesh=mesh), "`positions` must be finite", "rank 1")
    # a NaN weight on one rank, likewise (it raised on that rank alone, in the paint)
    weights = torch.ones(state.ids.shape, dtype=torch.float64)
    if not first:
        weights[0, (state.ids[0] >= 0).nonzero()[0, 0]] = float("nan")
    expect_error_everywhere(lambda: lensing.density_plane(positions, CONFIG["box_size"], 5.0, 2.0, 4, ids=state.ids,
                                                          weights=weights, mesh=mesh), "`weights` must be finite",
                            "rank 1")
    # with `total`: checked where the slab's particles are known (one more check together)
    slab = (positions[..., 2] >= 4.0) & (positions[..., 2] < 6.0) & (state.ids >= 0)
    weights = torch.ones(state.ids.shape, dtype=torch.float64)
    if not first and bool(slab.any()):
        weights[slab.nonzero()[0, 0], slab.nonzero()[0, 1]] = float("nan")
    assert bool(mesh.all_reduce(weights.isnan().any().to(torch.float64).reshape(1))), "no slab particle on rank 1"
    expect_error_everywhere(lambda: lensing.density_plane(positions, CONFIG["box_size"], 5.0, 2.0, 4, ids=state.ids,
                                                          weights=weights, total=100.0, mesh=mesh),
                            "`weights` must be finite in the slab", "rank 1")


def case_trajectory(grid, ctx):
    """Simulation.trajectory on the grid: each state is bit for bit the grid run stopped
    there, equals the serial state (by id), and the gradient of a loss over the states
    by the adjoint method (stretches chained by their forces, migrations in between)
    equals the serial autograd gradient; a rank with other scale factors, or a bad one,
    raises on every rank."""
    import torchpm

    serial, distributed = simulations(grid, ctx)
    at = [serial.scale_factors[i] for i in (0, 2, 3, 5)]
    noise = serial.white_noise(batch=2, seed=13)
    local_noise = distributed.white_noise(batch=2, seed=13)
    with torch.no_grad():
        states = distributed.trajectory(local_noise, at=at, return_mesh_units=True)
        expected = serial.trajectory(noise, at=at)
        for state, reference, a in zip(states, expected, at):
            stopped = distributed(local_noise, until=a, return_mesh_units=True)
            assert torch.equal(state.positions, stopped.positions) and torch.equal(state.momenta, stopped.momenta), a
            assert torch.equal(state.ids, stopped.ids), a
            whole = distributed.gather(distributed.to_physical(state.positions, state.momenta, state.a, state.ids))
            box = distributed.box_size
            assert_small(float(periodic_difference(whole.positions, reference.positions, box).abs().max()), max(box),
                         f"positions at {a}")
            assert_small(float((whole.momenta - reference.momenta).abs().max()),
                         float(reference.momenta.abs().max()), f"momenta at {a}")
    field = global_random((2, *serial.mesh_shape), 5)
    results = []
    for sim in (serial, torchpm.Simulation(**CONFIG, mesh=ctx["groups"][grid], adjoint=True)):
        omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
        sim.cosmology = torchpm.Planck15(Omega_c=omega_c)
        w = sim.white_noise(batch=2, seed=13).requires_grad_()
        local_field = sim.force_mesh.local_real_part(field)
        losses = sim.trajectory(w, at=at[1:], observe=lambda state: (sim.density(state) * local_field).sum())
        sum(loss * (index + 1) for index, loss in enumerate(losses)).backward()
        results.append((w.grad, omega_c.grad))
    (noise_grad, omega_grad), (local_grad, local_omega_grad) = results
    expected_grad = distributed.particle_mesh.local_real_part(noise_grad)
    assert_small(float((local_grad - expected_grad).abs().max()), float(expected_grad.abs().max()),
                 "d loss / d white noise (adjoint, chained stretches)")
    assert_small(abs(float(local_omega_grad - omega_grad)), abs(float(omega_grad)), "d loss / d Omega_c")
    first = ctx["rank"] == 0
    expect_error_everywhere(lambda: distributed.trajectory(local_noise, at=at if first else at[1:]),
                            "Simulation.trajectory", "`at`")
    expect_error_everywhere(lambda: distributed.trajectory(local_noise, at=at if first else [0.123, 1.0]),
                            "Simulation.trajectory", "`at[0]` = 0.123 is not one of")
    expect_error_everywhere(lambda: distributed.trajectory(local_noise, at=at, observe=None if first else 3),
                            "Simulation.trajectory", "`observe` must be callable")

    # An observer raising on the last rank only, at the second scale factor: every rank
    # raises (the others would otherwise wait in the run's next all-to-all), the failing
    # rank's error chained to its own exception; then the grid still runs.
    last = ctx["rank"] == ctx["world"] - 1
    seen = []

    def observe(state):
        seen.append(state.a)
        if last and len(seen) == 2:
            raise KeyError("no such plane")
        return state.a

    try:
        distributed.trajectory(local_noise, at=at, observe=observe)
    except RuntimeError as error:
        text = str(error)
        assert "`observe` raised at a = " in text and "KeyError" in text and "no such plane" in text, text
        assert f"rank {ctx['world'] - 1}" in text and "every rank" in text, text
        assert isinstance(error.__cause__, KeyError) == last, repr(error.__cause__)
    else:
        raise AssertionError("an observer raising on one rank did not raise on every rank")
    assert seen == at[:2], seen
    with torch.no_grad():
        assert distributed.trajectory(local_noise, at=at[:2], observe=lambda state: state.a) == at[:2]


def case_trajectory_sorted_resume(grid, ctx):
    """With ``sort_every`` on a grid, a run resumed at a step that is not a sort step
    starts without a sort: its integration must not write into the arrays it was given.
    ``trajectory(state=..., at=[state.a, ...])`` returns the state at ``state.a`` in those
    arrays (it must equal ``resume(state, until=state.a)``), and ``evolve`` must leave
    the caller's momenta alone."""
    _, distributed = simulations(grid, ctx, sort_every=2)
    noise = distributed.white_noise(batch=2, seed=13)
    a = distributed.scale_factors
    with torch.no_grad():
        start = distributed(noise, until=a[1], return_mesh_units=True)
        states = distributed.trajectory(state=start, at=[a[1], a[3]], return_mesh_units=True)
        for state, until in zip(states, (a[1], a[3])):
            expected = distributed.resume(start, until=until, return_mesh_units=True)
            assert torch.equal(state.positions, expected.positions), f"positions at {until}"
            assert torch.equal(state.momenta, expected.momenta), f"momenta at {until}"
            assert torch.equal(state.ids, expected.ids), f"ids at {until}"
        positions, momenta = start.positions.clone(), start.momenta.clone()
        distributed.evolve(positions, momenta, distributed.growth_table(), ids=start.ids, start=1, stop=3)
    assert torch.equal(positions, start.positions), "evolve wrote into the caller's positions"
    assert torch.equal(momenta, start.momenta), "evolve wrote into the caller's momenta"


def case_redshift_agreement(grid, ctx):
    """Simulation.redshift_space on a grid: a rank with another line of sight, another
    cosmology or a state at another scale factor would move its particles differently and
    the density painted from them would mix two redshift spaces (no collective notices:
    0.46 relative error in P_2 measured with another axis on one rank); every rank raises
    instead, naming the setting and the rank. Alike arguments still give the serial result."""
    import torchpm

    serial, distributed = simulations(grid, ctx, steps=2, a_end=0.5)
    state = distributed(distributed.white_noise(seed=7), return_mesh_units=True)
    expected = serial.redshift_space(serial(serial.white_noise(seed=7), return_mesh_units=True), axis=1)
    moved = distributed.gather(distributed.redshift_space(state, axis="y"))
    assert_small(float(periodic_difference(moved.positions, expected.positions, serial.mesh_shape).abs().max()),
                 max(serial.mesh_shape), "redshift-space positions")
    odd = ctx["rank"] % 2 == 1
    expect_error_everywhere(lambda: distributed.redshift_space(state, axis=0 if odd else 2),
                            "Simulation.redshift_space", "`axis`", "rank 1")
    other = torchpm.Planck15(Omega_c=0.3) if odd else None
    expect_error_everywhere(lambda: distributed.redshift_space(state, cosmology=other),
                            "Simulation.redshift_space", "cosmology", "rank 1")
    earlier = distributed(distributed.white_noise(seed=7), until=distributed.scale_factors[1], return_mesh_units=True)
    expect_error_everywhere(lambda: distributed.redshift_space(earlier if odd else state),
                            "Simulation.redshift_space", "`a`", "rank 1")
    # one rank's bad argument: every rank raises (none waits in the next collective)
    expect_error_everywhere(lambda: distributed.redshift_space(state, axis=5 if odd else 2),
                            "Simulation.redshift_space", "rank 1")
    # a cosmology whose parameter needs a gradient on one rank only: its backward would sum
    # that gradient over the grid on that rank alone (a hang), so every rank raises
    # white_noise: one rank's bad argument raises on every rank too
    expect_error_everywhere(lambda: distributed.white_noise(seed=7, paired="yes" if odd else False),
                            "Simulation.white_noise", "`paired` must be true or false", "rank 1")
    omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=odd)
    expect_error_everywhere(lambda: distributed.redshift_space(state, cosmology=torchpm.Planck15(Omega_c=omega_c)),
                            "Simulation.redshift_space", "need gradients", "rank 1")


def case_memory_check_together(grid, ctx):
    """A rank whose device has too little memory for the run makes every rank raise
    MemoryError (naming that rank) at construction and at a larger batch, instead of
    raising alone with the others waiting in the next collective; "warn" and "off" go on."""
    import warnings

    import torchpm
    import torchpm.resources as resources

    original = resources.available_memory
    short = ctx["rank"] == 1
    resources.available_memory = lambda device: 1000 if short else original(device)
    try:
        try:
            torchpm.Simulation(**CONFIG, mesh=ctx["groups"][grid])
        except MemoryError as error:
            assert "rank 1" in str(error) and "needs about" in str(error), str(error)
        else:
            raise AssertionError("a run too large for rank 1 was built")
        sim = torchpm.Simulation(**CONFIG, mesh=ctx["groups"][grid], memory_check="off")
        sim.white_noise(batch=1, seed=0)
        sim.memory_check = "error"
        try:
            sim.white_noise(batch=3, seed=0)
        except MemoryError as error:
            assert "rank 1" in str(error) and "batch 3" in str(error), str(error)
        else:
            raise AssertionError("batch 3, too large for rank 1, was accepted")
        sim.memory_check = "warn"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            noise = sim.white_noise(batch=3, seed=0)
        assert any("needs about" in str(w.message) for w in caught) == short
        sim(noise)  # the run goes on together
    finally:
        resources.available_memory = original


def case_auto_grid(grid, ctx):
    """grid="auto" takes the most square grid the meshes allow: (2, 2) for a cube, and for
    a particle grid 2 planes thick in x under TSC (a (2, 2) grid would leave x blocks of 1
    plane, below the stencil's reach of 2; (4, 1) cannot split 2 planes) the y split
    (1, 4), whose run equals the serial one."""
    import torchpm

    cube = torchpm.Simulation(n_particles=8, box_size=32.0, mesh_factor=1, steps=1, grid="auto")
    assert cube.force_mesh.grid_shape == (2, 2), cube.force_mesh.grid_shape
    config = dict(n_particles=(2, 8, 8), box_size=(8.0, 32.0, 32.0), mesh_factor=1, a_start=0.2, steps=2,
                  paint_order="tsc", dtype=torch.float64)
    thin = torchpm.Simulation(**config, grid="auto")
    assert thin.force_mesh.grid_shape == (1, 4), thin.force_mesh.grid_shape
    serial = torchpm.Simulation(**config)
    expected = serial(serial.white_noise(seed=1))
    whole = thin.gather(thin(thin.white_noise(seed=1)))
    box = serial.box_size
    assert_small(float(periodic_difference(whole.positions, expected.positions, box).abs().max()), max(box),
                 "positions")


def case_power_layer(grid, ctx):
    """torchpm.nn.PowerSpectrum with mesh= on an uneven grid: the one-device layer's spectrum of
    the global field on every rank, the same bins, k and modes on every rank (a bin empty
    everywhere dropped, one empty on most ranks kept), and each rank's gradient the block of
    the one-device gradient; a mesh of another shape, or one rank's bad field, raises on all."""
    from torchpm.distributed import PencilDecomposition
    from torchpm.nn import PowerSpectrum

    shape, box = (10, 9, 8), (50.0, 45.0, 40.0)
    mesh = PencilDecomposition(shape, ctx["groups"][grid])
    whole, other = global_random((2, *shape), 21), global_random((2, *shape), 22)
    # [0.01, 0.05] holds no mode; [0.15, 0.16] only k = (0, 0, +-2 pi / 40), on one rank's block.
    for options in (dict(), dict(bins=4), dict(compensate_cic=True), dict(bins=[0.01, 0.05, 0.15, 0.16, 0.5])):
        serial = PowerSpectrum(shape, box, dtype=torch.float64, **options)
        layer = PowerSpectrum(shape, box, dtype=torch.float64, mesh=mesh, **options)
        assert layer.n_bins == serial.n_bins and torch.equal(layer.modes, serial.modes), (options, layer.modes)
        assert_small(float((layer.k - serial.k).abs().max()), float(serial.k.max()), f"k {options}")
        for buffer in (layer.k, layer.modes, layer._mode_scale.new_tensor([layer.n_bins])):
            assert torch.equal(mesh.all_reduce(buffer, "max"), mesh.all_reduce(buffer, "min")), "ranks' buffers"
        for pair in ((whole,), (whole, other)):
            global_fields = [f.clone().requires_grad_() for f in pair]
            local_fields = [mesh.local_real_part(f).clone().requires_grad_() for f in pair]
            expected, power = serial(*global_fields), layer(*local_fields)
            assert power.shape == expected.shape, (power.shape, expected.shape)
            assert_small(float((power - expected).detach().abs().max()), float(expected.detach().abs().max()),
                         f"P(k) {options}")
            cotangent = global_random(expected.shape, 23)
            expected_grads = torch.autograd.grad(expected, global_fields, cotangent)
            # Every rank computes the same loss from the replicated spectrum.
            grads = torch.autograd.grad(power, local_fields, cotangent)
            for grad, expected_grad in zip(grads, expected_grads):
                expected_grad = mesh.local_real_part(expected_grad)
                assert_small(float((grad - expected_grad).abs().max()), float(expected_grad.abs().max()),
                             f"gradient {options} {len(pair)} fields")
    try:
        PowerSpectrum((10, 9, 9), box, mesh=mesh)
    except ValueError as error:
        assert "`mesh`" in str(error) and "(10, 9, 8)" in str(error), str(error)
    else:
        raise AssertionError("a mesh of another shape was accepted")
    # torchpm.analysis without mesh= on a rank's block: the block's spectrum alone, so it
    # warns (a block of a cubic box has cells of unequal sizes); the whole field, or the
    # block with mesh=, does not
    import warnings

    from torchpm.analysis import power_spectrum

    cubic = PencilDecomposition((8, 8, 8), ctx["groups"][grid])
    field = global_random((1, 8, 8, 8), 24)
    for call, warned in ((lambda: power_spectrum(cubic.local_real_part(field), 40.0), True),
                         (lambda: power_spectrum(field, 40.0), False),
                         (lambda: power_spectrum(cubic.local_real_part(field), 40.0, mesh=cubic), False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        found = [str(w.message) for w in caught if "pass mesh=sim.force_mesh" in str(w.message)]
        assert bool(found) == warned, (warned, [str(w.message) for w in caught])
    layer = PowerSpectrum(shape, box, dtype=torch.float64, mesh=mesh)
    try:
        layer(whole if ctx["rank"] == 0 else mesh.local_real_part(whole))  # rank 0 passes the whole field
    except ValueError as error:
        assert "`field`" in str(error) and "rank 0" in str(error), str(error)
    else:
        raise AssertionError("rank 0's whole field (not its block) did not raise on every rank")


def case_correlation(grid, ctx):
    """torchpm.analysis.correlation_function / cross_correlation, and the layer
    torchpm.nn.CorrelationFunction, with mesh= on an uneven grid: every rank gets the
    one-device shells (r, lags) and xi of the global fields, and its gradient is its block of
    the one-device gradient; bad options raise on every rank."""
    from torchpm.analysis import correlation_function, cross_correlation
    from torchpm.distributed import PencilDecomposition
    from torchpm.nn import CorrelationFunction

    shape, box = (10, 9, 8), (50.0, 45.0, 40.0)
    mesh = PencilDecomposition(shape, ctx["groups"][grid])
    whole, other = global_random((2, *shape), 31), global_random((2, *shape), 32)
    for options in (dict(), dict(bins=[0.0, 6.0, 11.0, 30.0], ells=(0, 2), axis="x"),
                    dict(bins=4, window="cic", n_particles=700)):
        for pair in ((whole,), (whole, other)):
            if len(pair) == 2 and "n_particles" in options:
                continue
            function = correlation_function if len(pair) == 1 else cross_correlation
            global_fields = [f.clone().requires_grad_() for f in pair]
            local_fields = [mesh.local_real_part(f).clone().requires_grad_() for f in pair]
            expected = function(*global_fields, box, **options)
            result = function(*local_fields, box, mesh=mesh, **options)
            assert torch.equal(result.lags, expected.lags), (options, result.lags, expected.lags)
            assert_small(float((result.r - expected.r).abs().max()), float(expected.r.max()), f"r {options}")
            assert result.xi.shape == expected.xi.shape, (result.xi.shape, expected.xi.shape)
            assert_small(float((result.xi - expected.xi).detach().abs().max()),
                         float(expected.xi.detach().abs().max()), f"xi {options} {len(pair)} fields")
            cotangent = global_random(expected.xi.shape, 33)
            expected_grads = torch.autograd.grad(expected.xi, global_fields, cotangent)
            grads = torch.autograd.grad(result.xi, local_fields, cotangent)
            # The layer form, built once on the grid (collective), gives the same.
            layer = CorrelationFunction(shape, box, dtype=torch.float64, mesh=mesh, **options)
            assert torch.equal(layer.lags, expected.lags)
            layer_xi = layer(*local_fields)
            assert_small(float((layer_xi - expected.xi).detach().abs().max()),
                         float(expected.xi.detach().abs().max()), f"layer {options} {len(pair)} fields")
            layer_grads = torch.autograd.grad(layer_xi, local_fields, cotangent)
            for grad, layer_grad, expected_grad in zip(grads, layer_grads, expected_grads):
                expected_grad = mesh.local_real_part(expected_grad)
                for got, what in ((grad, "gradient"), (layer_grad, "layer gradient")):
                    assert_small(float((got - expected_grad).abs().max()), float(expected_grad.abs().max()),
                                 f"{what} {options} {len(pair)} fields")
    # One rank's bad argument raises on every rank, naming it.
    block = mesh.local_real_part(whole)
    try:
        correlation_function(block, box, mesh=mesh, n_particles=-1 if ctx["rank"] == 0 else 10, window="cic")
    except ValueError as error:
        assert "`n_particles`" in str(error), str(error)
    else:
        raise AssertionError("rank 0's bad n_particles did not raise on every rank")
    for name, bad, good in (("bins", 3, 4), ("window", 2.5, "cic"), ("box_size", -1.0, box)):
        options = {name: bad if ctx["rank"] == 0 else good}
        try:
            CorrelationFunction(shape, **{"box_size": box, **options}, mesh=mesh)
        except (TypeError, ValueError) as error:  # (every rank, not rank 0 alone while the others wait)
            assert f"`{name}`" in str(error), str(error)
        else:
            raise AssertionError(f"ranks with different `{name}` built the layer")


def case_compiled(grid, ctx):
    """torch.compile on a grid: a compiled loss through the simulation and the mesh= layers
    runs their collectives eagerly between its graphs and gives eager's value and gradient
    (with graphs compiled around them), also building the groups inside it; fullgraph=True
    refuses a collective, naming the process groups."""
    import torchpm
    from torch._dynamo.utils import counters
    from torchpm.nn import CICPaint, CICReadout, PowerSpectrum

    sim = torchpm.Simulation(8, 32.0, steps=2, dtype=torch.float64, mesh=ctx["groups"][grid])
    mesh = sim.force_mesh
    power = PowerSpectrum(mesh.global_shape, 32.0, dtype=torch.float64, mesh=mesh)
    paint, readout = CICPaint(sim.mesh_shape, mesh=mesh), CICReadout(mesh=mesh)

    def loss(noise):
        state = sim(noise, return_mesh_units=True)
        density = paint(state.positions, ids=state.ids)
        values = readout(density, state.positions) * (state.ids >= 0)
        return power(density - 1).log().sum() + values.pow(2).sum()

    noise = sim.white_noise(seed=3).requires_grad_()
    expected = loss(noise)
    expected_grad, = torch.autograd.grad(expected, noise)
    torch._dynamo.reset()
    counters.clear()
    value = torch.compile(loss)(noise)
    grad, = torch.autograd.grad(value, noise)
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert_small(abs(value.item() - expected.item()), abs(expected.item()), "compiled loss")
    assert_small(float((grad - expected_grad).abs().max()), float(expected_grad.abs().max()), "compiled gradient")
    # Groups and a decomposition built inside a compiled function (the groups are cached).
    def built_inside(x):
        from torchpm.distributed import PencilDecomposition, process_grid_groups

        return PencilDecomposition((6, 5, 4), process_grid_groups(grid)).all_reduce(x * 2)

    x = torch.arange(3.0, dtype=torch.float64)
    assert torch.equal(torch.compile(built_inside)(x), x * 2 * ctx["world"])
    try:
        torch.compile(power, fullgraph=True)(torch.ones(1, *mesh.local_real_shape, dtype=torch.float64))
    except Exception as error:  # torch's own exception type for a refused call
        assert "process groups" in str(error) and "fullgraph" in str(error), str(error)
    else:
        raise AssertionError("fullgraph=True traced a collective")


def case_paint_layers(grid, ctx):
    """torchpm.nn.CICPaint / CICReadout with mesh= on an uneven grid: each rank paints the
    particles it owns into its block of the one-device painted mesh (mass conserved over the
    ranks) and reads its block at them, with the one-device values and gradients (positions,
    weights, the field's block); a mesh of another shape, or one rank's particle it does not
    own, raises on every rank."""
    from torchpm.distributed import PencilDecomposition
    from torchpm.nn import CICPaint, CICReadout

    shape = (10, 9, 8)
    mesh = PencilDecomposition(shape, ctx["groups"][grid])
    generator = torch.Generator().manual_seed(31)
    positions = torch.rand(1, 300, 3, generator=generator, dtype=torch.float64) * torch.tensor(shape, dtype=torch.float64)
    positions = positions.expand(2, -1, -1)
    (lx, ly, _), (ox, oy, _) = mesh.local_real_shape, mesh.local_real_offset
    cell = positions[0].floor()
    owned = (cell[:, 0] >= ox) & (cell[:, 0] < ox + lx) & (cell[:, 1] >= oy) & (cell[:, 1] < oy + ly)
    assert int(mesh.all_reduce(owned.sum().reshape(1))[0]) == 300, "the test's ownership rule"
    serial_paint, layer = CICPaint(shape), CICPaint(shape, mesh=mesh)
    for weights in (None, global_random((2, 300), 32), global_random((2, 300, 3), 33)):
        global_inputs = [positions.clone().requires_grad_()] + ([] if weights is None else [weights.clone().requires_grad_()])
        local_inputs = [t[:, owned].detach().clone().requires_grad_() for t in global_inputs]
        expected, block = serial_paint(*global_inputs), layer(*local_inputs)
        expected_block = mesh.local_real_part(expected)
        assert block.shape == expected_block.shape, (block.shape, expected_block.shape)
        assert_small(float((block - expected_block).detach().abs().max()), float(expected.detach().abs().max()),
                     f"painted block, weights {None if weights is None else tuple(weights.shape)}")
        mass = mesh.all_reduce(block.detach().sum(dim=(-3, -2, -1)))
        assert_small(float((mass - expected.detach().sum(dim=(-3, -2, -1))).abs().max()), 300.0, "mass")
        cotangent = global_random(expected.shape, 34)
        expected_grads = torch.autograd.grad(expected, global_inputs, cotangent)
        grads = torch.autograd.grad(block, local_inputs, mesh.local_real_part(cotangent))
        for grad, expected_grad in zip(grads, expected_grads):
            assert_small(float((grad - expected_grad[:, owned]).abs().max()), float(expected_grad.abs().max()),
                         "paint gradient")
    # A simulation state, as a user paints it: its empty slots (id -1) get no mass with ids=
    import torchpm

    sim = torchpm.Simulation(8, 32.0, steps=2, dtype=torch.float64, mesh=ctx["groups"][grid])
    with torch.no_grad():
        state = sim(sim.white_noise(seed=4), return_mesh_units=True)
    empty = int(mesh.all_reduce((state.ids < 0).sum().reshape(1))[0])
    assert empty > 0, "no rank holds empty slots: the case tests nothing"
    state_layer = CICPaint(sim.mesh_shape, mesh=sim.force_mesh)
    block = state_layer(state.positions, ids=state.ids)
    assert float(sim.force_mesh.all_reduce(block.sum().reshape(1))[0]) == pytest.approx(512.0, rel=1e-12)
    whole = sim.gather(state)
    expected = sim.force_mesh.local_real_part(CICPaint(sim.mesh_shape)(whole.positions))
    assert_small(float((block - expected).abs().max()), float(expected.abs().max()), "a state's painted block")
    weights = global_random((1, state.ids.shape[1], 2), 39)
    both = state_layer(state.positions, weights, ids=state.ids)
    assert torch.equal(both, state_layer(state.positions, weights * (state.ids >= 0).unsqueeze(-1).double()))
    # one rank's bad ids or weights raise on every rank together (they raised on that rank
    # alone, the others waiting in the paint)
    odd = ctx["rank"] == ctx["world"] - 1
    for ids, weights in ((state.ids[:, :3] if odd else state.ids, None),
                         (state.ids, weights[0, :, 0] if odd else None)):
        try:
            state_layer(state.positions, weights, ids=ids)
        except ValueError as error:
            assert f"rank {ctx['world'] - 1}" in str(error) and "CICPaint: `" in str(error), str(error)
        else:
            raise AssertionError("one rank's bad ids or weights did not raise on every rank")
    assert float(sim.force_mesh.all_reduce(state_layer(state.positions, ids=state.ids).sum().reshape(1))[0]) == \
        pytest.approx(512.0, rel=1e-12)  # the groups still work
    serial_readout, layer = CICReadout(), CICReadout(mesh=mesh)
    for field in (global_random((2, *shape), 35), global_random((2, 3, *shape), 36)):
        global_inputs = [field.clone().requires_grad_(), positions.clone().requires_grad_()]
        local_inputs = [mesh.local_real_part(field).clone().requires_grad_(), positions[:, owned].clone().requires_grad_()]
        expected, values = serial_readout(*global_inputs), layer(*local_inputs)
        assert_small(float((values - expected[:, owned]).detach().abs().max()), float(expected.detach().abs().max()),
                     f"readout, field {tuple(field.shape)}")
        cotangent = global_random(expected.shape, 37)
        expected_field_grad, expected_position_grad = torch.autograd.grad(expected, global_inputs, cotangent)
        field_grad, position_grad = torch.autograd.grad(values, local_inputs, cotangent[:, owned])
        assert_small(float((field_grad - mesh.local_real_part(expected_field_grad)).abs().max()),
                     float(expected_field_grad.abs().max()), "readout gradient of the field's block")
        assert_small(float((position_grad - expected_position_grad[:, owned]).abs().max()),
                     float(expected_position_grad.abs().max()), "readout gradient of the positions")
    try:
        CICPaint((10, 9, 9), mesh=mesh)
    except ValueError as error:
        assert "CICPaint" in str(error) and "`mesh`" in str(error) and "(10, 9, 8)" in str(error), str(error)
    else:
        raise AssertionError("a mesh of another shape was accepted")
    # Rank 0 paints every particle, most of which it does not own.
    mine = positions if ctx["rank"] == 0 else positions[:, owned]
    for call in (lambda: CICPaint(shape, mesh=mesh)(mine),
                 lambda: CICReadout(mesh=mesh)(mesh.local_real_part(global_random((2, *shape), 38)), mine)):
        try:
            call()
        except ValueError as error:
            assert "rank 0" in str(error), str(error)
        else:
            raise AssertionError("rank 0's particles it does not own did not raise on every rank")


def case_subgrid_snapshot(grid, ctx):
    """A grid on a part of the world (as with one grid per data-parallel replica): its
    snapshot is a set of the grid's files, written by the grid's ranks alone (it was a set of
    the world's size, with the particle total all-reduced over the world: refused, or waiting
    for ranks that never call it), and it reads back as the gathered state."""
    import tempfile

    import torch.distributed as dist

    import torchpm
    from torchpm.io import read_snapshot, write_snapshot

    folder = [tempfile.mkdtemp(prefix="torchpm-subgrid-") if ctx["rank"] == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    members = [0, 1]
    pair = dist.new_group(members)  # every rank of the world makes it; ranks 0 and 1 use it
    if ctx["rank"] in members:
        sim = torchpm.Simulation(**dict(CONFIG, steps=2), mesh=(pair, None))
        with torch.no_grad():
            state = sim(sim.white_noise(seed=6), return_mesh_units=True)
        path = os.path.join(folder[0], "snap.hdf5")
        # The ranks of a set writing different batch members: refused on both, nothing written.
        with torch.no_grad():
            two = sim(sim.white_noise(batch=2, seed=6), return_mesh_units=True)
        expect_error_everywhere(lambda: write_snapshot(path, two, sim, mesh_units=True, member=ctx["rank"]),
                                "the ranks disagree on `member` (rank 0 (grid (0, 0)): 0, rank 1 (grid (1, 0)): 1)",
                                "No file of the set")
        # ... the same file index, or a count of files that is not the grid's
        expect_error_everywhere(lambda: write_snapshot(path, state, sim, mesh_units=True, file_index=0, num_files=2),
                                "the ranks' file_index are not each of 0 .. 1 once (no rank writes [1])")
        expect_error_everywhere(lambda: write_snapshot(path, state, sim, mesh_units=True, file_index=ctx["rank"],
                                                       num_files=3), "num_files=3, but 2 ranks write the set")
        assert not os.listdir(folder[0])
        written = write_snapshot(path, state, sim, mesh_units=True)
        assert written == os.path.join(folder[0], f"snap.{ctx['rank']}.hdf5"), written
        dist.barrier(group=pair)
        snapshot = read_snapshot(path)
        assert len(snapshot.files) == 2 and snapshot.total == sim.n_total, (snapshot.files, snapshot.total)
        whole = sim.gather(state)
        order = torch.argsort(snapshot.ids)
        assert torch.equal(snapshot.mesh_positions[order], whole.positions[0])
    dist.barrier()
    if ctx["rank"] == 0:
        import shutil

        shutil.rmtree(folder[0], ignore_errors=True)


def case_disagreement(grid, ctx):
    """Ranks building decompositions of different meshes: every rank raises, none aborts."""
    from torchpm.distributed import PencilDecomposition

    shape = (8, 8, 8) if ctx["rank"] == 0 else (8, 8, 9)
    try:
        PencilDecomposition(shape, ctx["groups"][grid])
    except ValueError as error:
        assert "disagree" in str(error) and "(8, 8, 9)" in str(error), str(error)
    else:
        raise AssertionError("decompositions of different meshes were accepted")


def case_failfast(grid, ctx):
    """A rank raising in the middle of a step makes the others raise within the timeout."""
    import torchpm

    sim = torchpm.Simulation(**CONFIG, mesh=ctx["failfast_groups"])
    if ctx["rank"] == 1:
        calls = {"n": 0}
        original = sim._force  # every force evaluation: the first, then one field per step

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                time.sleep(FAILFAST_TIMEOUT.total_seconds() + 5)  # alive but gone from the collectives
                raise RuntimeError("simulated failure on rank 1 in step 2")
            return original(*args, **kwargs)

        sim._force = failing
        try:
            sim(sim.white_noise())
        except RuntimeError:
            return
        raise AssertionError("the simulated failure did not raise")
    start = time.monotonic()
    try:
        sim(sim.white_noise())
    except torch.distributed.DistBackendError as error:
        elapsed = time.monotonic() - start
        assert "timeout" in str(error), str(error)
        assert elapsed < FAILFAST_TIMEOUT.total_seconds() + 30, f"took {elapsed:.1f} s"
        return
    raise AssertionError("the run completed although rank 1 failed")


# ----------------------------------------------------------------------------
# The pytest side: one spawn per world size, one test per case.

world_results = world_results_fixture(__name__, case_ids, "sim_world", timeout_s=900)


@pytest.mark.parametrize("world_size,case_id", [(w, c) for w in sorted(GRIDS) for c in case_ids(w)])
def test_distributed_simulation(world_results, world_size, case_id):
    errors = rank_errors(world_results(world_size)[case_id])
    if errors:
        pytest.fail(errors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_migration_counts_exactly_the_occupied_slots_with_non_finite_positions(dtype):
    """The migration's count of bad positions (its fast path is one reduction of the whole
    tensor): hand-counted cases, including an empty slot holding NaN (not counted), finite
    coordinates at or beyond +-2^40 cells (counted: the migration's wrap would hide them from
    the paint's check, which refuses them) and coordinates just inside (not counted)."""
    from torchpm.distributed.particles import _count_non_finite

    big = torch.finfo(dtype).max
    positions = torch.full((2, 4, 3), 1.5, dtype=dtype)
    ids = torch.arange(8).view(2, 4)
    assert _count_non_finite(positions, ids) == 0
    ids[1, 3] = -1
    positions[1, 3, 2] = float("nan")  # an empty slot: not a particle
    assert _count_non_finite(positions, ids) == 0
    positions[0, 1, 0] = float("inf")
    positions[0, 1, 1] = float("-inf")
    positions[1, 0, 2] = float("nan")
    positions[1, 2, 1] = float("-inf")
    assert _count_non_finite(positions, ids) == 3
    overflowing = torch.full((1, 3, 3), big, dtype=dtype)
    assert _count_non_finite(overflowing, torch.arange(3).view(1, 3)) == 3
    inside = 2.0**40 - 2.0**17  # the largest float32 below 2^40
    edge = torch.tensor([[[inside, -inside, 0.5], [1.5, 1e30, 0.5], [-1e13, 0.5, 0.5], [0.5, 2.0**40, 0.5]]],
                        dtype=dtype)
    assert _count_non_finite(edge, torch.arange(4).view(1, 4)) == 3
    assert _count_non_finite(edge[:, :1], torch.arange(1).view(1, 1)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_migration_holes_op_matches_its_pure_torch_twin_and_hand_cases(device, dtype):
    """torch.ops.torchpm._migration_holes (one pass: the empty slots and the leavers of
    one axis, increasing, and the non-finite count) against hand-made cases and its
    pure-torch twin, over random batches with padding, NaN, infinities, coordinates on
    the bounds and strided positions."""
    from torchpm.distributed.particles import migration_holes_reference

    op = torch.ops.torchpm._migration_holes
    # Hand case: block [2, 5) along x.
    positions = torch.tensor([[[2.0, 0, 0], [5.0, 0, 0], [4.99, 9, 9], [1.99, 0, 0], [float("nan"), 0, 0],
                               [3.0, float("inf"), 0], [float("inf"), 0, 0], [3.0, 0, 0],
                               [3.0, 1e30, 0], [3.0, 0, -(2.0**40 - 2.0**17)]]], dtype=dtype, device=device)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, -1, 8, 9]], device=device)
    holes, bad = op(positions, ids, 0, 2.0, 5.0)
    # 5.0 and 1.99 leave, NaN stays, +inf leaves, the empty slot is a hole.
    assert holes.tolist() == [1, 3, 6, 7] and holes.dtype == torch.int64
    assert int(bad) == 4 and bad.dim() == 0  # NaN, inf in y, inf in x, 1e30 in y (not just inside -2^40)
    generator = torch.Generator().manual_seed(21)
    for trial in range(20):
        batch, n = 1 + trial % 3, [0, 1, 37, 70_000][trial % 4]
        base = torch.rand(batch, n, 4, generator=generator, dtype=torch.float64) * 12 - 2
        base = base.round(decimals=trial % 2)  # some coordinates exactly on the bounds
        x = base[..., :3].to(dtype)  # strided: every 4th value skipped
        special = torch.rand(batch, n, 3, generator=generator)
        x = torch.where(special < 0.01, float("nan"), x)
        x = torch.where((special > 0.995), float("-inf"), x)
        edge = torch.where(special > 0.9925, -3e12, torch.where(special > 0.991, 2.0**40, 2.0**40 - 2.0**17))
        x = torch.where((special > 0.99) & (special <= 0.995), edge, x)
        slots = torch.arange(batch * n).view(batch, n)
        slots = torch.where(torch.rand(batch, n, generator=generator) < 0.1, -1, slots)
        x, slots = x.to(device), slots.to(device)
        axis, low = trial % 3, float(trial % 5)
        holes, bad = op(x, slots, axis, low, low + 4.0)
        expected_holes, expected_bad = migration_holes_reference(x, slots, axis, low, low + 4.0)
        assert torch.equal(holes, expected_holes), f"trial {trial}: holes"
        assert int(bad) == int(expected_bad), f"trial {trial}: non-finite count"
    with pytest.raises(ValueError, match="axis"):
        op(positions, ids, 3, 2.0, 5.0)
    with pytest.raises(ValueError, match="low"):
        op(positions, ids, 0, 5.0, 2.0)
    with pytest.raises(ValueError, match="ids"):
        op(positions, ids[:, :4], 0, 2.0, 5.0)


def test_migration_holes_cuda_kernel_checks_arguments_as_the_cpu_op():
    """The CUDA kernel of _migration_holes is pure torch (run here on CPU tensors): it
    raises the CPU op's ValueErrors, same messages, instead of an IndexError, a
    broadcast error or an answer for inverted bounds."""
    from torchpm.distributed.particles import _migration_holes_device

    positions, ids = torch.zeros(1, 4, 3), torch.arange(4).view(1, 4)
    for arguments in [
        (positions, ids, 3, 2.0, 5.0),
        (positions, ids, -1, 2.0, 5.0),
        (positions, ids, 0, 5.0, 2.0),
        (positions, ids, 0, float("nan"), 2.5),
        (positions, ids, 0, 0.0, float("inf")),
        (positions, ids[:, :2], 0, 2.0, 5.0),
        (positions, ids.int(), 0, 2.0, 5.0),
        (positions[..., :2], ids, 0, 2.0, 5.0),
        (positions.half(), ids, 0, 2.0, 5.0),
        (positions, ids[:, :2], 3, 5.0, 2.0),  # several errors: the first in the CPU op's order
    ]:
        with pytest.raises(ValueError) as native:
            torch.ops.torchpm._migration_holes(*arguments)
        with pytest.raises(ValueError) as composed:
            _migration_holes_device(*arguments)
        assert str(composed.value) == str(native.value)


def test_empty_slots_sit_in_the_cell_of_their_neighbour():
    """place_empty_slots, hand-made: runs of empty slots inside a member, at its start and
    at its end take the cell centre of the nearest particle before them (after them at
    the start); a member without particles takes the corner."""
    from torchpm.distributed.particles import place_empty_slots

    ids = torch.tensor([[-1, -1, 4, -1, -1, 7, -1], [-1] * 7, [1, 2, 3, 4, 5, 6, -1]])
    positions = torch.full((3, 7, 3), -9.0, dtype=torch.float32)
    positions[0, 2] = torch.tensor([1.25, -0.5, 7.9])
    positions[0, 5] = torch.tensor([3.0, 2.99, -3.01])
    positions[2, :6] = torch.arange(18, dtype=torch.float32).reshape(6, 3) / 4
    given = positions.clone()
    out = place_empty_slots(positions, ids, [8.0, 0.0, 0.0])
    assert out is positions
    cell_of_2, cell_of_5 = [1.5, -0.5, 7.5], [3.5, 2.5, -3.5]
    assert positions[0].tolist() == [cell_of_2, cell_of_2, given[0, 2].tolist(), cell_of_2, cell_of_2,
                                     given[0, 5].tolist(), cell_of_5]
    assert positions[1].tolist() == [[8.0, 0.0, 0.0]] * 7
    assert positions[2, :6].tolist() == given[2, :6].tolist() and positions[2, 6].tolist() == [3.5, 4.5, 4.5]
    # The same slots given as a list, and nothing to do without empty slots.
    again = given.clone()
    place_empty_slots(again, ids, [8.0, 0.0, 0.0], torch.nonzero(ids.reshape(-1) < 0).reshape(-1))
    assert torch.equal(again, positions)
    full = torch.arange(7).repeat(3, 1)
    assert torch.equal(place_empty_slots(given.clone(), full, [8.0, 0.0, 0.0]), given)


def test_arrivals_take_the_free_slots_of_their_x_plane():
    """_Placement.assign, hand-made (no process group): 2 batch members, a block of x
    planes [4, 8), rows received from 2 sources. Member 0 frees 3 slots and receives 2:
    the one in the lower half of the block takes the lowest free slot by plane, the
    other the highest, the middle one stays empty. Member 1 frees 1 slot and receives
    3: the lowest takes it, the other two take new slots at the end in order. Only the
    x plane counts (the rows' y and z do not), a leaver's x is clamped into the block
    and a NaN one counts as the first plane."""
    from torchpm.distributed.particles import _Placement

    nan = float("nan")
    holes = torch.tensor([1, 3, 4, 6])  # flat b * 6 + slot: member 0 slots 1, 3, 4; member 1 slot 0
    hole_x = torch.tensor([7.9, 3.2, nan, 5.5], dtype=torch.float64)  # planes 3, 0 (clamped), 0 (NaN), 1
    placement = _Placement(4, 8, 6, 8, holes, hole_x, free=torch.tensor([3, 1]), arrivals=torch.tensor([2, 3]),
                           received=torch.tensor([[1, 2], [1, 1]]), arriving_host=[2, 3], free_host=[3, 1])
    # Receive order: source 0 member 0, source 0 member 1 (2 rows), source 1 member 0, source 1 member 1.
    x = torch.tensor([7.2, 4.1, 6.6, 4.9, 5.0], dtype=torch.float64)
    yz = torch.tensor([[9.0, 0.1], [0.5, 3.0], [0.2, 0.2], [7.0, 1.0], [3.3, 3.3]], dtype=torch.float64)
    target, clear_out, empty_out = placement.assign(torch.cat([x[:, None], yz], dim=1))
    assert target.tolist() == [1, 8, 15, 3, 14]
    assert clear_out.tolist() == [4]
    assert empty_out.tolist() == [4, 6, 7]  # member 0's two new slots stay empty too
