"""torch.ops.torchpm._add_scaled (and _add_scaled_, in place) and torchpm.pm.add_scaled
(add_scaled_): x + y * f in one pass with the rounding of torch's mul then add (the oracle:
those two torch ops), bit for bit; the simulation's in-place steps against its steps
without them."""

import pytest
import torch

import torchpm  # noqa: F401  (loads the ops)
from torchpm.pm import add_scaled, add_scaled_


def torch_two_ops(x, y, factor):
    return torch.mul(y, torch.tensor(factor, dtype=torch.float64).to(x.dtype)) + x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bitwise_equal_to_mul_then_add(device, dtype):
    generator = torch.Generator().manual_seed(0)
    # Wide exponents, so a fused multiply-add would round differently somewhere.
    x = (torch.randn(3, 70001, 3, generator=generator, dtype=torch.float64)
         * 10.0 ** torch.randint(-30, 30, (3, 70001, 3), generator=generator)).to(dtype).to(device)
    y = (torch.randn(3, 70001, 3, generator=generator, dtype=torch.float64)
         * 10.0 ** torch.randint(-30, 30, (3, 70001, 3), generator=generator)).to(dtype).to(device)
    x[0, :4, 0] = torch.tensor([float("inf"), float("nan"), 0.0, -0.0], dtype=dtype)
    y[0, :4, 1] = torch.tensor([1e-40, -float("inf"), 5e-324, 3.0], dtype=dtype)
    for factor in (0.1234567891234, -3.0, 1e-30, 0.0):
        expected = torch_two_ops(x, y, factor)
        in_place = x.clone()
        torch.ops.torchpm._add_scaled_(in_place, y, factor)
        for got in (torch.ops.torchpm._add_scaled(x, y, factor), in_place):
            assert torch.equal(got.isnan(), expected.isnan())
            same = got.eq(expected) | got.isnan()
            assert bool(same.all()), f"factor {factor}: {int((~same).sum())} entries differ"


def test_strided_inputs(device):
    base = torch.randn(2, 5, 8, device=device)
    x, y = base[:, :, :3], base[:, :, 4:7]
    expected = torch_two_ops(x, y, 0.5)
    assert torch.equal(torch.ops.torchpm._add_scaled(x, y, 0.5), expected)
    # In place: `y` may be strided; a strided `x` is refused by the op, and the front end
    # writes the result through it.
    contiguous = x.contiguous()
    torch.ops.torchpm._add_scaled_(contiguous, y, 0.5)
    assert torch.equal(contiguous, expected)
    with pytest.raises(ValueError, match="expected `x` contiguous"):
        torch.ops.torchpm._add_scaled_(x, y, 0.5)
    factor = torch.tensor(0.5, dtype=torch.float64)
    untouched = base[:, :, 4:].clone()
    assert add_scaled_(x, y, factor) is x
    assert torch.equal(x, expected) and torch.equal(base[:, :, 4:], untouched)


def test_in_place_front_end_refuses_a_graph_and_aliases_y(device):
    x = torch.randn(1, 100, 3, device=device)
    y = torch.randn(1, 100, 3, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="outside a graph"):
        add_scaled_(x, y, torch.tensor(0.5, dtype=torch.float64))
    with torch.no_grad():
        expected = torch_two_ops(x, x, 0.5)
        add_scaled_(x, x, torch.tensor(0.5, dtype=torch.float64))  # y aliases x: each entry read before written
    assert torch.equal(x, expected)


def test_partial_overlap_of_x_and_y_is_refused(device):
    """y read while x is written: the same elements are fine (each is read before it is
    written), a shifted overlap would read entries already written."""
    base = torch.arange(12, dtype=torch.float64, device=device)
    x, y = base[:10].view(2, 5), base[2:].view(2, 5)
    with pytest.raises(ValueError, match="`y` partially overlaps `x`"):
        torch.ops.torchpm._add_scaled_(x, y, 0.5)
    assert torch.equal(base, torch.arange(12, dtype=torch.float64, device=device))  # untouched
    same = x.view(2, 5)  # another view of x's elements
    expected = torch_two_ops(x, x, 0.5)
    torch.ops.torchpm._add_scaled_(x, same, 0.5)
    assert torch.equal(x, expected)
    # A strided y is copied before x is written: no overlap is left.
    y = base.view(6, 2)[1:, 0].view(1, 5).expand(2, 5)
    expected = torch_two_ops(x, y, -1.0)
    torch.ops.torchpm._add_scaled_(x, y, -1.0)
    assert torch.equal(x, expected)


def test_in_place_writes_bump_the_version_counter(device):
    """As torch's in-place ops do: whatever kept x (autograd, a deferred error check)
    sees that it changed. The op and its front end."""
    x = torch.randn(1, 100, 3, device=device)
    y = torch.randn(1, 100, 3, device=device)
    version = x._version
    torch.ops.torchpm._add_scaled_(x, y, 0.5)
    assert x._version > version
    version = x._version
    with torch.no_grad():
        add_scaled_(x, y, torch.tensor(0.5, dtype=torch.float64))
    assert x._version > version


def test_front_end_takes_the_same_steps_with_and_without_a_graph(device):
    x = torch.randn(1, 1000, 3, device=device)
    y = torch.randn(1, 1000, 3, device=device)
    factor = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        plain = add_scaled(x, y, factor)
    recorded = add_scaled(x.requires_grad_(True), y, factor)
    assert recorded.requires_grad and torch.equal(plain, recorded.detach())
    (grad_factor,) = torch.autograd.grad(recorded.sum(), factor)
    # d/dfactor sum(x + y * factor) = sum(y), summed in float32 (3000 terms): within a few
    # float32 roundings of the sum of |y|.
    torch.testing.assert_close(grad_factor, y.double().sum().to(grad_factor), rtol=0,
                               atol=1e-6 * float(y.abs().sum()))


def test_autograd_and_opcheck(device):
    x = torch.randn(2, 7, 3, dtype=torch.float64, device=device, requires_grad=True)
    y = torch.randn(2, 7, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.torchpm._add_scaled(a, b, -0.7), (x, y))
    torch.library.opcheck(torch.ops.torchpm._add_scaled, (x, y, -0.7))
    with torch.no_grad():
        torch.library.opcheck(torch.ops.torchpm._add_scaled_, (x.detach().clone(), y.detach(), -0.7))


@pytest.mark.parametrize("sort_every, order", [(0, "cic"), (2, "cic"), (0, "tsc"), (2, "pcs")])
def test_simulation_steps_in_place_take_the_same_steps(device, reproducible, sort_every, order):
    """Outside a graph the integration updates its own particle arrays in place (the
    readout fused with the kicks and drift, in the simulation's `paint_order`); the
    oracle is the same integration written out with the out-of-place add_scaled and
    `compute_forces` told the window explicitly, step by step: equal bits, and the
    caller's tensors untouched."""
    from torchpm.ordering import restore_id_order, sort_particles
    from torchpm.pm import compute_forces, step_factors

    sim = torchpm.Simulation(n_particles=16, box_size=64.0, mesh_factor=2, a_start=0.1, steps=5,
                             sort_every=sort_every, paint_order=order, dtype=torch.float64).to(device)

    def forces(positions, a):
        return compute_forces(positions, sim.kernels("force"), a=a, particle_mass=sim.particle_mass,
                              force_scale=1.5 * sim.cosmology.Omega_m, order=order)

    with torch.no_grad():
        x, p, ids = sim.lpt(sim.linear_field(sim.white_noise(seed=3)))
        x0, p0 = x.clone(), p.clone()
        table = sim.growth_table()
        got_x, got_p, got_ids = sim.evolve(x, p, table)
        assert torch.equal(x, x0) and torch.equal(p, p0)

        factors = step_factors(table, torch.tensor(sim.scale_factors, dtype=torch.float64))
        ids = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        if sort_every:
            x, ids, p = sort_particles(sim.force_mesh, x, ids, p)
        force = forces(x, factors[0].a_start)
        for number, factor in enumerate(factors, start=1):
            p = add_scaled(p, force, factor.first_kick)
            x = add_scaled(x, p, factor.drift)
            if sort_every and number % sort_every == 0:
                x, ids, p = sort_particles(sim.force_mesh, x, ids, p)
            force = forces(x, factor.a_end)
            p = add_scaled(p, force, factor.second_kick)
        if sort_every:
            x, ids, p = restore_id_order(x, ids, p)
    assert torch.equal(got_x, x) and torch.equal(got_p, p)


@pytest.mark.parametrize(
    "x, y, message",
    [
        (torch.zeros(2, 3), torch.zeros(3, 2), "expected `y` of the shape, dtype and device of `x`"),
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64), "expected `y` of the shape"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), "float32 or float64"),
    ],
)
def test_bad_arguments_raise(x, y, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.torchpm._add_scaled(x, y, 1.0)
