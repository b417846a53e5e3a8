"""What the two other CUDA paints share with the scatter paint: the node-by-node
paint (torch.ops.torchpm._paint_deterministic, csrc/node_paint.h, what CUDA runs
under torch.use_deterministic_algorithms(True)) and the tiled paint
(torch.ops.torchpm._paint_tiled, csrc/tile_paint.h, after
torchpm.ops.set_paint_method("tiled")).

Both CPU ops run the functions of their CUDA kernels, so these tests check the
GPU's arithmetic here; the CUDA cases run the kernels themselves when a GPU is
there. Oracles: the scatter paint and the pure-torch twin (to rounding),
conservation of the weights, the scatter paint's error reports, and the paint's
own autograd formulas through gradcheck. What is particular to each paint is in
test_deterministic_paint.py and test_tiled_paint.py.
"""

import pytest
import torch

import torchpm
from torchpm.ops import paint_reference

from conftest import DEVICES

CUDA_ONLY = [p for p in DEVICES if not isinstance(p, str)]
ops = torch.ops.torchpm
VARIANTS = {"node": ops._paint_deterministic, "tiled": ops._paint_tiled}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    return VARIANTS[request.param]


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
    return torch.randn(batch, count, int(kind), generator=generator, dtype=dtype)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
@pytest.mark.parametrize("periodic", [(True, True, True), (False, True, False), (False, False, False)])
@pytest.mark.parametrize("kind", ["unit", "scalar", "1", "3", "4", "5"])
def test_equals_the_scatter_paint_and_the_twin(device, variant, order, periodic, kind):
    # 19 x 9 x 17 nodes: 3 x 2 x 3 tiles of 8^3 for the tiled paint, the last of
    # each axis partial
    g = torch.Generator().manual_seed(order * 7 + len(kind))
    shape, offset = (19, 9, 17), (3, -2, 1)
    x = inside(g, 2, 3000, shape, offset, periodic, order)
    w = weights_of(kind, g, 2, 3000)
    x, w = x.to(device), None if w is None else w.to(device)
    args = (list(shape), list(offset), list(periodic), order, True)
    out = variant(x, w, *args)
    scatter = ops.paint(x, w, *args)
    assert out.shape == scatter.shape and out.dtype == scatter.dtype and out.device == x.device
    torch.testing.assert_close(out, scatter, rtol=1e-12, atol=1e-12)
    twin = paint_reference(x.cpu(), None if w is None else w.cpu(), list(shape), list(offset), list(periodic), order)
    torch.testing.assert_close(out.cpu(), twin, rtol=1e-12, atol=1e-12)
    # nothing lost: every weight lands somewhere
    total = torch.ones(2, 3000, dtype=torch.float64) if w is None else w.cpu()
    per_member = out.cpu().flatten(1 if w is None or w.dim() == 2 else 2).sum(-1)
    torch.testing.assert_close(per_member, total.sum(1), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 2, 3), (3, 1, 10)])
def test_periodic_axes_shorter_than_the_stencil(device, variant, order, shape):
    # A particle's stencil wraps onto the same node several times; the node gets
    # each of those weights, as the scatter paint adds each wrapped node.
    g = torch.Generator().manual_seed(11)
    x = (torch.rand(1, 64, 3, generator=g, dtype=torch.float64) * 9 - 3).to(device)
    w = torch.rand(1, 64, 2, generator=g, dtype=torch.float64).to(device)
    out = variant(x, w, list(shape), [0, 0, 0], [True] * 3, order, True)
    twin = paint_reference(x.cpu(), w.cpu(), list(shape), [0, 0, 0], [True] * 3, order)
    torch.testing.assert_close(out.cpu(), twin, rtol=1e-12, atol=1e-12)


def test_clustered_particles(device, variant):
    # late-time structure: 20000 particles in a few cells (for the tiled paint 20
    # chunks of at most 1024 in the tile around (4, 4, 4)), the rest spread out
    g = torch.Generator().manual_seed(2)
    shape = (16, 16, 16)
    halo = 4 + 0.2 * torch.randn(1, 20000, 3, generator=g, dtype=torch.float64)
    field = torch.rand(1, 4000, 3, generator=g, dtype=torch.float64) * 16
    x = torch.cat([halo, field], dim=1).to(device)
    w = torch.rand(1, 24000, 3, generator=g, dtype=torch.float64).to(device)
    for order in (2, 3):
        out = variant(x, w, list(shape), [0, 0, 0], [True] * 3, order, True)
        scatter = ops.paint(x, w, list(shape), [0, 0, 0], [True] * 3, order, True)
        torch.testing.assert_close(out, scatter, rtol=1e-12, atol=1e-10)


def test_rejected_particles_raise_like_paint(device, variant):
    x = torch.tensor([[[3.25, 1.5, 2.0], [6.5, 2.0, 2.0]]], dtype=torch.float64, device=device)
    previous = torchpm.set_error_checking("immediate")
    try:
        with pytest.raises(ValueError, match=r"torchpm.paint: 1 of 2 particles.*particle 1 of batch 0.*\[2, 5\)"):
            variant(x, None, [4, 8, 8], [2, 0, 0], [False, True, True], 2, True)
        w = torch.tensor([[1.0, float("nan")]], dtype=torch.float64, device=device)
        with pytest.raises(ValueError, match=r"torchpm.paint: .*`weights`"):
            variant(x[:, :1].expand(1, 2, 3), w, [4, 8, 8], [2, 0, 0], [False, True, True], 2, True)
    finally:
        torchpm.set_error_checking(previous)
    # check_finite=False: a NaN weight propagates to the 8 nodes of its stencil
    # (even those of weight 0) and nowhere else
    w = torch.tensor([[float("nan"), 1.0]], dtype=torch.float64, device=device)
    y = torch.tensor([[[3.5, 1.0, 2.0], [3.0, 6.0, 6.0]]], dtype=torch.float64, device=device)
    mesh = variant(y, w, [4, 8, 8], [2, 0, 0], [False, True, True], 2, False).cpu()
    assert torch.isnan(mesh[0, 1:3, 1:3, 2:4]).all() and torch.isnan(mesh).sum() == 8
    assert mesh[0, 1, 6, 6] == 1.0


def test_deferred_mode_returns_a_poisoned_mesh_and_reports_later(device, variant):
    # batch member 1 has the rejected particle: only its node (0, 0, 0) is NaN
    g = torch.Generator().manual_seed(8)
    x = inside(g, 2, 50, (4, 8, 8), (2, 0, 0), (False, True, True), 2).to(device)
    w = torch.rand(2, 50, 3, generator=g, dtype=torch.float64).to(device)
    x[1, 17, 0] = 9.0
    previous = torchpm.set_error_checking("deferred")
    try:
        mesh = variant(x, w, [4, 8, 8], [2, 0, 0], [False, True, True], 2, True).cpu()
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


def test_empty_inputs(device, variant):
    x = torch.zeros(2, 0, 3, device=device)
    mesh = variant(x, None, [3, 4, 5], [0, 0, 0], [True] * 3, 2, True)
    assert mesh.shape == (2, 3, 4, 5) and torch.count_nonzero(mesh) == 0
    mesh = variant(torch.zeros(0, 7, 3, device=device), torch.zeros(0, 7, 2, device=device), [3, 4, 5], [0, 0, 0], [True] * 3, 2, True)
    assert mesh.shape == (0, 2, 3, 4, 5)


def test_argument_errors_name_paint_and_the_argument(variant):
    x = torch.rand(1, 5, 3)
    with pytest.raises(ValueError, match=r"torchpm.paint: expected `weights` of shape \(B, N\)"):
        variant(x, torch.ones(1, 4), [4, 4, 4], [0, 0, 0], [True] * 3, 2, True)
    with pytest.raises(ValueError, match=r"torchpm.paint: expected `weights` to have the dtype"):
        variant(x, torch.ones(1, 5, dtype=torch.float64), [4, 4, 4], [0, 0, 0], [True] * 3, 2, True)
    with pytest.raises(ValueError, match=r"`order`"):
        variant(x, None, [4, 4, 4], [0, 0, 0], [True] * 3, 5, True)
    with pytest.raises(ValueError, match=r"`positions`"):
        variant(x[..., :2], None, [4, 4, 4], [0, 0, 0], [True] * 3, 2, True)


def test_gradients_are_the_paints(variant):
    g = torch.Generator().manual_seed(6)
    x = inside(g, 1, 12, (9, 5, 3), (0, 0, 0), (True, False, True), 3).requires_grad_(True)
    w = torch.rand(1, 12, 2, generator=g, dtype=torch.float64, requires_grad=True)
    args = ([9, 5, 3], [0, 0, 0], [True, False, True], 3, True)
    torch.autograd.gradcheck(lambda x, w: variant(x, w, *args), (x, w))
    f = torch.randn(1, 2, 9, 5, 3, generator=g, dtype=torch.float64)
    out = torch.autograd.grad((variant(x, w, *args) * f).sum(), (x, w))
    scatter = torch.autograd.grad((ops.paint(x, w, *args) * f).sum(), (x, w))
    for a, b in zip(out, scatter):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_opcheck_and_fake_kernel(variant):
    g = torch.Generator().manual_seed(9)
    x = torch.rand(2, 40, 3, generator=g) * 8
    w = torch.rand(2, 40, 3, generator=g)
    torch.library.opcheck(variant.default, (x, w, [8, 8, 8], [0, 0, 0], [True] * 3, 2, True))
    torch.library.opcheck(variant.default, (x, None, [8, 8, 8], [0, 0, 0], [True] * 3, 4, True))
    meta = variant(x.to("meta"), w.to("meta"), [8, 6, 4], [0, 0, 0], [True] * 3, 2, True)
    assert meta.shape == (2, 3, 8, 6, 4) and meta.device.type == "meta"


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
def test_cuda_graph_capture(device, variant):
    # the binning or sorting, prefix sums and paint kernels replay from a CUDA
    # graph (no host synchronisation)
    g = torch.Generator().manual_seed(14)
    x = (torch.rand(1, 50000, 3, generator=g) * 16).to(device)
    w = torch.rand(1, 50000, generator=g).to(device)
    args = ([16, 16, 16], [0, 0, 0], [True] * 3, 2, True)
    expected = variant(x, w, *args)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        for _ in range(3):
            variant(x, w, *args)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = variant(x, w, *args)
    graph.replay()
    torch.cuda.synchronize(device)
    # the node paint is bitwise reproducible; the tiled one adds with atomics
    exact = variant is ops._paint_deterministic
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    assert same(out, expected)
    w.mul_(2)
    graph.replay()
    torch.cuda.synchronize(device)
    assert same(out, 2 * expected)  # a power of two: the same roundings
    torchpm.check()
