"""The whole simulation: gradients, batches, linear growth, devices, bad inputs."""


import re

import numpy as np
import pytest
import torch
from torch import nn

import torchpm
from torchpm.analysis import power_spectrum

from conftest import DEVICES


def _tiny(**options):
    settings = dict(n_particles=4, box_size=40.0, mesh_factor=1, a_start=0.2, steps=2, dtype=torch.float64)
    settings.update(options)
    return torchpm.Simulation(**settings)


def _projection(state, seed=7):
    """A fixed random scalar of positions and momenta (gradcheck on one output is cheap)."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.randn(state.positions.shape, generator=generator, dtype=torch.float64).to(state.positions.device)
    v = torch.randn(state.momenta.shape, generator=generator, dtype=torch.float64).to(state.positions.device)
    return (u * state.positions).sum() + (v * state.momenta).sum()


class SplineFilter(nn.Module):
    """A smooth learnable force filter 1 + c0 k^2 + c1 a k: the hybrid-NN hook's shape."""

    def __init__(self):
        super().__init__()
        self.coefficients = nn.Parameter(torch.tensor([0.3, -0.2], dtype=torch.float64))

    def forward(self, k, a):
        return 1.0 + self.coefficients[0] * k**2 + self.coefficients[1] * a * k


def test_gradcheck_white_noise(device):
    sim = _tiny(mesh_factor=2).to(device)
    noise = torch.randn(1, 4, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)
    noise.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda w: _projection(sim(w)), (noise,), eps=1e-6, atol=1e-5, rtol=1e-4)
    # fast mode checks random projections of the full Jacobian of the positions
    assert torch.autograd.gradcheck(lambda w: sim(w).positions, (noise,), eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)


def test_gradcheck_omega_c_and_force_correction():
    noise = torch.randn(1, 4, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    correction = SplineFilter()
    sim = _tiny(force_correction=correction)
    assert "force_correction" in dict(sim.named_children())
    assert any(p is correction.coefficients for p in sim.parameters())

    omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)

    def by_omega(oc):
        sim.cosmology = torchpm.Planck15(Omega_c=oc)
        return _projection(sim(noise))

    assert torch.autograd.gradcheck(by_omega, (omega_c,), eps=1e-6, atol=1e-5, rtol=1e-4)
    sim.cosmology = torchpm.Planck15()

    def by_coefficients(c):
        original = correction.coefficients
        try:
            del correction.coefficients
            correction.coefficients = c  # a plain tensor stands in for the parameter
            return _projection(sim(noise))
        finally:
            del correction.coefficients
            correction.coefficients = original

    coefficients = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(by_coefficients, (coefficients,), eps=1e-6, atol=1e-5, rtol=1e-4)
    # and through the module's own parameters with backward()
    sim.zero_grad()
    _projection(sim(noise)).backward()
    assert correction.coefficients.grad is not None and float(correction.coefficients.grad.abs().sum()) > 0


def test_sigma8_finite_difference():
    noise = torch.randn(1, 8, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    sim = torchpm.Simulation(8, 64.0, mesh_factor=1, a_start=0.1, steps=3, dtype=torch.float64)

    def loss(sigma8):
        sim.cosmology = torchpm.Planck15(sigma8=sigma8)
        density = sim.density(sim(noise))
        return ((density - 1) ** 2).mean()

    sigma8 = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(loss(sigma8), sigma8)
    h = 1e-5
    with torch.no_grad():
        numeric = (loss(torch.tensor(0.8 + h, dtype=torch.float64)) - loss(torch.tensor(0.8 - h, dtype=torch.float64))) / (2 * h)
    print(f"d loss / d sigma8: autograd {float(grad):.8e}, finite difference {float(numeric):.8e}")
    assert float(grad) > 0
    assert abs(float(grad) - float(numeric)) < 1e-5 * abs(float(numeric))


def test_checkpointing_gives_the_same_gradient():
    noise = torch.randn(1, 4, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpoint in (False, True):
        w = noise.clone().requires_grad_(True)
        _projection(_tiny(steps=3, checkpoint=checkpoint)(w)).backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


def test_batch_equals_separate_runs(device, reproducible):
    # (reproducible: the density's paints below are compared bit for bit; on CUDA the
    # scatter's atomic adds sum in a varying order)
    sim = _tiny(n_particles=(4, 4, 6), box_size=(40.0, 40.0, 60.0), mesh_factor=2, steps=3).to(device)
    noise = sim.white_noise(batch=2, seed=5)
    assert noise.shape == (2, 4, 4, 6) and noise.device.type == device.type
    both = sim(noise)
    assert both.positions.shape == (2, 96, 3) and both.momenta.shape == (2, 96, 3)
    for i in range(2):
        single = sim(noise[i])
        torch.testing.assert_close(both.positions[i : i + 1], single.positions, rtol=0, atol=1e-12)
        torch.testing.assert_close(both.momenta[i : i + 1], single.momenta, rtol=0, atol=1e-12)
    density = sim.density(both)
    assert density.shape == (2, 8, 8, 12)
    torch.testing.assert_close(density.mean(dim=(1, 2, 3)), torch.ones(2, dtype=torch.float64, device=device))
    # the positions with ids weigh only the occupied slots; the positions alone every slot
    assert torch.equal(sim.density(both.positions, ids=both.ids), density)
    assert torch.equal(sim.density(both.positions, ids=both.ids.int()), density)
    assert torch.equal(sim.density(both.positions), density)
    emptied = both.ids.clone()
    emptied[:, :48] = -1
    half = sim.density(both.positions, ids=emptied)
    torch.testing.assert_close(half.sum(dim=(1, 2, 3)), density.sum(dim=(1, 2, 3)) / 2, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"density: expected integer `ids` of shape \(2, 96\)"):
        sim.density(both.positions, ids=both.ids[:, :5])
    with pytest.raises(ValueError, match="pass `ids` with positions only"):
        sim.density(both, ids=both.ids)
    with pytest.raises(ValueError, match=r"density: expected positions of shape \(B, N, 3\)"):
        sim.density(both.positions[..., :2])
    # positions are wrapped into the box
    box = torch.tensor([40.0, 40.0, 60.0], dtype=torch.float64, device=device)
    assert bool(((both.positions >= 0) & (both.positions < box)).all())


def test_float32_default_and_seeded_noise():
    sim = torchpm.Simulation(8, 64.0, mesh_factor=2, steps=2)
    assert sim.dtype == torch.float32
    state = sim(sim.white_noise(seed=1))
    assert state.positions.dtype == torch.float32
    torch.testing.assert_close(sim.white_noise(seed=1), sim.white_noise(seed=1))
    assert not torch.equal(sim.white_noise(seed=1), sim.white_noise(seed=2))
    # float32 and float64 runs agree to float32 rounding
    sim64 = torchpm.Simulation(8, 64.0, mesh_factor=2, steps=2, dtype=torch.float64)
    state64 = sim64(sim.white_noise(seed=1).double())
    assert float((state.positions.double() - state64.positions).abs().max()) < 1e-3


def test_linear_growth_at_the_largest_scales():
    """P_final / P_initial at the lowest k equals (D1(1) / D1(a0))^2 within 1%.

    The lowest mode must be far below the particle Nyquist frequency: the CIC window
    and the lattice make PM growth deviate from linear theory by ~(k / k_Nyquist)^2
    (3% at k_Nyquist/16 with 32^3 particles, 0.01% at k_Nyquist/32 here).
    """
    options = dict(n_particles=64, box_size=4000.0, mesh_factor=2, a_start=0.1)
    noise = torch.randn(1, 64, 64, 64, generator=torch.Generator().manual_seed(4))
    initial = torchpm.Simulation(steps=0, **options)
    final = torchpm.Simulation(steps=10, **options)
    with torch.no_grad():
        spectra = [power_spectrum(sim.density(sim(noise))[0] - 1, 4000.0) for sim in (initial, final)]
    growth = torchpm.Planck15().growth([0.1, 1.0]).D1
    expected = float((growth[1] / growth[0]) ** 2)
    measured = float(spectra[1].power[0] / spectra[0].power[0])
    print(f"lowest-k growth: measured {measured:.5f}, (D1(1)/D1(0.1))^2 = {expected:.5f}")
    assert abs(measured / expected - 1) < 0.01


def test_linear_field_matches_the_input_power():
    """The linear field's measured P(k), averaged over seeds, follows the input P(k)."""
    sim = torchpm.Simulation(16, 200.0, steps=0, dtype=torch.float64)
    noise = sim.white_noise(batch=24, seed=0)
    spectrum = power_spectrum(sim.linear_field(noise), 200.0)
    measured = spectrum.power.mean(0)
    expected = torchpm.linear_power(spectrum.k, torchpm.Planck15())
    # shells hold many modes: 24 seeds x modes; compare where the k average is meaningful
    ratio = (measured / expected)[2:]
    assert float((ratio - 1).abs().max()) < 0.1


def test_leapfrog_option_runs_close_to_fastpm():
    noise = torch.randn(1, 8, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    fastpm = torchpm.Simulation(8, 256.0, steps=20, dtype=torch.float64)(noise)
    leapfrog = torchpm.Simulation(8, 256.0, steps=20, integrator="leapfrog", dtype=torch.float64)(noise)
    difference = float((fastpm.positions - leapfrog.positions).abs().max())
    assert 0 < difference < 0.5  # Mpc/h, in a box of 256 Mpc/h with 32 Mpc/h cells


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(steps=[0.5, 0.3]), "strictly increasing"),
        (dict(steps=[0.05, 0.5]), "strictly increasing"),
        (dict(a_start=0.0), "a_start"),
        (dict(a_start=1.5), "a_start"),
        (dict(steps=[0.5, 1.2]), r"\(0, 1\]"),
        (dict(a_end=2.0), "a_end"),
        (dict(box_size=-1.0), "box_size"),
        (dict(box_size=(10.0, 0.0, 10.0)), "box_size"),
        (dict(mesh_factor=1.5), "mesh_factor"),
        (dict(mesh_factor=0), "mesh_factor"),
        (dict(n_particles=0), "n_particles"),
        (dict(lpt_order=3), "lpt_order"),
        (dict(integrator="euler"), "integrator"),
        (dict(gradient="sobel"), "gradient"),
        (dict(power_spectrum=3), "power_spectrum"),
        (dict(cosmology="Planck15"), "cosmology"),
        (dict(particle_capacity=63), r"`particle_capacity` 63 is below the 64 particles"),
        (dict(particle_capacity=0), r"`particle_capacity` must be None or a positive integer, got 0"),
        (dict(particle_capacity=-3), r"`particle_capacity` must be None or a positive integer, got -3"),
        (dict(particle_capacity=64.0), r"`particle_capacity` must be None or a positive integer, got 64.0"),
    ],
)
def test_bad_settings_raise(options, match):
    settings = dict(n_particles=4, box_size=40.0, a_start=0.1, steps=2)
    settings.update(options)
    with pytest.raises(ValueError, match=match):
        sim = torchpm.Simulation(**settings)
        sim(sim.white_noise())  # kernels (gradient option) are built on first use


def test_particle_capacity_of_all_particles_runs_on_one_device():
    sim = torchpm.Simulation(n_particles=4, box_size=40.0, a_start=0.1, steps=1, particle_capacity=64)
    assert sim(sim.white_noise(seed=1)).positions.shape == (1, 64, 3)


def test_one_device_forces_honour_empty_slots_and_evolve_refuses_them():
    sim = torchpm.Simulation(n_particles=4, box_size=40.0, a_start=0.1, steps=2, dtype=torch.float64)
    x, p, ids = sim.lpt(sim.linear_field(sim.white_noise(seed=1)))
    a = torch.tensor(0.1, dtype=torch.float64)
    padded = torch.cat([x, x[:, :5]], dim=1)
    padded_ids = torch.cat([ids, torch.full((1, 5), -1, dtype=ids.dtype)], dim=1)
    # the empty slots get no mass: the particles' forces are those without them
    assert torch.equal(sim.forces(padded, a, padded_ids)[:, : x.shape[1]], sim.forces(x, a, ids))
    with pytest.raises(ValueError, match=r"evolve: `ids` holds empty slots \(id -1\)"):
        sim.evolve(padded, torch.cat([p, p[:, :5]], dim=1), sim.growth_table(), ids=padded_ids)
    with pytest.raises(ValueError, match="`which` must be 'particle' or 'force'"):
        sim.kernels("bogus")


def test_public_forces_and_evolve_name_bad_particle_arrays():
    sim = torchpm.Simulation(n_particles=4, box_size=40.0, a_start=0.1, steps=2, dtype=torch.float64)
    x, p, ids = sim.lpt(sim.linear_field(sim.white_noise(seed=1)))
    a, table = torch.tensor(0.1, dtype=torch.float64), sim.growth_table()
    cases = [
        (lambda: sim.forces(x.float(), a), r"forces: `positions` must be a \(B, n, 3\) torch.float64 tensor .* got "
                                           r"\(1, 64, 3\) torch.float32 on cpu \(use .to\(sim.dtype\)"),
        (lambda: sim.forces(x[..., :2], a), r"forces: `positions` must be .* got \(1, 64, 2\)"),
        (lambda: sim.forces(x.numpy(), a), r"forces: `positions` must be .* got ndarray"),
        (lambda: sim.forces(x, a, ids.int()), r"forces: `ids` must be a \(B, n\) = \(1, 64\) int64 tensor, got .*int32"),
        (lambda: sim.evolve(x, p.float(), table), r"evolve: `momenta` must be .* torch.float32"),
        (lambda: sim.evolve(x, p[:, :10], table), r"evolve: `momenta` must have the shape of `positions` \(1, 64, 3\)"),
        (lambda: sim.evolve(x, p, table, ids=ids[:, :10]), r"evolve: `ids` must be a \(B, n\) = \(1, 64\)"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_bad_noise_raises():
    sim = _tiny()
    noise = torch.zeros(1, 4, 4, 4, dtype=torch.float64)
    noise[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="white_noise.*NaN"):
        sim(noise)
    with pytest.raises(ValueError, match="white_noise.*shape"):
        sim(torch.zeros(1, 4, 4, 5))
    with pytest.raises(ValueError, match="exactly one"):
        sim()
    with pytest.raises(ValueError, match="linear_field.*NaN"):
        sim(linear_field=noise)


def _graph_inputs(sim):
    from torchpm.pm import step_factors

    table = sim.growth_table()
    factors = step_factors(table, torch.tensor(sim.scale_factors, dtype=torch.float64))
    positions, momenta, ids = sim.lpt(sim.linear_field(sim.white_noise(seed=4)), table)
    forces = sim.forces(positions, factors[0].a_start, ids)
    return (positions, momenta, forces, ids), factors[0]


@pytest.mark.parametrize("device", [p for p in DEVICES if not isinstance(p, str)], indirect=True)
@pytest.mark.parametrize("method", ["scatter", "tiled"])
def test_cuda_graph_capture_of_a_simulation_step(device, method):
    # A whole kick-drift-kick step (paint, FFTs, 4-point gradient, readout,
    # updates) replays from a CUDA graph: nothing in it synchronises with the
    # host. With either CUDA paint (atomics: equal to float32 rounding).
    previous = torchpm.ops.set_paint_method(method)
    try:
        sim = torchpm.Simulation(n_particles=32, box_size=64.0, mesh_factor=1, a_start=0.1, steps=2).to(device)
        state, factor = _graph_inputs(sim)
        expected = sim._step(*state, factor)
        static = [t.clone() for t in state]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up (FFT plans, allocator), as torch.cuda.graph asks
            for _ in range(3):
                sim._step(*static, factor)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sim._step(*static, factor)
        graph.replay()
        torch.cuda.synchronize(device)
    finally:
        torchpm.ops.set_paint_method(previous)
    for got, want in zip(out[:3], expected[:3]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[3], expected[3])
    torchpm.check()


def test_double_and_float_convert_the_simulation_like_any_module():
    """.double() / .float() / .to(dtype) change the precision the simulation runs in (it
    was silently kept), and give the runs of a Simulation built with that dtype, bit for
    bit; a dtype torchpm cannot run in is named at the next use."""
    built = _tiny(n_particles=4, box_size=40.0, mesh_factor=2, steps=2, dtype=torch.float64)
    converted = _tiny(n_particles=4, box_size=40.0, mesh_factor=2, steps=2, dtype=torch.float32).double()
    assert converted.dtype == torch.float64
    noise = built.white_noise(seed=4)
    expected, state = built(noise), converted(noise)
    assert state.positions.dtype == torch.float64
    assert torch.equal(state.positions, expected.positions) and torch.equal(state.momenta, expected.momenta)
    assert converted.float().dtype == torch.float32 and converted(noise).positions.dtype == torch.float32
    assert converted.to(torch.float64).dtype == torch.float64
    converted.half()
    assert "float16" in repr(converted)
    with pytest.raises(ValueError, match=r"float32 or float64.*float16.*\.float\(\) or \.double\(\)"):
        converted(noise)


def test_a_mesh_units_state_is_read_in_its_units(tmp_path):
    """What ``return_mesh_units=True`` returns is a MeshUnitsState, and density, resume,
    gather and write_snapshot read it in cells (density took its positions for Mpc/h and
    left 96% of the cells empty; write_snapshot without mesh_units=True wrote cells as
    Mpc/h), giving what the Mpc/h state gives."""
    from torchpm.io import read_snapshot, restart_state, write_snapshot

    sim = _tiny(n_particles=6, box_size=60.0, mesh_factor=2, steps=[0.5, 1.0])
    noise = sim.white_noise(seed=3)
    cells, physical = sim(noise, return_mesh_units=True), sim(noise)
    assert isinstance(cells, torchpm.MeshUnitsState) and not isinstance(physical, torchpm.MeshUnitsState)
    assert sim.cell_size != (1.0, 1.0, 1.0)
    torch.testing.assert_close(sim.density(cells), sim.density(physical), rtol=1e-12, atol=1e-12)
    middle = sim(noise, until=0.5, return_mesh_units=True)
    assert torch.equal(sim.resume(middle).positions, sim.resume(middle, mesh_units=True).positions)
    assert isinstance(sim.gather(middle), torchpm.MeshUnitsState)
    write_snapshot(str(tmp_path / "typed.hdf5"), middle, sim)
    write_snapshot(str(tmp_path / "flagged.hdf5"), middle, sim, mesh_units=True)
    typed, flagged = read_snapshot(str(tmp_path / "typed.hdf5")), read_snapshot(str(tmp_path / "flagged.hdf5"))
    assert torch.equal(typed.positions, flagged.positions) and torch.equal(typed.mesh_positions, flagged.mesh_positions)
    restored = restart_state(typed, sim)
    assert isinstance(restored, torchpm.MeshUnitsState)
    assert torch.equal(sim.resume(restored).positions, sim(noise).positions)


@pytest.mark.parametrize("name", ["positions", "momenta"])
def test_resume_refuses_non_finite_particles_without_steps_too(name):
    sim = _tiny()
    with torch.no_grad():
        state = sim(sim.white_noise(seed=3), until=sim.scale_factors[1], return_mesh_units=True)
    values = dict(positions=state.positions.clone(), momenta=state.momenta.clone())
    values[name][0, 5, 1] = float("nan")
    bad = torchpm.MeshUnitsState(values["positions"], values["momenta"], state.a, state.ids)
    for until in (state.a, None):  # no step to run, and the rest of the run
        with pytest.raises(ValueError, match=f"resume: the state's {name} are not finite"):
            sim.resume(bad, until=until)
    assert torch.isfinite(sim.resume(state, until=state.a).momenta).all()


def test_resume_and_forward_name_bad_run_arguments():
    """A state without a scale factor is refused (None meant the last step: the state came
    back relabelled a = 1 with no step run), and so are truthy non-bool unit flags (a
    state in Mpc/h read as cells), a callback that cannot be called (found before the
    initial conditions), a string scale factor and particle arrays of other shapes."""
    sim = _tiny()
    noise = sim.white_noise(seed=3)
    with torch.no_grad():
        state = sim(noise, until=sim.scale_factors[1])
    physical = torchpm.SimulationState
    cases = [
        (lambda: sim.resume(physical(state.positions, state.momenta, None, state.ids)), "`state.a` must be"),
        (lambda: sim.trajectory(state=physical(state.positions, state.momenta, None, state.ids), at=[1.0]),
         "`state.a` must be"),
        (lambda: sim.resume(state, mesh_units="false"), "`mesh_units` must be True or False, got 'false'"),
        (lambda: sim.resume(state, return_mesh_units=1), "`return_mesh_units` must be True or False"),
        (lambda: sim(noise, return_mesh_units="yes"), "`return_mesh_units` must be True or False"),
        (lambda: sim(noise, callback=3), "`callback` must be callable or None, got int"),
        (lambda: sim.resume(state, callback="bar"), "`callback` must be callable"),
        (lambda: sim(noise, until="1"), "`until` must be a scale factor (a number), got '1'"),
        (lambda: sim.resume(state, until=True), "`until` must be a scale factor"),
        (lambda: sim.resume(state, until=np.True_), "`until` must be a scale factor"),
        (lambda: sim(noise, until=torch.tensor(True)), "`until` must be a scale factor"),
        (lambda: sim.resume(physical(state.positions[..., :2], state.momenta[..., :2], state.a, state.ids)),
         r"`state.positions` must be a floating-point tensor of shape \(B, N, 3\), got \(1, 64, 2\)"),
        (lambda: sim.resume(physical(state.positions, state.momenta[:, :10], state.a, state.ids)),
         "`state.momenta` must have the shape of `state.positions`"),
        (lambda: sim.resume(physical(state.positions, state.momenta, state.a, state.ids.double())),
         "`state.ids` must be None or an integer tensor"),
    ]
    for call, message in cases:
        pattern = message if message.startswith("`state.positions`") else re.escape(message)
        with pytest.raises(ValueError, match=pattern):
            call()
    # the checks pass what they should: a 0-d tensor scale factor, numpy floats and 0-d
    # arrays (np.load of a saved scalar), an integer tensor, ids None
    reference = sim.resume(state).positions
    # evolve's step numbers: ints, numpy and integer tensors; not booleans nor out of range
    mesh_state = sim(noise, until=sim.scale_factors[0], return_mesh_units=True)
    table = sim.growth_table()
    stepped = sim.evolve(mesh_state.positions, mesh_state.momenta, table, start=torch.tensor(0), stop=np.int64(1))
    assert torch.equal(stepped[0], sim.evolve(mesh_state.positions, mesh_state.momenta, table, stop=1)[0])
    for start, stop, message in ((True, 1, "`start`"), (0, torch.tensor(3), "`stop` must be a step number from 0 to 2"),
                                 (2, 1, "`stop` must be a step number from 2 to 2"), (0.5, 1, "`start`")):
        with pytest.raises(ValueError, match=re.escape(message)):
            sim.evolve(mesh_state.positions, mesh_state.momenta, table, start=start, stop=stop)
    for a, until in ((torch.tensor(state.a, dtype=torch.float64), np.float64(sim.scale_factors[-1])),
                     (np.array(state.a), np.array(1.0)), (state.a, torch.tensor(1)), (state.a, 1)):
        torch.testing.assert_close(sim.resume(physical(state.positions, state.momenta, a, None), until=until).positions,
                                   reference, rtol=0, atol=0)
