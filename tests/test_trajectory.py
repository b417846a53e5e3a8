"""Simulation.trajectory: the states at several scale factors from one run.

Oracles: runs stopped at each scale factor with ``until`` (the states must be the same
bits on the CPU), the sum of the gradients of those separate runs (gradients of a
trajectory), autograd against the adjoint method, and counted force evaluations.
"""

import pytest
import torch
from torch import nn

import torchpm
from torchpm import pm



def _sim(**options):
    settings = dict(n_particles=8, box_size=64.0, mesh_factor=1, a_start=0.1, steps=6, dtype=torch.float64)
    settings.update(options)
    return torchpm.Simulation(**settings)


def _same(a, b):
    assert a.a == b.a
    for name in ("positions", "momenta", "ids"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        assert torch.equal(x, y), f"{name} at a = {a.a}: max difference {float((x - y).abs().max())}"


def _projection(state, seed):
    generator = torch.Generator().manual_seed(seed)
    u = torch.randn(state.positions.shape, generator=generator, dtype=torch.float64).to(state.positions.device)
    v = torch.randn(state.momenta.shape, generator=generator, dtype=torch.float64).to(state.positions.device)
    return (u * torch.sin(state.positions)).sum() + (v * state.momenta).sum()


class _Filter(nn.Module):
    def __init__(self):
        super().__init__()
        self.coefficients = nn.Parameter(torch.tensor([0.3, -0.2], dtype=torch.float64))

    def forward(self, k, a):
        return 1.0 + self.coefficients[0] * k**2 + self.coefficients[1] * a * k


MODES = ["no_grad", "autograd", "checkpoint", "adjoint"]


def _mode_sim(mode, **options):
    return _sim(checkpoint=mode == "checkpoint", adjoint=mode == "adjoint", **options)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("options", [dict(), dict(sort_every=2, dtype=torch.float32), dict(mesh_factor=2, paint_order="tsc")],
                         ids=["f64", "f32-sorted", "tsc-B2"])
def test_states_are_those_of_runs_stopped_there(mode, options):
    sim = _mode_sim(mode, **options)
    noise = sim.white_noise(seed=4)
    if mode != "no_grad":
        noise.requires_grad_(True)
    a = sim.scale_factors
    at = [a[0], a[2], a[3], a[6]]
    context = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
    with context:
        states = sim.trajectory(noise, at=at)
        stopped = [sim(noise, until=x) for x in at]
    assert len(states) == len(at)
    for state, reference in zip(states, stopped):
        _same(state, reference)
    with context:
        mesh_states = sim.trajectory(noise, at=at[1:], return_mesh_units=True)
        for state, x in zip(mesh_states, at[1:]):
            assert isinstance(state, torchpm.MeshUnitsState)
            _same(state, sim(noise, until=x, return_mesh_units=True))


@pytest.mark.parametrize("mode", MODES)
def test_from_a_state_like_resume(mode):
    sim = _mode_sim(mode)
    with torch.no_grad():
        start = sim(sim.white_noise(seed=5), until=sim.scale_factors[2], return_mesh_units=True)
    a = sim.scale_factors
    states = sim.trajectory(state=start, at=[a[2], a[4], a[5]], return_mesh_units=True)
    _same(states[0], sim.resume(start, until=a[2], return_mesh_units=True))
    for state, x in zip(states[1:], [a[4], a[5]]):
        _same(state, sim.resume(start, until=x, return_mesh_units=True))
    physical = sim.to_physical(start.positions, start.momenta, start.a, start.ids)
    _same(sim.trajectory(state=physical, at=[a[6]])[0], sim.resume(physical))


def test_observe_keeps_what_it_returns_and_sees_every_state_in_order():
    sim = _sim()
    noise = sim.white_noise(seed=6)
    seen = []

    def observe(state):
        seen.append(state.a)
        return state.positions.mean()

    a = sim.scale_factors
    with torch.no_grad():
        means = sim.trajectory(noise, at=[a[1], a[4], a[6]], observe=observe)
        expected = [sim(noise, until=x).positions.mean() for x in (a[1], a[4], a[6])]
    assert seen == [a[1], a[4], a[6]]
    import numpy as np

    with torch.no_grad():  # a tensor or an array of scale factors too
        for at in (torch.tensor([a[1], a[4]], dtype=torch.float64), np.array([a[1], a[4]])):
            assert [s.a for s in sim.trajectory(noise, at=at)] == [a[1], a[4]]
    assert [float(m) for m in means] == [float(m) for m in expected]


def test_callback_sees_every_step_once():
    sim = _sim()
    calls = []
    with torch.no_grad():
        sim.trajectory(sim.white_noise(seed=1), at=sim.scale_factors[2:5], callback=lambda n, a: calls.append(n))
    assert calls == [0, 1, 2, 3, 4]


def _count_forces(sim, monkeypatch):
    """Counts the force evaluations and pull-backs: the simulation's ``_force`` (every
    path outside the adjoint's own), and the adjoint force's ``evaluate``,
    ``evaluate_and_pull`` (one each) and ``pull_back`` (one: a pull-back costs about
    what an evaluation does)."""
    from torchpm.adjoint import ParticleMeshForce

    calls = []

    def counted(original):
        def wrapper(*args, **kwargs):
            calls.append(original.__name__)
            return original(*args, **kwargs)
        return wrapper

    sim._force = counted(sim._force)
    for name in ("evaluate", "evaluate_and_pull", "pull_back"):
        monkeypatch.setattr(ParticleMeshForce, name, counted(getattr(ParticleMeshForce, name)))
    return calls


@pytest.mark.parametrize("mode", ["no_grad", "autograd", "adjoint"])
def test_no_force_is_evaluated_twice(mode, monkeypatch):
    sim = _mode_sim(mode)
    noise = sim.white_noise(seed=2)
    if mode != "no_grad":
        noise.requires_grad_(True)
    calls = _count_forces(sim, monkeypatch)
    context = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
    with context:
        sim(noise)
    whole = len(calls)
    calls.clear()
    with context:
        states = sim.trajectory(noise, at=sim.scale_factors[1:])
    assert len(calls) == whole == sim.steps + 1  # one force per step end and the first
    if mode != "no_grad":
        calls.clear()
        sum(_projection(s, i) for i, s in enumerate(states)).backward()
        backward = len(calls)
        loss = _projection(sim(noise), 0)
        calls.clear()
        loss.backward()
        assert backward == len(calls)  # the stretches' backward passes: as many as one run's


@pytest.mark.parametrize("mode", ["autograd", "checkpoint", "adjoint"])
def test_gradients_are_the_sum_over_runs_stopped_there(mode):
    """d/d(noise, Omega_c, correction) of sum_k f_k(state at a_k) equals the sum of the
    gradients of f_k through separate runs stopped at a_k (computed with plain autograd)."""
    a_values = None
    results = {}
    for kind in ("trajectory", "separate"):
        correction = _Filter()
        sim = _mode_sim(mode if kind == "trajectory" else "autograd", force_correction=correction)
        a_values = [sim.scale_factors[i] for i in (1, 3, 4, 6)]
        noise = sim.white_noise(seed=9).requires_grad_(True)
        omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)
        sim.cosmology = torchpm.Planck15(Omega_c=omega_c)
        if kind == "trajectory":
            states = sim.trajectory(noise, at=a_values)
            loss = sum(_projection(state, seed) for seed, state in enumerate(states))
            loss.backward()
        else:
            for seed, x in enumerate(a_values):
                _projection(sim(noise, until=x), seed).backward()
        results[kind] = [noise.grad, omega_c.grad, correction.coefficients.grad]
    for name, got, expected in zip(("noise", "Omega_c", "correction"), results["trajectory"], results["separate"]):
        scale = float(expected.abs().max())
        assert scale > 0
        error = float((got - expected).abs().max()) / scale
        assert error < 1e-9, f"{name}: relative error {error:.3g}"


def test_observed_values_carry_gradients_with_the_adjoint_method():
    """Only what observe returns is kept: its gradient (adjoint) equals autograd's."""
    grads = []
    for adjoint in (False, True):
        sim = _sim(adjoint=adjoint)
        noise = sim.white_noise(seed=3).requires_grad_(True)
        values = sim.trajectory(noise, at=sim.scale_factors[2::2], observe=lambda s: (s.positions.sin() ** 2).sum())
        sum(values).backward()
        grads.append(noise.grad)
    assert float((grads[0] - grads[1]).abs().max()) < 1e-9 * float(grads[0].abs().max())


def test_on_device(device, reproducible):
    # (on CUDA bit for bit under deterministic algorithms: the atomic paint sums in a
    # varying order)
    sim = _sim(dtype=torch.float32).to(device)
    noise = sim.white_noise(seed=8).to(device)
    with torch.no_grad():
        states = sim.trajectory(noise, at=sim.scale_factors[3:])
        for state, x in zip(states, sim.scale_factors[3:]):
            _same(state, sim(noise, until=x))


def test_adjoint_integrate_with_given_forces_chains_exactly():
    """Two chained adjoint integrations (the second given the first's last force) equal
    one integration: the same forward values, and the same gradients."""
    sim = _sim()
    with torch.no_grad():
        state = sim(sim.white_noise(seed=11), until=sim.a_start, return_mesh_units=True)
    table = sim.growth_table()
    factors = pm.step_factors(table, torch.tensor(sim.scale_factors, dtype=torch.float64), sim.integrator)
    from torchpm.adjoint import adjoint_integrate

    outputs = []
    for chained in (False, True):
        x0 = state.positions.clone().requires_grad_(True)
        p0 = state.momenta.clone().requires_grad_(True)
        if chained:
            x1, p1, f1 = adjoint_integrate(x0, p0, factors[:2], sim.forces)
            x, p, f = adjoint_integrate(x1, p1, factors[2:], sim.forces, forces=f1)
        else:
            x, p, f = adjoint_integrate(x0, p0, factors, sim.forces)
        loss = _projection(torchpm.MeshUnitsState(x, p, 1.0, None), 1) + (f**2).sum()
        gx, gp = torch.autograd.grad(loss, (x0, p0))
        outputs.append((x.detach(), p.detach(), f.detach(), gx, gp))
    for one, two in zip(*outputs):
        assert float((one - two).abs().max()) <= 1e-12 * max(1.0, float(one.abs().max()))
    with pytest.raises(ValueError, match="`forces` must be None or the forces at the start"):
        adjoint_integrate(state.positions, state.momenta, factors, sim.forces, forces=state.positions[:, :3])


@pytest.mark.parametrize("at, message", [
    ([], "`at` must be a non-empty sequence"),
    ("0.5", "`at` must be a non-empty sequence"),
    ([0.3333], r"`at\[0\]` = 0.3333 is not one of the simulation's scale factors"),
    ([1.0, 0.55], "`at` must be in increasing order without repeats"),
    ([1.0, 1.0], "`at` must be in increasing order without repeats"),
    ([None], r"`at\[0\]` must be a scale factor"),
])
def test_bad_at(at, message):
    sim = _sim()
    with pytest.raises(ValueError, match=message):
        sim.trajectory(sim.white_noise(seed=1), at=at)


def test_bad_arguments():
    sim = _sim()
    noise = sim.white_noise(seed=1)
    with torch.no_grad():
        state = sim(noise, until=sim.scale_factors[3])
    with pytest.raises(ValueError, match=r"`at\[0\]` = .* is before the state's scale factor"):
        sim.trajectory(state=state, at=[sim.scale_factors[2], 1.0])
    with pytest.raises(ValueError, match="pass `white_noise`, `linear_field` or `state`, not several"):
        sim.trajectory(noise, state=state, at=[1.0])
    with pytest.raises(ValueError, match="`observe` must be callable"):
        sim.trajectory(noise, at=[1.0], observe=3)
    with pytest.raises(ValueError, match="pass exactly one of `white_noise` and `linear_field`"):
        sim.trajectory(at=[1.0])
