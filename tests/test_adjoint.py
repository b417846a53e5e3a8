"""The adjoint method (torchpm.adjoint) against plain autograd through the same loop.

The oracle is autograd through the unrolled kick-drift-kick loop (the default
Simulation backward), which test_simulation.py checks against gradcheck and
finite differences.
"""

from __future__ import annotations

import pytest
import torch

import torchpm
from torchpm.adjoint import AutogradForce, ParticleMeshForce, adjoint_integrate
from torchpm.nn import NeuralSplineCorrection, PGDCorrection
from torchpm.pm import kick_drift_kick

from _models import perturbed_spline

STEPS = 10


def _loss(state, seed=11):
    """A fixed random projection of positions and momenta plus a density term."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.randn(state.positions.shape, generator=generator, dtype=torch.float64).to(state.positions)
    v = torch.randn(state.momenta.shape, generator=generator, dtype=torch.float64).to(state.positions)
    return (u * state.positions).sum() + (v * state.momenta).sum()


def _gradients(adjoint, dtype=torch.float64, correction="spline", device="cpu"):
    """Gradients of the loss w.r.t. white noise, Omega_c, sigma8 and the correction's parameters."""
    torch.manual_seed(0)
    if correction == "spline":
        module = NeuralSplineCorrection(k_max=2.0, knots=6, hidden=(8,), dtype=torch.float64)
        with torch.no_grad():  # move off the identity so every parameter has a gradient
            for parameter in module.parameters():
                parameter.add_(0.1 * torch.randn(parameter.shape, dtype=torch.float64))
    else:
        module = PGDCorrection(k_long=0.1, k_short=0.8, alpha=0.2, mu=0.5, dtype=torch.float64)
    module = module.to(device=device, dtype=dtype)
    omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)
    sigma8 = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    sim = torchpm.Simulation(
        8, 64.0, mesh_factor=1, a_start=0.1, steps=STEPS, dtype=dtype, force_correction=module,
        cosmology=torchpm.Planck15(Omega_c=omega_c, sigma8=sigma8), adjoint=adjoint,
    ).to(device)
    noise = sim.white_noise(seed=3).requires_grad_(True)
    state = sim(noise)
    parameters = [noise, omega_c, sigma8, *module.parameters()]
    grads = torch.autograd.grad(_loss(state), parameters)
    return state, grads


def _relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.usefixtures("reproducible")
@pytest.mark.parametrize("correction", ["spline", "pgd"])
def test_adjoint_matches_autograd_float64(correction, device):
    state_plain, plain = _gradients(False, correction=correction, device=device)
    state_adjoint, adjoint = _gradients(True, correction=correction, device=device)
    # the forward pass is the same loop: identical numbers
    assert torch.equal(state_plain.positions, state_adjoint.positions)
    assert torch.equal(state_plain.momenta, state_adjoint.momenta)
    names = ["white noise", "Omega_c", "sigma8"] + [f"correction[{i}]" for i in range(len(plain) - 3)]
    for name, a, b in zip(names, adjoint, plain):
        assert float(b.abs().max()) > 0, f"{name}: the autograd gradient is zero, the comparison would be empty"
        error = _relative(a, b)
        print(f"{correction} {name}: relative difference adjoint vs autograd {error:.2e}")
        assert error < 1e-8, f"{name}: adjoint and autograd gradients differ by {error:.2e} (relative)"


def test_adjoint_float32_agreement():
    """Float32: the reversed trajectory carries float32 rounding; report and bound it loosely."""
    _, plain = _gradients(False, dtype=torch.float32)
    _, adjoint = _gradients(True, dtype=torch.float32)
    _, exact = _gradients(False, dtype=torch.float64)
    names = ["white noise", "Omega_c", "sigma8"] + [f"correction[{i}]" for i in range(len(plain) - 3)]
    for name, a, b, c in zip(names, adjoint, plain, exact):
        error, baseline = _relative(a, b), _relative(b, c)
        print(f"float32 {name}: adjoint vs autograd {error:.2e}; float32 autograd vs float64 {baseline:.2e}")
        # Report-only in the issue. Measured: <= 2e-6 for the white noise, sigma8 and the
        # correction; 3.5e-4 for Omega_c, whose gradient is a sum of large cancelling
        # terms: the reversed float32 drift recovers positions only to one ulp (the
        # forward drift dropped the low bits), and that cancellation amplifies it.
        # Replaying the stored forward trajectory gives 6e-5, autograd's own float32
        # error (RESULTS.md section 5). The bound checks that nothing worse than that
        # inherent error appears, against autograd and against float64.
        assert error < 1e-3
        assert _relative(a, c) < 1e-3


@pytest.mark.parametrize(
    "options",
    [
        dict(mesh_factor=1, gradient="fd4", laplacian="exact"),
        dict(mesh_factor=2, paint_order="tsc", window_compensation=True, gradient="exact", laplacian="fd"),
    ],
    ids=["cic-fd4", "tsc-exact-B2"],
)
@pytest.mark.usefixtures("reproducible")
def test_particle_mesh_force_pull_back(options, device):
    """The hand-written pull-back of the PM force equals autograd through compute_forces
    (positions, 1.5 Omega_m, the correction's parameters and a), with empty slots of
    zero mass; its evaluation gives the plain forces bit for bit."""
    by_hand, plain, x, parameters, _ = _particle_mesh_force(device, **options)
    a = torch.tensor(0.5, dtype=torch.float64, device=device)
    value, saved = by_hand.evaluate(x, a)
    with torch.no_grad():
        assert torch.equal(value, plain(x, a))
    reference_value, reference_saved = AutogradForce(plain).evaluate(x, a)
    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(device)
    grad_x, grad_a, grads = by_hand.pull_back(saved, cotangent, parameters)
    ref_x, ref_a, ref_grads = AutogradForce(plain).pull_back(reference_saved, cotangent, parameters)
    assert _relative(grad_x, ref_x) < 1e-12
    assert abs(float(grad_a - ref_a)) <= 1e-12 * abs(float(ref_a)) and float(ref_a) != 0
    for grad, ref in zip(grads, ref_grads):
        assert float(ref.abs().max()) > 0
        assert _relative(grad, ref) < 1e-12


class _SortByX:
    """A ``migrate`` hook that reorders particles by their x coordinate (a stand-in for
    re-homing particles by position), with the ``restore`` hook that undoes it."""

    def migrate(self, positions, *payload):
        order = torch.sort(positions[..., 0].detach(), dim=1, stable=True).indices
        index = order.unsqueeze(-1).expand_as(positions)
        return (positions.gather(1, index), *(tensor.gather(1, index) for tensor in payload))

    def restore(self, initial_positions, adjoint_x, adjoint_p):
        # The reconstructed initial positions, in the final order, are matched to the
        # original ones by value (they agree to rounding, and no two coincide here).
        distance = torch.cdist(self.original[0], initial_positions[0])
        where = distance.argmin(dim=1)
        return adjoint_x[:, where], adjoint_p[:, where]


def test_migrate_hook_contract():
    """With a reordering `migrate`, the adjoint gradient equals autograd through the same loop."""
    sim = torchpm.Simulation(4, 40.0, mesh_factor=2, a_start=0.2, steps=4, dtype=torch.float64)
    noise = sim.white_noise(seed=1)
    with torch.no_grad():
        x0, p0, _ = sim.lpt(sim.linear_field(noise))
    factors = torchpm.pm.step_factors(
        sim.growth_table(), torch.tensor(sim.scale_factors, dtype=torch.float64), sim.integrator
    )
    hook = _SortByX()
    hook.original = x0
    generator = torch.Generator().manual_seed(5)
    u, v = torch.randn(x0.shape, generator=generator, dtype=torch.float64), torch.randn(x0.shape, generator=generator, dtype=torch.float64)

    def reference(x, p):
        forces = sim.forces(x, factors[0].a_start)
        for factor in factors:
            x, p, forces = torchpm.adjoint._migrating_step(hook.migrate)(x, p, forces, factor, sim.forces)
        return x, p

    xs = [x0.clone().requires_grad_(True) for _ in range(2)]
    ps = [p0.clone().requires_grad_(True) for _ in range(2)]
    x_ref, p_ref = reference(xs[0], ps[0])
    x_adj, p_adj, _ = adjoint_integrate(xs[1], ps[1], factors, sim.forces, migrate=hook.migrate, restore=hook.restore)
    assert torch.equal(x_ref, x_adj)
    # the final state really is reordered: the hook is not a no-op
    assert not torch.equal(x_ref, xs[0].detach() + 0 * x_ref)
    grad_ref = torch.autograd.grad((u * x_ref).sum() + (v * p_ref).sum(), [xs[0], ps[0]])
    grad_adj = torch.autograd.grad((u * x_adj).sum() + (v * p_adj).sum(), [xs[1], ps[1]])
    for a, b in zip(grad_adj, grad_ref):
        assert _relative(a, b) < 1e-10


def test_plain_loop_helpers_agree():
    """adjoint_integrate without hooks equals looping pm.kick_drift_kick, bit for bit."""
    sim = torchpm.Simulation(4, 40.0, mesh_factor=1, a_start=0.2, steps=3, dtype=torch.float64)
    x0, p0, _ = sim.lpt(sim.linear_field(sim.white_noise(seed=2)))
    factors = torchpm.pm.step_factors(sim.growth_table(), torch.tensor(sim.scale_factors, dtype=torch.float64))
    x, p, forces = x0, p0, sim.forces(x0, factors[0].a_start)
    for factor in factors:
        x, p, forces = kick_drift_kick(x, p, forces, factor, sim.forces)
    ax, ap, af = adjoint_integrate(x0, p0, factors, sim.forces)
    assert torch.equal(x, ax) and torch.equal(p, ap) and torch.equal(forces, af)


def test_bad_inputs():
    sim = torchpm.Simulation(4, 40.0, mesh_factor=1, a_start=0.2, steps=2, dtype=torch.float64)
    x0, p0, _ = sim.lpt(sim.linear_field(sim.white_noise(seed=2)))
    factors = torchpm.pm.step_factors(sim.growth_table(), torch.tensor(sim.scale_factors, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least one step"):
        adjoint_integrate(x0, p0, [], sim.forces)
    with pytest.raises(ValueError, match="momenta"):
        adjoint_integrate(x0, p0[0], factors, sim.forces)
    with pytest.raises(TypeError, match=r"parameters\[0\]"):
        adjoint_integrate(x0, p0, factors, sim.forces, parameters=[1.0])
    with pytest.raises(ValueError, match="restore"):
        adjoint_integrate(x0, p0, factors, sim.forces, restore=lambda *a: a[1:])
    with pytest.raises(ValueError, match="restore"):
        adjoint_integrate(x0, p0, factors, sim.forces, migrate=lambda *a: a)
    # A plain callable closing over a tensor that needs grad would lose its gradient: refused.
    weight = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    sim = torchpm.Simulation(
        4, 40.0, mesh_factor=1, a_start=0.2, steps=2, dtype=torch.float64, adjoint=True,
        force_correction=lambda k, a: 1 + weight * k,
    )
    with pytest.raises(ValueError, match="nn.Module"):
        sim(sim.white_noise(seed=0).requires_grad_(True))
    # ... and so would a module's tensor that is neither a parameter nor a buffer
    class Unregistered(torch.nn.Module):
        def forward(self, k, a):
            return 1 + weight * k

    sim.force_correction = Unregistered()
    with pytest.raises(ValueError, match="unregistered"):
        sim(sim.white_noise(seed=0).requires_grad_(True))
    with pytest.raises(ValueError, match="`sources` must hold one tensor per parameter"):
        adjoint_integrate(x0, p0, factors, sim.forces, parameters=[weight], sources=[weight, weight])


class _CosmologyScaled(torch.nn.Module):
    """A correction that reads the cosmology it was given (a plain attribute)."""

    def __init__(self, cosmology):
        super().__init__()
        self.cosmology = cosmology
        self.alpha = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))

    def forward(self, k, a):
        return 1.0 + self.alpha * self.cosmology.Omega_m.to(k.dtype) * torch.exp(-k**2)


@pytest.mark.usefixtures("reproducible")
def test_adjoint_with_a_correction_reading_the_cosmology():
    """The adjoint differentiates by the cosmology's parameters: a correction reading them
    is accepted (not taken for a closure) and its gradient counted."""
    results = []
    for adjoint in (False, True):
        omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
        cosmology = torchpm.Planck15(Omega_c=omega_c)
        correction = _CosmologyScaled(cosmology)
        sim = torchpm.Simulation(8, 64.0, mesh_factor=1, a_start=0.1, steps=STEPS, dtype=torch.float64,
                                 cosmology=cosmology, force_correction=correction, adjoint=adjoint)
        results.append(torch.autograd.grad(_loss(sim(sim.white_noise(seed=1))), [omega_c, correction.alpha]))
    for name, a, b in zip(("Omega_c", "alpha"), results[1], results[0]):
        assert float(b.abs()) > 0 and _relative(a, b) < 1e-8, f"{name}: adjoint {float(a)} vs autograd {float(b)}"


def test_adjoint_evolve_with_an_explicit_cosmology():
    """evolve(..., cosmology=c) under the adjoint differentiates by c's parameters (it took
    the simulation's own and dropped the gradient through 1.5 Omega_m)."""
    results = []
    for adjoint in (False, True):
        sim = torchpm.Simulation(8, 64.0, mesh_factor=1, a_start=0.1, steps=STEPS, dtype=torch.float64,
                                 adjoint=adjoint)
        omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
        cosmology = torchpm.Planck15(Omega_c=omega_c)
        table = sim.growth_table(cosmology)
        x, p, ids = sim.lpt(sim.linear_field(sim.white_noise(seed=1), cosmology), table)
        x, p, _ = sim.evolve(x, p, table, ids=ids, cosmology=cosmology)
        (grad,) = torch.autograd.grad((x**2).sum() + (p**2).sum(), [omega_c])
        results.append(grad)
    assert float(results[0].abs()) > 0 and _relative(results[1], results[0]) < 1e-8, [float(r) for r in results]


@pytest.mark.usefixtures("reproducible")
def test_adjoint_with_conditions_computed_from_other_tensors():
    """A correction conditioned on tensors with a history (the cosmology's Omega_m, a
    tensor of the user's times 2): the adjoint's gradients equal autograd's, each path
    counted once (its pull-back reads detached copies of the conditions at every step;
    walking their history at each step failed at the second, and through the cosmology's
    parameters counted it twice)."""
    results = []
    for adjoint in (False, True):
        module = perturbed_spline(conditions=2, seed=0)
        omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)
        other = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        cosmology = torchpm.Planck15(Omega_c=omega_c)
        module.set_conditions(torch.stack([cosmology.Omega_m, other * 2]))
        sim = torchpm.Simulation(8, 64.0, mesh_factor=1, a_start=0.1, steps=STEPS, dtype=torch.float64,
                                 force_correction=module, cosmology=cosmology, adjoint=adjoint)
        state = sim(sim.white_noise(seed=3))
        results.append(torch.autograd.grad(_loss(state), [omega_c, other, module.network[0].weight]))
    for name, a, b in zip(("Omega_c", "the user's tensor", "a network weight"), results[1], results[0]):
        assert float(b.abs().max()) > 0, f"{name}: zero autograd gradient"
        assert _relative(a, b) < 1e-8, f"{name}: adjoint vs autograd {_relative(a, b):.2e}"


# ---------------------------------------------------------------- fused evaluation and pull-back


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weighted", [False, True], ids=["unit", "weighted"])
@pytest.mark.parametrize("count", [700, 40_000], ids=["serial", "binned"])
def test_four_channel_paint_channel_zero_is_the_density(dtype, weighted, count):
    """Channel 0 of paint(x, [w, c]) is paint(x, w) bit for bit, for unit (None) and
    explicit weights, both paint paths (below and above the binning threshold) and
    every order: ParticleMeshForce.evaluate_and_pull paints density and cotangent
    together and relies on it for forces identical to the forward pass's. CPU only:
    the CUDA paint accumulates with atomics in no fixed order, not even run to run."""
    generator = torch.Generator().manual_seed(7)
    positions = (torch.rand(2, count, 3, generator=generator, dtype=torch.float64) * 12.0 - 2.0).to(dtype)
    cotangent = torch.randn(2, count, 3, generator=generator, dtype=torch.float64).to(dtype)
    weights = None
    if weighted:
        weights = torch.rand(2, count, generator=generator, dtype=torch.float64).to(dtype)
        weights[:, ::5] = 0.0
    mesh = torchpm.LocalMesh((10, 8, 9))
    for order in ("ngp", "cic", "tsc", "pcs"):
        density = mesh.paint(positions, weights, order=order)
        unit = torch.ones(positions.shape[:2], dtype=dtype) if weights is None else weights
        together = mesh.paint(positions, torch.cat([unit.unsqueeze(-1), cotangent], dim=-1), order=order)
        assert together.shape == (2, 4, 10, 8, 9)
        assert torch.equal(together[:, 0], density), order
        # the cotangent channels are the 3-channel paint (to rounding: no bitwise need)
        torch.testing.assert_close(together[:, 1:], mesh.paint(positions, cotangent, order=order))


def _particle_mesh_force(device, batch=2, dtype=torch.float64, empty_slots=True, **options):
    """A ParticleMeshForce with a force correction off the identity and Omega_c needing
    grad (``options``: more Simulation arguments, default ``mesh_factor=2``, CIC);
    returns ``(force, plain force function, positions, parameters, sim)``."""
    options = {"mesh_factor": 2, **options}
    torch.manual_seed(1)
    correction = NeuralSplineCorrection(k_max=2.0, knots=5, hidden=(6,), dtype=torch.float64)
    with torch.no_grad():
        for parameter in correction.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, dtype=torch.float64))
    correction = correction.to(device=device, dtype=dtype)
    omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)
    sim = torchpm.Simulation(
        (4, 4, 6), (40.0, 40.0, 55.0), a_start=0.2, steps=3, dtype=dtype,
        force_correction=correction, cosmology=torchpm.Planck15(Omega_c=omega_c), **options,
    ).to(device)
    with torch.no_grad():
        x, _, _ = sim.lpt(sim.linear_field(sim.white_noise(batch=batch, seed=4)))
    weights = None
    if empty_slots:
        weights = torch.ones(x.shape[:2], dtype=dtype, device=device)
        weights[:, ::7] = 0.0

    def plain(positions, a):
        return torchpm.pm.compute_forces(
            positions, sim.kernels("force"), a=a, particle_mass=sim.particle_mass,
            force_scale=1.5 * sim.cosmology.Omega_m, force_correction=correction, weights=weights,
            order=sim.paint_order,
        )

    force = ParticleMeshForce(
        plain, sim.kernels("force"), particle_mass=sim.particle_mass,
        force_scale=lambda: 1.5 * sim.cosmology.Omega_m, force_correction=correction,
        weights=lambda: weights, order=sim.paint_order,
    )
    return force, plain, x, [omega_c, *correction.parameters()], sim


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("empty_slots", [False, True], ids=["unit", "weighted"])
def test_evaluate_and_pull_forces_are_the_forward_forces(dtype, batch, empty_slots):
    """The forces of the fused evaluation are compute_forces' bit for bit (the reversed
    trajectory undoes the forward kicks with them). CPU: see the paint test above."""
    force, plain, x, parameters, _ = _particle_mesh_force("cpu", batch, dtype, empty_slots=empty_slots)
    a = torch.tensor(0.5, dtype=torch.float64)
    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(dtype)
    forces, _, _, _ = force.evaluate_and_pull(x, a, cotangent, parameters)
    with torch.no_grad():
        assert torch.equal(forces, plain(x, a))
    assert torch.equal(forces, force.evaluate(x, a)[0])


@pytest.mark.parametrize("order", ["cic", "tsc"])
def test_evaluate_and_pull_equals_evaluate_then_pull_back(order, device):
    """evaluate_and_pull = evaluate + pull_back (float64, to rounding), and both equal
    autograd through compute_forces; the ``cotangent_dot_forces`` callable gets the forces
    and its value is used for the 1.5 Omega_m adjoint."""
    force, plain, x, parameters, _ = _particle_mesh_force(device, paint_order=order)
    a = torch.tensor(0.5, dtype=torch.float64, device=device)
    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(device)
    value, saved = force.evaluate(x, a)
    grad_x, grad_a, grads = force.pull_back(saved, cotangent, parameters)
    seen = []

    def dot(forces):
        seen.append(forces)
        return torch.sum(cotangent * forces, dtype=torch.float64)

    forces, fused_x, fused_a, fused_grads = force.evaluate_and_pull(x, a, cotangent, parameters, dot)
    assert len(seen) == 1 and torch.equal(seen[0], forces)
    if device.type == "cpu":
        assert torch.equal(forces, value)
    else:
        assert _relative(forces, value) < 1e-13
    assert _relative(fused_x, grad_x) < 1e-13
    assert abs(float(fused_a - grad_a)) <= 1e-13 * abs(float(grad_a)) and float(grad_a) != 0
    assert len(fused_grads) == len(grads) == len(parameters)
    for fused, separate in zip(fused_grads, grads):
        assert float(separate.abs().max()) > 0
        assert _relative(fused, separate) < 1e-13
    # and against autograd (the oracle of test_particle_mesh_force_pull_back)
    reference_value, reference_saved = AutogradForce(plain).evaluate(x, a)
    ref_x, ref_a, ref_grads = AutogradForce(plain).pull_back(reference_saved, cotangent, parameters)
    assert _relative(fused_x, ref_x) < 1e-12
    assert abs(float(fused_a - ref_a)) <= 1e-12 * abs(float(ref_a))
    for fused, ref in zip(fused_grads, ref_grads):
        assert _relative(fused, ref) < 1e-12
    # Without the callable the dot is taken inside: the same adjoint of 1.5 Omega_m.
    _, _, alone_a, alone_grads = force.evaluate_and_pull(x, a, cotangent, parameters)
    assert abs(float(alone_a - fused_a)) <= 1e-14 * abs(float(fused_a))
    assert _relative(alone_grads[0], fused_grads[0]) < 1e-14


class _TwoMethodForce:
    """A user force object with only ``evaluate`` and ``pull_back`` (no
    ``evaluate_and_pull``): the adjoint loop must take its one-iteration-later path."""

    def __init__(self, inner):
        self._inner = inner

    def __call__(self, positions, a):
        return self._inner(positions, a)

    def evaluate(self, positions, a):
        return self._inner.evaluate(positions, a)

    def pull_back(self, saved, cotangent, parameters, cotangent_dot_forces=None):
        return self._inner.pull_back(saved, cotangent, parameters, cotangent_dot_forces)


@pytest.mark.parametrize("steps", [1, 4])
def test_adjoint_loop_with_fused_and_two_method_forces(steps, device):
    """adjoint_integrate with ParticleMeshForce (fused evaluation and pull-back), with a
    force object having only evaluate / pull_back and with the plain callable
    (AutogradForce) gives autograd's gradients through the same loop, for a loss of the
    final positions, momenta and forces (so the last force has its own adjoint) and
    the step factors and parameters (float64; 1 step: only the first and last pulls)."""
    force, plain, x0, parameters, sim = _particle_mesh_force(device, batch=2)
    p0 = 0.3 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(device)
    scale_factors = torch.linspace(0.2, 0.6, steps + 1, dtype=torch.float64)
    generator = torch.Generator().manual_seed(9)
    u, v, w = (torch.randn(x0.shape, generator=generator, dtype=torch.float64).to(device) for _ in range(3))

    def run(function):
        # fresh leaves per run: the factors carry Omega_c's graph through the growth table
        x = x0.clone().requires_grad_(True)
        p = p0.clone().requires_grad_(True)
        factors = torchpm.pm.step_factors(sim.growth_table(), scale_factors, sim.integrator)
        if function is None:
            forces = plain(x, factors[0].a_start)
            xs, ps = x, p
            for factor in factors:
                xs, ps, forces = kick_drift_kick(xs, ps, forces, factor, plain)
        else:
            xs, ps, forces = adjoint_integrate(x, p, factors, function, parameters)
        loss = (u * xs).sum() + (v * ps).sum() + (w * forces).sum()
        return xs.detach(), torch.autograd.grad(loss, [x, p, *parameters])

    calls = {"evaluate": 0, "pull_back": 0, "evaluate_and_pull": 0}

    def counted(method):
        def wrapper(*args, **kwargs):
            calls[method.__name__] += 1
            return method(*args, **kwargs)
        return wrapper

    for name in calls:
        setattr(force, name, counted(getattr(force, name)))
    final, reference = run(None)
    for function, expected in (
        # fused: the last force is evaluated in the forward pass and pulled back alone;
        # every other is evaluated and pulled back together
        (force, {"evaluate": 1, "pull_back": 1, "evaluate_and_pull": steps}),
        (_TwoMethodForce(force), {"evaluate": steps + 1, "pull_back": steps + 1, "evaluate_and_pull": 0}),
        (plain, {"evaluate": 0, "pull_back": 0, "evaluate_and_pull": 0}),
    ):
        calls.update(dict.fromkeys(calls, 0))
        end, grads = run(function)
        assert calls == expected, type(function).__name__
        if device.type == "cpu":
            assert torch.equal(end, final)
        else:  # the CUDA paint adds with atomics: the same run rounds differently each time
            assert _relative(end, final) < 1e-13
        for grad, ref in zip(grads, reference):
            assert float(ref.abs().max()) > 0
            assert _relative(grad, ref) < 1e-10, type(function).__name__
