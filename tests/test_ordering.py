"""Particles in spatial order (torchpm.ordering): the sort op against its pure-torch twin
and hand cases, and simulations with sorting on equal to those without it (positions
identical after sorting back by id, float64), with gradients, on one device and on a
2-rank gloo grid."""

from __future__ import annotations

import pytest
import torch

import torchpm
import torchpm.simulation
from torchpm import ordering
from torchpm.config import SettingError
from torchpm.mesh import LocalMesh
from torchpm.ordering import permute, restore_id_order, sort_particles, spatial_order, spatial_order_reference

from _spawn import rank_errors, run_world

TOLERANCE = 1e-12


def _op(positions, ids, shape, offset, period):
    return torch.ops.torchpm._spatial_order(positions, ids, shape, offset, period)


def test_hand_case():
    # A 2 x 3 block of rows at offset (1, 0) of a 4 x 3 periodic mesh. Rows: (x - 1, y).
    positions = torch.tensor([[
        [2.5, 2.2, 0.0],   # row (1, 2) = 5
        [1.9, 0.1, 7.0],   # row (0, 0) = 0
        [6.2, -0.5, 0.0],  # x wraps to 2 -> (1, 2) = 5 (y = -0.5 wraps to 2)
        [1.0, 1.0, 0.0],   # row (0, 1) = 1
        [0.0, 0.0, 0.0],   # an empty slot: last
        [float("nan"), 0.0, 0.0],  # non-finite: last
        [2.0, 0.5, 1.0],   # row (1, 0) = 3
    ]], dtype=torch.float64)
    ids = torch.tensor([[9, 4, 3, 8, -1, 2, 5]])
    order = _op(positions, ids, [2, 3], [1, 0], [4, 3])
    # by row, then id: row 0 {id 4}, row 1 {8}, row 3 {5}, row 5 {3, 9}, last {2, -1} by id
    assert order.tolist() == [[1, 3, 6, 2, 0, 4, 5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_op_matches_reference_and_ignores_input_order(dtype):
    generator = torch.Generator().manual_seed(3)
    batch, n = 2, 3000
    # Unwrapped coordinates on both sides of the box, empty slots, NaN, Inf and huge values.
    positions = (torch.rand(batch, n, 3, generator=generator, dtype=torch.float64) * 40 - 12).to(dtype)
    ids = torch.stack([torch.randperm(n, generator=generator) for _ in range(batch)])
    ids[0, :50] = -1
    positions[1, 3] = float("nan")
    positions[1, 4, 0] = float("inf")
    positions[0, 60, 1] = 1e30
    shape, offset, period = [5, 7], [3, -2], [16, 12]
    order = _op(positions, ids, shape, offset, period)
    assert torch.equal(order, spatial_order_reference(positions, ids, shape, offset, period))
    assert torch.equal(order.sort(dim=1).values, torch.arange(n).expand(batch, n))
    # The order depends on the particles, not on the order they came in.
    shuffle = torch.stack([torch.randperm(n, generator=generator) for _ in range(batch)])
    shuffled_positions, shuffled_ids = permute(shuffle, positions, ids)
    again = _op(shuffled_positions, shuffled_ids, shape, offset, period)
    assert torch.equal(ids.gather(1, order), shuffled_ids.gather(1, again))


def _same_error(registered, pure_torch, *arguments):
    """The registered CPU op and the pure-torch CUDA kernel (run here on CPU tensors)
    raise the same ValueError for ``arguments``; returns its message."""
    with pytest.raises(ValueError) as native:
        registered(*arguments)
    with pytest.raises(ValueError) as composed:
        pure_torch(*arguments)
    assert str(composed.value) == str(native.value)
    return str(native.value)


def test_cuda_kernels_check_arguments_as_the_cpu_ops():
    """The CUDA kernels of _spatial_order, _gather_rows and _scatter_rows are pure torch:
    they check their arguments as the CPU ops do (same messages) instead of failing in
    an indexing kernel (a device-side assert on a GPU)."""
    ids = torch.zeros(1, 4, dtype=torch.int64)
    for arguments in [
        (torch.zeros(1, 4, 3), ids.int(), [2, 2], [0, 0], [2, 2]),
        (torch.zeros(1, 4, 3), torch.zeros(1, 5, dtype=torch.int64), [2, 2], [0, 0], [2, 2]),
        (torch.zeros(1, 4, 3), ids, [2, 0], [0, 0], [2, 2]),
        (torch.zeros(1, 4, 3), ids, [2, 2], [0, 0], [2, 2**31]),
        (torch.zeros(1, 4, 3), ids, [2], [0, 0], [2, 2]),
        (torch.zeros(1, 4, 2), ids, [2, 2], [0, 0], [2, 2]),
        (torch.zeros(1, 4, 3, dtype=torch.float16), ids, [2, 2], [0, 0], [2, 2]),
        (torch.zeros(1, 4, 3), ids[:, :3], [0, 2], [0, 0], [2, 2]),  # several: the CPU op's order
    ]:
        _same_error(_op, ordering._spatial_order_device, *arguments)
    values = torch.zeros(1, 4, 3)
    for name in ("_gather_rows", "_scatter_rows"):
        registered, pure_torch = getattr(torch.ops.torchpm, name), getattr(ordering, f"{name}_device")
        message = _same_error(registered, pure_torch, values, torch.tensor([[0, 1, 3, 4]]))
        assert message.endswith("`order` must hold slots in [0, 4), got 4 at flat position 3.")
        message = _same_error(registered, pure_torch, values, torch.tensor([[-1, 0, 1, 5]]))
        assert message.endswith("got -1 at flat position 0.")  # the first bad slot, of several
        big = torch.zeros(1, 100_000, 3)  # the CPU op's threaded path
        order = torch.arange(100_000).flip(0).unsqueeze(0)
        order[0, 70_000], order[0, 90_000] = -5, 100_000
        message = _same_error(registered, pure_torch, big, order)
        assert message.endswith("got -5 at flat position 70000.")
        for order in (torch.tensor([[0, -2, 1, 2]]), torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 2, 3]]).int()):
            _same_error(registered, pure_torch, values, order)
        _same_error(registered, pure_torch, torch.zeros(4), torch.tensor([[0, 1, 2, 3]]))


def test_op_rejects_bad_arguments():
    positions = torch.zeros(1, 4, 3)
    with pytest.raises(ValueError, match="`ids`"):
        _op(positions, torch.zeros(1, 4, dtype=torch.int32), [2, 2], [0, 0], [2, 2])
    with pytest.raises(ValueError, match="`ids`"):
        _op(positions, torch.zeros(1, 5, dtype=torch.int64), [2, 2], [0, 0], [2, 2])
    with pytest.raises(ValueError, match="`shape`"):
        _op(positions, torch.zeros(1, 4, dtype=torch.int64), [2, 0], [0, 0], [2, 2])
    with pytest.raises(ValueError, match="positions"):
        _op(torch.zeros(1, 4, 2), torch.zeros(1, 4, dtype=torch.int64), [2, 2], [0, 0], [2, 2])
    with pytest.raises(SettingError, match="sort_every"):
        torchpm.Simulation(n_particles=4, sort_every=-1)


def test_sort_and_restore_are_permutations_with_gradients():
    generator = torch.Generator().manual_seed(1)
    mesh = LocalMesh(6)
    positions = (torch.rand(2, 40, 3, generator=generator, dtype=torch.float64) * 6).requires_grad_(True)
    momenta = torch.randn(2, 40, 3, generator=generator, dtype=torch.float64).requires_grad_(True)
    ids = torch.arange(40).expand(2, 40)
    x, sorted_ids, p = sort_particles(mesh, positions, ids, momenta)
    rows = x.detach().floor()[..., 0] * 6 + x.detach().floor()[..., 1]
    assert bool((rows[:, 1:] >= rows[:, :-1]).all())
    back = restore_id_order(x, sorted_ids, p)
    assert torch.equal(back[0], positions) and torch.equal(back[1], ids) and torch.equal(back[2], momenta)
    assert torch.autograd.gradcheck(lambda a, b: sort_particles(mesh, a, ids, b)[::2], (positions, momenta))


@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_row_permutations_match_torch_indexing(trailing, dtype):
    generator = torch.Generator().manual_seed(2)
    batch, n = 3, 17
    values = (torch.randn(batch, n, *trailing, generator=generator, dtype=torch.float64) * 100).to(dtype)
    order = torch.stack([torch.randperm(n, generator=generator) for _ in range(batch)])
    gathered = torch.ops.torchpm._gather_rows(values, order)
    for b in range(batch):
        assert torch.equal(gathered[b], values[b][order[b]])
    assert torch.equal(torch.ops.torchpm._scatter_rows(gathered, order), values)
    # The torch twins (the kernels on CUDA) agree.
    assert torch.equal(ordering._gather_rows_device(values, order), gathered)
    assert torch.equal(ordering._scatter_rows_device(gathered, order), values)
    if dtype.is_floating_point and trailing == (3,):  # opcheck is slow: the particle layout only
        torch.library.opcheck(torch.ops.torchpm._gather_rows.default, (values.requires_grad_(True), order))
        torch.library.opcheck(torch.ops.torchpm._scatter_rows.default, (values, order))
    if dtype == torch.float64:
        for op in (torch.ops.torchpm._gather_rows, torch.ops.torchpm._scatter_rows):
            assert torch.autograd.gradcheck(lambda v: op(v, order), (values.detach().requires_grad_(True),))
    assert torch.equal(permute(order, values.expand(batch, *values.shape[1:]))[0], gathered)


def test_row_permutations_reject_bad_orders():
    values = torch.zeros(1, 4, 3)
    with pytest.raises(ValueError, match=r"`order` must hold slots in \[0, 4\), got 4"):
        torch.ops.torchpm._gather_rows(values, torch.tensor([[0, 1, 2, 4]]))
    with pytest.raises(ValueError, match="`order`"):
        torch.ops.torchpm._scatter_rows(values, torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="`order`"):
        torch.ops.torchpm._gather_rows(values, torch.tensor([[0, 1, 2, 3]], dtype=torch.int32))


def test_spatial_order_opcheck():
    positions = torch.rand(2, 30, 3, dtype=torch.float64) * 8
    ids = torch.arange(30).expand(2, 30).contiguous()
    torch.library.opcheck(torch.ops.torchpm._spatial_order.default, (positions, ids, [4, 8], [0, 0], [8, 8]))


def _sim(**options):
    settings = dict(n_particles=(8, 6, 5), box_size=(40.0, 30.0, 25.0), mesh_factor=2, a_start=0.1,
                    steps=[0.3, 0.6, 1.0], dtype=torch.float64)
    settings.update(options)
    return torchpm.Simulation(**settings)


def test_simulation_with_sorting_equals_without(monkeypatch):
    plain, sorted_sim = _sim(sort_every=0), _sim(sort_every=2)
    noise = plain.white_noise(batch=2, seed=4)
    calls = []
    original = torchpm.simulation.sort_particles

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(torchpm.simulation, "sort_particles", counting)
    for a in plain.scale_factors[1:]:
        calls.clear()
        expected = plain(noise, until=a, return_mesh_units=True)
        assert not calls
        got = sorted_sim(noise, until=a, return_mesh_units=True)
        steps = plain.scale_factors.index(a)
        assert len(calls) == 1 + steps // 2  # after the LPT and after step 2
        assert torch.equal(got.ids, expected.ids)  # back in grid order on one device
        torch.testing.assert_close(got.positions, expected.positions, rtol=0, atol=TOLERANCE * steps)
        torch.testing.assert_close(got.momenta, expected.momenta, rtol=0, atol=TOLERANCE * steps)


@pytest.mark.parametrize("options", [dict(), dict(checkpoint=True), dict(adjoint=True)])
def test_gradients_with_sorting(options):
    small = dict(n_particles=4, box_size=40.0, mesh_factor=1, steps=2, a_start=0.2, **options)
    noise = _sim(**small).white_noise(seed=2).requires_grad_(True)
    generator = torch.Generator().manual_seed(5)
    u, v = (torch.randn(1, 64, 3, generator=generator, dtype=torch.float64) for _ in range(2))

    def projection(simulation, w):
        state = simulation(w)
        return (u * state.positions).sum() + (v * state.momenta).sum()

    sorted_sim, unsorted_sim = _sim(sort_every=1, **small), _sim(sort_every=0, **small)
    (with_sort,) = torch.autograd.grad(projection(sorted_sim, noise), noise)
    (without,) = torch.autograd.grad(projection(unsorted_sim, noise), noise)
    torch.testing.assert_close(with_sort, without, rtol=1e-10, atol=1e-12)
    if not options:
        assert torch.autograd.gradcheck(lambda w: projection(sorted_sim, w), (noise,), eps=1e-6, atol=1e-5,
                                        rtol=1e-4)


def test_resume_at_a_sort_step_is_bit_identical():
    sim = _sim(sort_every=2, dtype=torch.float32)
    noise = sim.white_noise(seed=6)
    whole = sim(noise, return_mesh_units=True)
    middle = sim(noise, until=0.6, return_mesh_units=True)  # step 2: sorted there
    resumed = sim.resume(middle, mesh_units=True, return_mesh_units=True)
    assert torch.equal(resumed.positions, whole.positions) and torch.equal(resumed.momenta, whole.momenta)


# ----------------------------------------------------------------------------
# A 2-rank gloo grid (run inside the spawned processes).


def make_context(world_size):
    from torchpm.distributed import process_grid_groups

    return {"groups": process_grid_groups((2, 1))}


def run_case(case_id, ctx):
    serial = _sim(sort_every=0)
    noise = serial.white_noise(batch=2, seed=8)
    expected = serial(noise, return_mesh_units=True)
    mesh = ctx["groups"]
    period = torch.tensor(serial.mesh_shape, dtype=torch.float64)
    for sort_every in (0, 1):
        sim = _sim(sort_every=sort_every, mesh=mesh)
        state = sim(noise, return_mesh_units=True)
        full = sim.gather(state)
        for member in range(2):
            order = torch.argsort(full.ids[member])
            assert torch.equal(full.ids[member][order], expected.ids[member])
            # The grid wraps positions along its split axis; one device does not.
            difference = full.positions[member][order] - expected.positions[member]
            difference -= period * torch.round(difference / period)
            assert float(difference.abs().max()) <= 10 * TOLERANCE
            torch.testing.assert_close(full.momenta[member][order], expected.momenta[member],
                                       rtol=0, atol=10 * TOLERANCE)
        if sort_every:
            # The rank's particles are in spatial order (the last step sorted them).
            assert torch.equal(state.ids, state.ids.gather(1, spatial_order(state.positions, state.ids,
                                                                            sim.force_mesh)))


def test_two_ranks(tmp_path):
    errors = rank_errors(run_world(2, __name__, ["grid-2x1"], tmp_path, timeout_s=240)["grid-2x1"])
    assert not errors, errors


@pytest.mark.parametrize("case", ["dense", "sparse_ids", "negative_ids", "overflowing_ids", "empty"])
def test_one_key_sort_of_the_cuda_kernel_equals_the_two_sorts(case):
    """The CUDA kernel sorts once by a composite (row, id) key: the same order as the two
    stable sorts of the reference, run here on CPU tensors; ids whose span would overflow
    the key fall back to the two sorts."""
    generator = torch.Generator().manual_seed(11)
    batch, n = 3, 0 if case == "empty" else 4000
    positions = torch.rand(batch, n, 3, generator=generator, dtype=torch.float64) * 40 - 12
    ids = torch.stack([torch.randperm(n, generator=generator) for _ in range(batch)])
    if n:
        ids[0, :70] = -1
        positions[1, 5] = float("nan")
        positions[2, 9, 1] = 1e30
    if case == "sparse_ids":
        ids = torch.where(ids >= 0, ids * 1_000_003 + 7, ids)
    elif case == "negative_ids":
        ids[1, 100:140] = -5  # several empty markers: by id, then slot, as the reference
    elif case == "overflowing_ids":
        ids[2, 0] = 2**62
    shape, offset, period = [5, 7], [3, -2], [16, 12]
    order = ordering._spatial_order_one_key(positions, ids, shape, offset, period)
    assert torch.equal(order, spatial_order_reference(positions, ids, shape, offset, period))
    if n and case != "negative_ids":  # (and the CPU op's order)
        assert torch.equal(order, _op(positions, ids, shape, offset, period))
