"""The paint computed node by node (torch.ops.torchpm._paint_deterministic,
csrc/node_paint.h): what torchpm.paint runs on CUDA under
torch.use_deterministic_algorithms(True), instead of the scatter kernel's atomics.

The CPU op runs the same per-particle, per-key and per-node functions as the CUDA
kernels, so these tests check the GPU's arithmetic here; the CUDA cases run the
kernels themselves when a GPU is there. Oracles: the scatter paint and the
pure-torch twin (to rounding), conservation of the weights, a hand-computed
float32 sum whose value depends on the order of its terms, and the paint's own
autograd formulas through gradcheck.
"""

import pytest
import torch

import torchpm
from torchpm.ops import paint_reference

from conftest import DEVICES

CUDA_ONLY = [p for p in DEVICES if not isinstance(p, str)]
ops = torch.ops.torchpm


def inside(generator, batch, count, shape, offset, periodic, order, dtype=torch.float64):
    """Positions every stencil of `order` accepts: anywhere (a few periods) on a
    periodic axis, inside the block on the others."""
    u = torch.rand(batch, count, 3, generator=generator, dtype=dtype)
    x = torch.empty_like(u)
    for d in range(3):
        if periodic[d]:
            x[..., d] = offset[d] + shape[d] * (4 * u[..., d] - 1.5)
        else:
            low = offset[d] + order / 2 - 1
            high = offset[d] + shape[d] - order / 2
            x[..., d] = low + (high - low) * 0.999 * u[..., d]
    return x


def weights_of(kind, generator, batch, count, dtype=torch.float64):
    if kind == "unit":
        return None
    if kind == "scalar":
        return torch.randn(batch, count, generator=generator, dtype=dtype)
    channels = int(kind)
    return torch.randn(batch, count, channels, generator=generator, dtype=dtype)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
@pytest.mark.parametrize("periodic", [(True, True, True), (False, True, False), (False, False, False)])
@pytest.mark.parametrize("kind", ["unit", "scalar", "1", "3", "4", "5"])
def test_equals_the_scatter_paint_and_the_twin(device, order, periodic, kind):
    g = torch.Generator().manual_seed(order * 7 + len(kind))
    shape, offset = (6, 5, 7), (3, -2, 1)
    x = inside(g, 2, 500, shape, offset, periodic, order)
    w = weights_of(kind, g, 2, 500)
    x, w = x.to(device), None if w is None else w.to(device)
    args = (list(shape), list(offset), list(periodic), order, True)
    node = ops._paint_deterministic(x, w, *args)
    scatter = ops.paint(x, w, *args)
    assert node.shape == scatter.shape and node.dtype == scatter.dtype and node.device == x.device
    torch.testing.assert_close(node, scatter, rtol=1e-12, atol=1e-12)
    twin = paint_reference(x.cpu(), None if w is None else w.cpu(), list(shape), list(offset), list(periodic), order)
    torch.testing.assert_close(node.cpu(), twin, rtol=1e-12, atol=1e-12)
    # nothing lost: every weight lands somewhere
    total = torch.ones(2, 500, dtype=torch.float64) if w is None else w.cpu()
    per_member = node.cpu().flatten(1 if w is None or w.dim() == 2 else 2).sum(-1)
    torch.testing.assert_close(per_member, total.sum(1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 2, 3), (3, 1, 2)])
def test_periodic_axes_shorter_than_the_stencil(device, order, shape):
    # A particle's stencil wraps onto the same node several times; the node gets
    # each of those weights, as the scatter paint adds each wrapped node.
    g = torch.Generator().manual_seed(11)
    x = (torch.rand(1, 64, 3, generator=g, dtype=torch.float64) * 9 - 3).to(device)
    w = torch.rand(1, 64, 2, generator=g, dtype=torch.float64).to(device)
    node = ops._paint_deterministic(x, w, list(shape), [0, 0, 0], [True] * 3, order, True)
    twin = paint_reference(x.cpu(), w.cpu(), list(shape), [0, 0, 0], [True] * 3, order)
    torch.testing.assert_close(node.cpu(), twin, rtol=1e-12, atol=1e-12)


def test_clustered_particles(device):
    # late-time structure: most particles in a few cells, the rest spread out
    g = torch.Generator().manual_seed(2)
    shape = (16, 16, 16)
    halo = 4 + 0.2 * torch.randn(1, 20000, 3, generator=g, dtype=torch.float64)
    field = torch.rand(1, 4000, 3, generator=g, dtype=torch.float64) * 16
    x = torch.cat([halo, field], dim=1).to(device)
    w = torch.rand(1, 24000, 3, generator=g, dtype=torch.float64).to(device)
    for order in (2, 3):
        node = ops._paint_deterministic(x, w, list(shape), [0, 0, 0], [True] * 3, order, True)
        scatter = ops.paint(x, w, list(shape), [0, 0, 0], [True] * 3, order, True)
        torch.testing.assert_close(node, scatter, rtol=1e-12, atol=1e-10)


def test_a_node_sums_its_particles_in_index_order(device):
    # float32 sums that depend on the order of their terms: 1e8 + 1 rounds to 1e8.
    # NGP puts each particle on one node with weight 1. Node (1, 1, 1) gets 40000
    # particles of weight 0 and three of weights w1, w2, w3 far apart in the
    # array, with 20000 particles of another node in between: it holds the float32
    # sum of w1, w2, w3 in particle order only if the sort by cell is stable.
    g = torch.Generator().manual_seed(3)
    count = 60000
    x = 1.0 + 0.6 * (torch.rand(1, count, 3, generator=g) - 0.5)
    other = torch.arange(count) % 3 == 1
    x[0, other] = torch.tensor([3.0, 0.0, 0.0])
    special = [5, 30001 - 30001 % 3, count - 3]  # not in `other`

    def painted(weights):
        w = torch.zeros(1, count)
        w[0, other] = 5.0
        w[0, special] = torch.tensor(weights)
        mesh = ops._paint_deterministic(x.to(device), w.to(device), [4, 4, 4], [0, 0, 0], [True] * 3, 1, True)
        return mesh[0, 1, 1, 1].item(), mesh[0, 3, 0, 0].item(), torch.count_nonzero(mesh).item()

    assert painted([1e8, -1e8, 1.0]) == (1.0, 100000.0, 2)  # (1e8 - 1e8) + 1
    assert painted([1.0, 1e8, -1e8]) == (0.0, 100000.0, 1)  # (1 + 1e8) - 1e8
    assert painted([1e8, 1.0, -1e8]) == (0.0, 100000.0, 1)
    assert painted([-1e8, 1.0, 1e8]) == (0.0, 100000.0, 1)
    assert painted([1.0, -1e8, 1e8]) == (0.0, 100000.0, 1)
    assert painted([-1e8, 1e8, 1.0]) == (1.0, 100000.0, 2)


def test_independent_of_the_number_of_threads():
    g = torch.Generator().manual_seed(4)
    x = torch.rand(2, 30000, 3, generator=g) * 32
    w = torch.rand(2, 30000, 4, generator=g)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(ops._paint_deterministic(x, w, [32, 32, 32], [0, 0, 0], [True] * 3, 3, True))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_rejected_particles_raise_like_paint(device):
    x = torch.tensor([[[3.25, 1.5, 2.0], [6.5, 2.0, 2.0]]], dtype=torch.float64, device=device)
    previous = torchpm.set_error_checking("immediate")
    try:
        with pytest.raises(ValueError, match=r"torchpm.paint: 1 of 2 particles.*particle 1 of batch 0.*\[2, 5\)"):
            ops._paint_deterministic(x, None, [4, 8, 8], [2, 0, 0], [False, True, True], 2, True)
        w = torch.tensor([[1.0, float("nan")]], dtype=torch.float64, device=device)
        with pytest.raises(ValueError, match=r"torchpm.paint: .*`weights`"):
            ops._paint_deterministic(x[:, :1].expand(1, 2, 3), w, [4, 8, 8], [2, 0, 0], [False, True, True], 2, True)
    finally:
        torchpm.set_error_checking(previous)
    # check_finite=False: a NaN weight propagates to the 8 nodes of its stencil
    # (even those of weight 0) and nowhere else
    w = torch.tensor([[float("nan"), 1.0]], dtype=torch.float64, device=device)
    y = torch.tensor([[[3.5, 1.0, 2.0], [3.0, 6.0, 6.0]]], dtype=torch.float64, device=device)
    mesh = ops._paint_deterministic(y, w, [4, 8, 8], [2, 0, 0], [False, True, True], 2, False).cpu()
    assert torch.isnan(mesh[0, 1:3, 1:3, 2:4]).all() and torch.isnan(mesh).sum() == 8
    assert mesh[0, 1, 6, 6] == 1.0


def test_deferred_mode_returns_a_poisoned_mesh_and_reports_later(device):
    # batch member 1 has the rejected particle: only its node (0, 0, 0) is NaN
    g = torch.Generator().manual_seed(8)
    x = inside(g, 2, 50, (4, 8, 8), (2, 0, 0), (False, True, True), 2).to(device)
    w = torch.rand(2, 50, 3, generator=g, dtype=torch.float64).to(device)
    x[1, 17, 0] = 9.0
    previous = torchpm.set_error_checking("deferred")
    try:
        mesh = ops._paint_deterministic(x, w, [4, 8, 8], [2, 0, 0], [False, True, True], 2, True).cpu()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with pytest.raises(ValueError, match=r"torchpm.paint: 1 of 100 particles.*particle 17 of batch 1"):
            torchpm.check()
    finally:
        torchpm.set_error_checking(previous)
    assert torch.isnan(mesh[1, :, 0, 0, 0]).all() and torch.isnan(mesh).sum() == 3
    valid = torch.cat([x[1:, :17], x[1:, 18:]], dim=1).cpu()
    expected = paint_reference(valid, torch.cat([w[1:, :17], w[1:, 18:]], dim=1).cpu(), [4, 8, 8], [2, 0, 0], [False, True, True], 2)
    mesh[1, :, 0, 0, 0] = expected[0, :, 0, 0, 0]
    torch.testing.assert_close(mesh[1:], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mesh[:1], ops.paint(x[:1], w[:1], [4, 8, 8], [2, 0, 0], [False, True, True], 2, True).cpu())


def test_empty_inputs(device):
    x = torch.zeros(2, 0, 3, device=device)
    mesh = ops._paint_deterministic(x, None, [3, 4, 5], [0, 0, 0], [True] * 3, 2, True)
    assert mesh.shape == (2, 3, 4, 5) and torch.count_nonzero(mesh) == 0
    mesh = ops._paint_deterministic(torch.zeros(0, 7, 3, device=device), torch.zeros(0, 7, 2, device=device), [3, 4, 5], [0, 0, 0], [True] * 3, 2, True)
    assert mesh.shape == (0, 2, 3, 4, 5)


def test_argument_errors_name_paint_and_the_argument():
    x = torch.rand(1, 5, 3)
    with pytest.raises(ValueError, match=r"torchpm.paint: expected `weights` of shape \(B, N\)"):
        ops._paint_deterministic(x, torch.ones(1, 4), [4, 4, 4], [0, 0, 0], [True] * 3, 2, True)
    with pytest.raises(ValueError, match=r"torchpm.paint: expected `weights` to have the dtype"):
        ops._paint_deterministic(x, torch.ones(1, 5, dtype=torch.float64), [4, 4, 4], [0, 0, 0], [True] * 3, 2, True)
    with pytest.raises(ValueError, match=r"`order`"):
        ops._paint_deterministic(x, None, [4, 4, 4], [0, 0, 0], [True] * 3, 5, True)
    with pytest.raises(ValueError, match=r"`positions`"):
        ops._paint_deterministic(x[..., :2], None, [4, 4, 4], [0, 0, 0], [True] * 3, 2, True)


def test_gradients_are_the_paints():
    g = torch.Generator().manual_seed(6)
    x = inside(g, 1, 12, (4, 5, 3), (0, 0, 0), (True, False, True), 3).requires_grad_(True)
    w = torch.rand(1, 12, 2, generator=g, dtype=torch.float64, requires_grad=True)
    args = ([4, 5, 3], [0, 0, 0], [True, False, True], 3, True)
    torch.autograd.gradcheck(lambda x, w: ops._paint_deterministic(x, w, *args), (x, w))
    f = torch.randn(1, 2, 4, 5, 3, generator=g, dtype=torch.float64)
    node = torch.autograd.grad((ops._paint_deterministic(x, w, *args) * f).sum(), (x, w))
    scatter = torch.autograd.grad((ops.paint(x, w, *args) * f).sum(), (x, w))
    for a, b in zip(node, scatter):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_opcheck_and_fake_kernel():
    g = torch.Generator().manual_seed(9)
    x = torch.rand(2, 40, 3, generator=g) * 8
    w = torch.rand(2, 40, 3, generator=g)
    torch.library.opcheck(ops._paint_deterministic.default, (x, w, [8, 8, 8], [0, 0, 0], [True] * 3, 2, True))
    torch.library.opcheck(ops._paint_deterministic.default, (x, None, [8, 8, 8], [0, 0, 0], [True] * 3, 4, True))
    meta = ops._paint_deterministic(x.to("meta"), w.to("meta"), [8, 6, 4], [0, 0, 0], [True] * 3, 2, True)
    assert meta.shape == (2, 3, 8, 6, 4) and meta.device.type == "meta"


def test_paint_on_the_cpu_keeps_its_scatter_kernel_in_deterministic_mode():
    # the CPU scatter paint is deterministic already: deterministic mode does not
    # change what torchpm.paint computes there (the node sums differ in rounding)
    g = torch.Generator().manual_seed(12)
    x = torch.rand(1, 3000, 3, generator=g) * 8
    w = torch.rand(1, 3000, generator=g)
    scatter = ops.paint(x, w, [8, 8, 8], [0, 0, 0], [True] * 3, 2, True)
    assert not torch.equal(scatter, ops._paint_deterministic(x, w, [8, 8, 8], [0, 0, 0], [True] * 3, 2, True))
    torch.use_deterministic_algorithms(True)
    try:
        out = torchpm.paint(x, w, (8, 8, 8))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(out, scatter)


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
def test_cuda_paint_in_deterministic_mode_is_the_node_paint(device):
    g = torch.Generator().manual_seed(13)
    x = (torch.rand(2, 200000, 3, generator=g) * 32).to(device)
    w = torch.rand(2, 200000, 3, generator=g).to(device)
    field = torch.randn(2, 3, 32, 32, 32, generator=g).to(device).requires_grad_(True)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="deterministic"):
            ops.paint(x, w, [32, 32, 32], [0, 0, 0], [True] * 3, 2, True)
        first = torchpm.paint(x, w, (32, 32, 32), order="tsc")
        second = torchpm.paint(x, w, (32, 32, 32), order="tsc")
        # the readout's backward paints: the same node-by-node op
        torchpm.readout(field, x).backward(w)
        grad = field.grad.clone()
        field.grad = None
        torchpm.readout(field, x).backward(w)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(first, second) and torch.equal(grad, field.grad)
    assert torch.equal(first, ops._paint_deterministic(x, w, [32, 32, 32], [0, 0, 0], [True] * 3, 3, True))
    # the CPU runs the same functions: equal up to float32 rounding of the sums
    torch.testing.assert_close(first.cpu(), ops._paint_deterministic(x.cpu(), w.cpu(), [32, 32, 32], [0, 0, 0], [True] * 3, 3, True), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(first, ops.paint(x, w, [32, 32, 32], [0, 0, 0], [True] * 3, 3, True), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, ops.paint(x, w, [32, 32, 32], [0, 0, 0], [True] * 3, 2, True), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
def test_cuda_graph_capture(device):
    # sort, key and node kernels replay from a CUDA graph (no host synchronisation)
    g = torch.Generator().manual_seed(14)
    x = (torch.rand(1, 50000, 3, generator=g) * 16).to(device)
    w = torch.rand(1, 50000, generator=g).to(device)
    args = ([16, 16, 16], [0, 0, 0], [True] * 3, 2, True)
    expected = ops._paint_deterministic(x, w, *args)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        for _ in range(3):
            ops._paint_deterministic(x, w, *args)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops._paint_deterministic(x, w, *args)
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(out, expected)
    w.mul_(2)
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(out, 2 * expected)  # a power of two: the same roundings
    torchpm.check()
