"""torch.func's reverse-mode transforms (grad, vjp, jacrev, and grad of grad) through
torchpm's ops and a whole simulation give what torch.autograd gives; the uses a run
cannot honour (vmap over a simulation, adjoint=True, checkpoint=True) raise naming
themselves. Forward mode (jvp) is refused by the ops: tests/test_forward_mode.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from _models import perturbed_spline
from test_forward_mode import CASES, _primal

import torchpm


@pytest.mark.parametrize("case", sorted(CASES))
def test_func_grad_vjp_and_second_derivatives_of_every_op_match_autograd(case):
    _, function, which = CASES[case]
    primal, other = _primal(which)

    def loss(p):
        return (function(p, other) ** 2).sum()  # nonlinear: second derivatives couple the inputs

    leaf = primal.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    torch.testing.assert_close(torch.func.grad(loss)(primal), expected.detach(), rtol=1e-13, atol=1e-13)

    output, pull_back = torch.func.vjp(lambda p: function(p, other), primal)
    cotangent = torch.randn(output.shape, generator=torch.Generator().manual_seed(1), dtype=output.dtype)
    leaf_output = function(leaf, other)
    (expected_vjp,) = torch.autograd.grad(leaf_output, leaf, cotangent)
    torch.testing.assert_close(pull_back(cotangent)[0], expected_vjp, rtol=1e-13, atol=1e-13)

    # A Hessian-vector product by grad of grad against autograd's double backward.
    direction = torch.randn(primal.shape, generator=torch.Generator().manual_seed(2), dtype=primal.dtype)
    (expected_hvp,) = torch.autograd.grad((expected * direction).sum(), leaf, allow_unused=True)
    if expected_hvp is None:  # linear in the primal: no second derivative
        expected_hvp = torch.zeros_like(primal)
    hvp = torch.func.grad(lambda p: (torch.func.grad(loss)(p) * direction).sum())(primal)
    torch.testing.assert_close(hvp, expected_hvp, rtol=1e-12, atol=1e-12)


def _simulation(**options):
    return torchpm.Simulation(8, 64.0, steps=2, dtype=torch.float64, **options)


def _field(sim, seed):
    return torch.randn(1, *sim.mesh_shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_func_grad_through_a_simulation_matches_autograd_in_every_input():
    # white noise, a cosmological parameter and a force correction's weights (through
    # torch.func.functional_call, as a functional training loop passes them)
    correction = perturbed_spline(conditions=0, seed=4)
    sim = _simulation(force_correction=correction)
    noise = sim.white_noise(seed=3)
    field = _field(sim, 5)
    names = [name for name, _ in sim.named_parameters()]
    assert names, "the force correction's weights are parameters of the simulation"

    def loss(noise, omega_c, parameters):
        sim.cosmology = torchpm.Planck15(Omega_c=omega_c)
        try:
            state = torch.func.functional_call(sim, parameters, (noise,))
            return (sim.density(state) * field).sum() + (sim.density(state) ** 2).sum() * 1e-3
        finally:
            sim.cosmology = torchpm.Planck15()

    omega_c = torch.tensor(0.2589, dtype=torch.float64)
    parameters = {name: p.detach() for name, p in sim.named_parameters()}
    got = torch.func.grad(loss, argnums=(0, 1, 2))(noise, omega_c, parameters)

    leaves = (noise.clone().requires_grad_(), omega_c.clone().requires_grad_(),
              {n: p.clone().requires_grad_() for n, p in parameters.items()})
    expected = torch.autograd.grad(loss(*leaves), [leaves[0], leaves[1], *leaves[2].values()])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-12, atol=0)
    assert float(got[1].abs()) > 0
    for name, value in zip(leaves[2], expected[2:]):
        torch.testing.assert_close(got[2][name], value, rtol=1e-12, atol=1e-14)
    assert any(float(got[2][name].abs().max()) > 0 for name in names)


def test_grad_of_grad_through_a_simulation_matches_autograd_and_finite_differences():
    sim = _simulation()
    noise = sim.white_noise(seed=6)
    direction = torch.randn(noise.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def loss(n):
        return (sim.density(sim(n)) ** 2).sum()

    def gradient_norm(n):
        return (torch.func.grad(loss)(n) ** 2).sum()

    got = (torch.func.grad(gradient_norm)(noise) * direction).sum()
    leaf = noise.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    (expected,) = torch.autograd.grad((gradient**2).sum(), leaf)
    expected = (expected * direction).sum()

    def plain_gradient_norm(n):
        leaf = n.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss(leaf), leaf)
        return float((g**2).sum())

    eps = 1e-5
    difference = (plain_gradient_norm(noise + eps * direction) - plain_gradient_norm(noise - eps * direction)) / (2 * eps)
    assert abs(difference) > 1.0
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
    assert abs(float(got) - difference) <= 1e-6 * abs(difference), (float(got), difference)


def test_jacrev_through_a_simulation_matches_autograd_jacobian():
    sim = _simulation()
    noise = sim.white_noise(seed=8)

    def profile(n):
        return sim.density(sim(n)).sum(dim=(-2, -1)).flatten()  # the density summed over y, z: 8 values

    got = torch.func.jacrev(profile)(noise)
    expected = torch.autograd.functional.jacobian(profile, noise)
    assert got.shape == (8, *noise.shape)
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-13)


def _wrapped_tensors(sim):
    found = []
    for value in [*sim._constant_cache.values(), *sim._kernels.values()]:
        for tensor in [v for v in vars(value).values()] if not isinstance(value, torch.Tensor) else [value]:
            for t in tensor if isinstance(tensor, (tuple, list)) else [tensor]:
                if isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
                    found.append(t)
    return found


def test_tables_cached_under_a_transform_are_plain_tensors():
    # Inside a transform every tensor an op makes is wrapped for its level; a cached
    # wrapper used under a later transform failed inside torch ("escaped?").
    sim = _simulation()
    noise = sim.white_noise(seed=9)

    def loss(n):
        return (sim.density(sim(n)) ** 2).sum()

    torch.func.grad(lambda n: (torch.func.grad(loss)(n) ** 2).sum())(noise)
    assert sim._constant_cache and sim._kernels
    assert not _wrapped_tensors(sim)
    jacobian = torch.func.jacrev(lambda n: sim.density(sim(n)).sum(dim=(-3, -2, -1)))(noise)
    assert jacobian.shape == (1, *noise.shape)


def test_transforms_a_run_cannot_honour_raise_naming_them():
    sim = _simulation()
    noise = sim.white_noise(seed=10)
    with pytest.raises(NotImplementedError, match="torch.func.vmap over a simulation"):
        torch.func.vmap(lambda n: sim(n.unsqueeze(0)).positions)(noise.expand(2, *noise.shape[1:]).clone())
    for option in ("adjoint", "checkpoint"):
        other = _simulation(**{option: True})
        with pytest.raises(NotImplementedError, match=f"{option}=True"):
            torch.func.grad(lambda n: other(n).positions.sum())(noise)
        # without a transform the option works as before
        leaf = noise.clone().requires_grad_()
        other(leaf).positions.sum().backward()
        assert leaf.grad is not None and float(leaf.grad.abs().max()) > 0


def test_func_grad_through_the_layers_matches_autograd():
    from torchpm.nn import CICPaint, CICReadout, PowerSpectrum

    shape = (8, 8, 8)
    generator = torch.Generator().manual_seed(11)
    positions = torch.rand(1, 40, 3, generator=generator, dtype=torch.float64) * 8
    field = torch.randn(1, *shape, generator=generator, dtype=torch.float64)
    paint, readout, power = CICPaint(shape), CICReadout(), PowerSpectrum(shape, 64.0, dtype=torch.float64)

    def loss(x):
        density = paint(x)
        return power(density - 1.0).sum() + (readout(field, x) ** 2).sum()

    leaf = positions.clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(leaf), leaf)
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(torch.func.grad(loss)(positions), expected, rtol=1e-13, atol=1e-13)


def test_a_spline_correction_after_grad_of_grad_under_a_plain_grad():
    # NeuralSplineCorrection caches the spline taps of the simulation's |k| mesh; made
    # inside grad of grad they were the inner transform's wrappers, and a later
    # torch.func.grad (one level) failed on them ("escaped?").
    correction = perturbed_spline(conditions=0, seed=4)
    sim = _simulation(force_correction=correction)
    noise = sim.white_noise(seed=12)
    direction = torch.randn(noise.shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64)

    def loss(n):
        return (sim.density(sim(n)) ** 2).sum()

    torch.func.grad(lambda n: (torch.func.grad(loss)(n) * direction).sum())(noise)
    got = torch.func.grad(loss)(noise)
    leaf = noise.clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(leaf), leaf)
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)
    assert not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in correction._taps_cache[2])

def test_vmap_over_the_ops_folds_into_their_batch_and_equals_a_loop():
    # (torchpm/ops/_vmap.py) vmapped and unvmapped inputs, every mass-assignment order, a
    # vmapped dimension not in front, and the finite-difference scale vmapped (one call
    # per row): against calls one row at a time
    from torchpm.ops import fd4_gradient

    generator = torch.Generator().manual_seed(12)
    shape = (6, 5, 4)
    positions = torch.rand(3, 2, 9, 3, generator=generator, dtype=torch.float64) * torch.tensor(shape, dtype=torch.float64)
    weights = torch.rand(3, 2, 9, generator=generator, dtype=torch.float64)
    mesh = torch.randn(2, *shape, generator=generator, dtype=torch.float64)
    meshes = torch.randn(2, 3, *shape, generator=generator, dtype=torch.float64)  # vmapped along dim 1
    for order in ("ngp", "cic", "tsc", "pcs"):
        got = torch.func.vmap(lambda x, w: torchpm.paint(x, w, shape, order=order))(positions, weights)
        expected = torch.stack([torchpm.paint(x, w, shape, order=order) for x, w in zip(positions, weights)])
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)
        got = torch.func.vmap(lambda x: torchpm.readout(mesh, x, order=order))(positions)
        expected = torch.stack([torchpm.readout(mesh, x, order=order) for x in positions])
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)
        got = torch.func.vmap(lambda m, x: torchpm.readout(m, x, order=order), in_dims=(1, 0))(meshes, positions)
        expected = torch.stack([torchpm.readout(meshes[:, v], positions[v], order=order) for v in range(3)])
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)
    scales = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [2.0, 1.0, 1.0]], dtype=torch.float64)
    for in_dims, args in (((None, 0), (mesh, scales)), ((1, None), (meshes, scales[0]))):
        got = torch.func.vmap(lambda f, s: fd4_gradient(f, s), in_dims=in_dims)(*args)
        expected = torch.stack([
            fd4_gradient(args[0] if in_dims[0] is None else args[0].select(in_dims[0], v),
                         args[1] if in_dims[1] is None else args[1][v])
            for v in range(3)
        ])
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)


def test_jacrev_through_a_simulation_uses_the_ops_batching_rules():
    sim = _simulation()
    noise = sim.white_noise(seed=13)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.func.jacrev(lambda n: torch.stack([(sim.density(sim(n)) ** p).sum() for p in (2, 3)]))(noise)
    fallbacks = [str(w.message) for w in caught if "batching rule" in str(w.message)]
    assert not fallbacks, fallbacks


def test_per_sample_gradients_by_vmap_of_grad_equal_a_loop():
    generator = torch.Generator().manual_seed(14)
    shape = (6, 5, 4)
    positions = torch.rand(4, 1, 12, 3, generator=generator, dtype=torch.float64) * torch.tensor(shape, dtype=torch.float64)
    field = torch.randn(1, *shape, generator=generator, dtype=torch.float64)

    def loss(x):
        return (torchpm.paint(x, None, shape, order="tsc") ** 2).sum() + (torchpm.readout(field, x) ** 3).sum()

    got = torch.func.vmap(torch.func.grad(loss))(positions)
    expected = torch.stack([torch.func.grad(loss)(x) for x in positions])
    for x, g in zip(positions, expected):
        leaf = x.clone().requires_grad_()
        torch.testing.assert_close(torch.autograd.grad(loss(leaf), leaf)[0], g, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


def test_a_hessian_by_jacrev_of_jacrev_and_func_hessian_refused_saying_so():
    positions = torch.rand(1, 4, 3, generator=torch.Generator().manual_seed(15), dtype=torch.float64) * 6

    def loss(x):
        return (torchpm.paint(x, None, (6, 6, 6), order="tsc") ** 2).sum()

    expected = torch.autograd.functional.hessian(loss, positions)
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(torch.func.jacrev(torch.func.jacrev(loss))(positions), expected, rtol=1e-13, atol=1e-13)
    with pytest.raises(NotImplementedError, match=r"hessian.*torch\.func\.jacrev\(torch\.func\.jacrev\(f\)\)"):
        torch.func.hessian(loss)(positions)


def test_the_readme_jacrev_example_runs_and_matches_finite_differences():
    import os
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8") as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), flags=re.S)
    (code,) = [block for block in blocks if "torch.func.jacrev(summaries)" in block]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    jacobian, summaries, sim = scope["jacobian"], scope["summaries"], scope["sim"]
    eps = 1e-5
    plus, minus = (summaries(torch.tensor(0.2589 + s * eps, dtype=torch.float64)) for s in (1, -1))
    sim.cosmology = torchpm.Planck15()
    difference = (plus - minus) / (2 * eps)
    assert jacobian.shape == (2,)
    assert float(difference.abs().min()) > 0.1
    torch.testing.assert_close(jacobian, difference, rtol=1e-6, atol=0)


def test_torch_compile_and_func_grad_compose_in_either_order():
    """``torch.compile(torch.func.grad(f))`` and ``torch.func.grad(torch.compile(f))`` through a
    run (the ops' functorch path under Dynamo) give the eager gradient of a loss of the
    redshift-space multipoles."""
    from torchpm.analysis import power_multipoles

    sim = torchpm.Simulation(n_particles=8, box_size=64.0, mesh_factor=1, a_start=0.2, steps=2, dtype=torch.float64)
    noise = sim.white_noise(1, seed=0)

    def loss(x):
        delta = sim.density(sim.redshift_space(sim(x))) - 1.0
        return power_multipoles(delta, 64.0, ells=(0, 2)).power.pow(2).sum()

    x = noise.clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(x), x)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for function in (torch.compile(torch.func.grad(loss)), torch.func.grad(torch.compile(loss))):
            got = function(noise)
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12 * float(expected.abs().max()))
