"""Force kernels on hand cases, momentum conservation, and the FastPM integrator's exactness."""

import math

import pytest
import torch

import torchpm
from torchpm.cosmology import growth_table
from torchpm.mesh import LocalMesh
from torchpm.fourier import FourierKernels, gradient_inverse_laplacian
from torchpm.pm import compute_forces, kick_drift_kick, step_factors


def _wave(shape, axis, n, dtype=torch.float64, device="cpu"):
    """cos(2 pi n j / N) along `axis` on a mesh of `shape`, and the cell coordinate j."""
    j = torch.arange(shape[axis], dtype=dtype, device=device)
    view = [1, 1, 1]
    view[axis] = shape[axis]
    j = j.view(view).expand(*shape)
    return torch.cos(2 * math.pi * n * j / shape[axis]), j


@pytest.mark.parametrize("gradient", ["exact", "fd4"])
@pytest.mark.parametrize("laplacian", ["exact", "fd"])
def test_displacement_of_a_plane_wave(device, gradient, laplacian):
    # Non-cubic cells on purpose: box (40, 40, 120) Mpc/h on an 8 x 8 x 12 mesh.
    shape, box = (8, 8, 12), (40.0, 40.0, 120.0)
    cell = [b / n for b, n in zip(box, shape)]
    mesh = LocalMesh(shape)
    kernels = FourierKernels(mesh, cell, gradient=gradient, laplacian=laplacian, dtype=torch.float64, device=device)
    for axis, n in [(0, 1), (2, 2), (1, 3)]:
        delta, j = _wave(shape, axis, n, device=device)
        psi = gradient_inverse_laplacian(mesh.rfftn(delta)[None], kernels)[0]
        w = 2 * math.pi * n / shape[axis]
        k = w / cell[axis]
        g = w if gradient == "exact" else (8 * math.sin(w) - math.sin(2 * w)) / 6
        k2 = k**2 if laplacian == "exact" else (2 * math.sin(w / 2) / cell[axis]) ** 2
        # -grad grad^-2 cos(k x) = -sin(k x) * (g / c) / k^2, in Mpc/h
        expected = -torch.sin(w * j) * (g / cell[axis]) / k2
        torch.testing.assert_close(psi[axis], expected, atol=1e-12, rtol=0)
        for other in {0, 1, 2} - {axis}:
            assert float(psi[other].abs().max()) < 1e-12


def test_exact_gradient_zeroes_nyquist(device):
    mesh = LocalMesh((8, 8, 8))
    kernels = FourierKernels(mesh, (1.0, 1.0, 1.0), gradient="exact", dtype=torch.float64, device=device)
    delta, _ = _wave((8, 8, 8), 0, 4, device=device)  # the Nyquist mode (+1, -1, +1, ...)
    psi = gradient_inverse_laplacian(mesh.rfftn(delta)[None], kernels)
    assert float(psi.abs().max()) < 1e-12


def test_forces_conserve_momentum_and_scale(device):
    generator = torch.Generator().manual_seed(0)
    positions = (torch.rand(2, 300, 3, generator=generator, dtype=torch.float64) * 8).to(device)
    mesh = LocalMesh(8)
    kernels = FourierKernels(mesh, (4.0,) * 3, dtype=torch.float64, device=device)
    forces = compute_forces(positions, kernels, a=0.5, particle_mass=512 / 300, force_scale=1.0)
    assert forces.shape == (2, 300, 3)
    # paint and readout share the CIC window and the kernel is odd: the total force vanishes.
    assert float(forces.sum(dim=1).abs().max()) < 1e-10 * float(forces.abs().sum())
    # a constant filter scales the force; the filter sees |k| in h/Mpc and a
    seen = {}

    def correction(k, a):
        seen["k_max"], seen["a"] = float(k.max()), float(a)
        return torch.full_like(k, 2.0)

    doubled = compute_forces(positions, kernels, a=0.5, particle_mass=512 / 300, force_scale=1.0, force_correction=correction)
    torch.testing.assert_close(doubled, 2 * forces)
    assert seen["a"] == 0.5
    assert seen["k_max"] == pytest.approx(math.sqrt(3) * math.pi / 4.0)


@pytest.mark.parametrize("scheme", ["fastpm", "leapfrog"])
def test_integrator_in_linear_theory(scheme):
    """With the linear force F = 1.5 Omega_m (x - q), FastPM's factors reproduce the
    Zel'dovich solution x = q + D1(a) psi, p = a^2 E f1 D1 psi exactly, whatever the steps."""
    cosmology = torchpm.Planck15(Omega_k=0.02, w0=-0.95)
    table = growth_table(cosmology)
    generator = torch.Generator().manual_seed(1)
    psi = torch.randn(1, 50, 3, generator=generator, dtype=torch.float64)
    q = torch.rand(1, 50, 3, generator=generator, dtype=torch.float64) * 16
    a = torch.tensor([0.05, 0.07, 0.2, 0.21, 0.6, 1.0], dtype=torch.float64)  # uneven on purpose

    def zeldovich(a_value):
        g = table.at(torch.tensor(a_value, dtype=torch.float64))
        return q + g.D1 * psi, g.a**2 * g.E * g.f1 * g.D1 * psi

    def linear_force(x, a_value):
        return 1.5 * cosmology.Omega_m * (x - q)

    x, p = zeldovich(0.05)
    force = linear_force(x, a[0])
    for factor in step_factors(table, a, scheme):
        x, p, force = kick_drift_kick(x, p, force, factor, linear_force)
    x_exact, p_exact = zeldovich(1.0)
    error = float((x - x_exact).abs().max() / psi.abs().max())
    print(f"{scheme}: relative position error after 5 uneven steps {error:.2e}")
    if scheme == "fastpm":
        assert error < 1e-12
        torch.testing.assert_close(p, p_exact, rtol=1e-12, atol=1e-12)
    else:
        # plain leapfrog is only second order in the step: visibly off with these steps
        assert 1e-4 < error < 0.3


def test_leapfrog_converges_to_linear_solution():
    cosmology = torchpm.Planck15()
    table = growth_table(cosmology)
    q = torch.zeros(1, 1, 3, dtype=torch.float64)
    psi = torch.ones(1, 1, 3, dtype=torch.float64)
    errors = []
    for steps in (20, 40):
        a = torch.linspace(0.1, 1.0, steps + 1, dtype=torch.float64)
        g0 = table.at(a[0])
        x, p = q + g0.D1 * psi, g0.a**2 * g0.E * g0.f1 * g0.D1 * psi
        force_function = lambda x, a_value: 1.5 * cosmology.Omega_m * (x - q)  # noqa: E731
        force = force_function(x, a[0])
        for factor in step_factors(table, a, "leapfrog"):
            x, p, force = kick_drift_kick(x, p, force, factor, force_function)
        errors.append(float((x - (q + psi)).abs().max()))
    # second order: halving the step divides the error by about 4
    assert 3.0 < errors[0] / errors[1] < 5.0, errors


def test_step_factors_bad_scheme():
    with pytest.raises(ValueError, match="integrator"):
        step_factors(growth_table(torchpm.Planck15()), torch.tensor([0.1, 1.0]), "rk4")


def test_forces_trace_into_one_graph_for_every_scale_factor():
    """The force evaluation (with a force correction, which takes ``a``) under
    torch.compile(fullgraph=True) gives eager's numbers, and a new scale factor (a graph
    input) is not a new graph: eager mode reads a CPU ``a`` as a number (no
    host-to-device copy), which while tracing would specialise the graph on its value
    and recompile at every step (1.5 Omega_m goes through the same check)."""
    from torch._dynamo.utils import counters

    correction = torchpm.nn.PGDCorrection(0.1, 0.5, alpha=0.2)
    sim = torchpm.Simulation(8, 64.0, mesh_factor=1, a_start=0.1, steps=3, force_correction=correction)
    positions = torch.rand(1, 512, 3, generator=torch.Generator().manual_seed(3)) * 8
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x, a: sim.forces(x, a), fullgraph=True, backend="aot_eager")
    for value in (0.4, 0.5, 0.6, 0.7):
        a = torch.tensor(value, dtype=torch.float64)
        torch.testing.assert_close(compiled(positions, a), sim.forces(positions, a), rtol=1e-6, atol=1e-7)
    # one graph, and at most one more once the value is seen to change (automatic dynamic)
    assert counters["stats"]["unique_graphs"] <= 2
    # with the ids a hand-written loop passes: still one graph (no host sync on their values)
    ids = torch.arange(512).unsqueeze(0)
    with_ids = torch.compile(lambda x, a: sim.forces(x, a, ids), fullgraph=True, backend="aot_eager")
    a = torch.tensor(0.4, dtype=torch.float64)
    torch.testing.assert_close(with_ids(positions, a), sim.forces(positions, a), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("gradient, mesh_factor", [("fd4", 1), ("fd4", 2), ("exact", 1), ("exact", 2)])
def test_linear_force_of_a_displaced_lattice(gradient, mesh_factor):
    # Linear theory: a particle lattice displaced by Psi = eps sin(k q) x (k the box's
    # fundamental mode) feels F = 1.5 Omega_m Psi (mesh units). The exact (i k) gradient
    # on a finer mesh keeps the coupling of the lattice's Nyquist density to the wave and
    # overshoots; Simulation warns about it.
    import warnings

    from torchpm.ic import grid_positions

    n = 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = torchpm.Simulation(n, 3000.0, mesh_factor=mesh_factor, steps=1, dtype=torch.float64, gradient=gradient)
    warned = [str(w.message) for w in caught if "gradient='exact'" in str(w.message)]
    assert bool(warned) == (gradient == "exact" and mesh_factor > 1), warned
    lattice = grid_positions((n, n, n), mesh_factor, dtype=torch.float64, device="cpu")
    k = 2 * math.pi / (n * mesh_factor)
    displacement = 1e-3 * mesh_factor * torch.sin(k * lattice[:, 0])
    positions = lattice.clone()
    positions[:, 0] += displacement
    force = sim.forces(positions[None], 1.0)[0]
    expected = 1.5 * float(sim.cosmology.Omega_m) * displacement
    ratio = float((force[:, 0] * expected).sum() / (expected * expected).sum())
    if warned:
        assert ratio > 1.1, ratio
    else:
        assert abs(ratio - 1.0) < 0.04, ratio
    assert float(force[:, 1:].abs().max()) < 1e-6 * float(force[:, 0].abs().max())
