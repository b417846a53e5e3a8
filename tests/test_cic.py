"""Tests of the CIC paint / readout custom ops against hand cases, the pure-torch
reference, conservation and adjoint identities, gradcheck, opcheck and
torch.compile. Every test runs on cpu and (when available) cuda."""

import os

import pytest
import torch

import torchpm
from torchpm.ops import cic_paint_reference, cic_readout_reference

BLOCK = dict(shape=(6, 5, 8), offset=(3, -2, 0), periodic=(False, False, True))


def random_positions(batch, count, shape, dtype, device, offset=(0, 0, 0), periodic=(True,) * 3, seed=0):
    """Positions inside the accepted range of each axis; periodic axes get
    positions outside [0, n) too, to exercise wrapping."""
    g = torch.Generator().manual_seed(seed)
    columns = []
    for d in range(3):
        u = torch.rand(batch, count, generator=g, dtype=torch.float64)
        if periodic[d]:
            columns.append(offset[d] + (3 * u - 1) * shape[d])
        else:
            columns.append(offset[d] + u * (shape[d] - 1) * 0.999)
    return torch.stack(columns, -1).to(dtype=dtype, device=device)


def lattice_positions(n, dtype, device, displacement=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.stack(torch.meshgrid(*[torch.arange(n, dtype=torch.float64)] * 3, indexing="ij"), -1)
    q = q.reshape(1, -1, 3) + displacement * torch.randn(1, n**3, 3, generator=g, dtype=torch.float64)
    return q.to(dtype=dtype, device=device)


# --------------------------------------------------------------------------- hand cases


def test_particle_on_a_node_deposits_everything_there(device):
    x = torch.tensor([[[2.0, 3.0, 4.0]]], dtype=torch.float64, device=device)
    mesh = torchpm.cic_paint(x, torch.tensor([[2.5]], dtype=torch.float64, device=device), (8, 8, 8))
    expected = torch.zeros(1, 8, 8, 8, dtype=torch.float64)
    expected[0, 2, 3, 4] = 2.5
    torch.testing.assert_close(mesh.cpu(), expected, rtol=0, atol=0)


def test_particle_at_cell_centre_splits_equally_over_eight_nodes(device):
    x = torch.tensor([[[2.5, 3.5, 4.5]]], dtype=torch.float64, device=device)
    mesh = torchpm.cic_paint(x, None, (8, 8, 8)).cpu()
    expected = torch.zeros(1, 8, 8, 8, dtype=torch.float64)
    expected[0, 2:4, 3:5, 4:6] = 1 / 8
    torch.testing.assert_close(mesh, expected, rtol=0, atol=0)


def test_linear_weights_along_one_axis(device):
    x = torch.tensor([[[2.25, 3.0, 4.0]]], dtype=torch.float64, device=device)
    mesh = torchpm.cic_paint(x, None, (8, 8, 8)).cpu()
    assert mesh[0, 2, 3, 4].item() == 0.75
    assert mesh[0, 3, 3, 4].item() == 0.25
    assert mesh.sum().item() == 1.0


@pytest.mark.parametrize(
    "position, nodes",
    [
        ((7.5, 0.0, 0.0), {(7, 0, 0): 0.5, (0, 0, 0): 0.5}),
        ((-0.25, 0.0, 0.0), {(7, 0, 0): 0.25, (0, 0, 0): 0.75}),
        ((8.0, 16.0, -8.0), {(0, 0, 0): 1.0}),
        ((0.0, 7.75, 7.5), {(0, 7, 7): 0.25 * 0.5, (0, 0, 7): 0.75 * 0.5, (0, 7, 0): 0.25 * 0.5, (0, 0, 0): 0.75 * 0.5}),
    ],
)
def test_periodic_wrap(device, position, nodes):
    x = torch.tensor([[position]], dtype=torch.float64, device=device)
    mesh = torchpm.cic_paint(x, None, (8, 8, 8)).cpu()
    expected = torch.zeros(1, 8, 8, 8, dtype=torch.float64)
    for (i, j, k), w in nodes.items():
        expected[0, i, j, k] = w
    torch.testing.assert_close(mesh, expected, rtol=0, atol=1e-15)
    # readout of the painted mesh's adjoint: reading a mesh that is 1 on those nodes
    field = torch.arange(512, dtype=torch.float64).reshape(1, 8, 8, 8)
    value = torchpm.cic_readout(field.to(device), x).cpu()
    assert value.item() == pytest.approx(sum(w * field[0, i, j, k].item() for (i, j, k), w in nodes.items()))


def test_block_mode_at_the_block_edges(device):
    # Block holding global x nodes 2..5, periodic in y and z.
    shape, offset, periodic = (4, 8, 8), (2, 0, 0), (False, True, True)
    x = torch.tensor([[[2.0, 1.0, 1.0], [4.5, 1.0, 1.0], [4.999, 1.0, 1.0]]], dtype=torch.float64, device=device)
    mesh = torchpm.cic_paint(x, None, shape, offset=offset, periodic=periodic).cpu()
    assert mesh[0, 0, 1, 1].item() == 1.0
    assert mesh[0, 2, 1, 1].item() == pytest.approx(0.5 + 0.001)
    assert mesh[0, 3, 1, 1].item() == pytest.approx(0.5 + 0.999)
    assert mesh.sum().item() == pytest.approx(3.0)
    # A linear ramp in global x is read back exactly inside the block.
    ramp = (torch.arange(4, dtype=torch.float64) + 2).view(1, 4, 1, 1).expand(1, 4, 8, 8).to(device)
    values = torchpm.cic_readout(ramp, x, offset=offset, periodic=periodic).cpu()
    torch.testing.assert_close(values, x[..., 0].cpu())


@pytest.mark.parametrize("x", [1.999, 5.0, 6.5, -40.0])
def test_block_mode_rejects_particles_outside_the_block(device, x):
    shape, offset, periodic = (4, 8, 8), (2, 0, 0), (False, True, True)
    positions = torch.tensor([[[3.0, 1.0, 1.0], [x, 2.0, 2.0]]], dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match=r"1 of 2 particles.*particle 1 of batch 0.*\[2, 5\)"):
        torchpm.cic_paint(positions, None, shape, offset=offset, periodic=periodic)
        torchpm.check()  # on CUDA the error is deferred by default
    mesh = torch.zeros(1, *shape, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match="1 of 2 particles"):
        torchpm.cic_readout(mesh, positions, offset=offset, periodic=periodic)
        torchpm.check()


# --------------------------------------------------------------------------- reference agreement

TOLERANCES = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["periodic", "block"])
@pytest.mark.parametrize("channels", [None, 1, 3])
@pytest.mark.parametrize("count", [7, 50_000])  # 50 000 takes the binned parallel CPU path
def test_paint_and_readout_match_reference(device, dtype, mode, channels, count):
    if mode == "periodic":
        shape, offset, periodic = (9, 6, 7), (0, 0, 0), (True, True, True)
    else:
        shape, offset, periodic = BLOCK["shape"], BLOCK["offset"], BLOCK["periodic"]
    x = random_positions(2, count, shape, dtype, device, offset, periodic)
    g = torch.Generator().manual_seed(1)
    w = None
    if channels is not None:
        wshape = (2, count) if channels == 1 else (2, count, channels)
        w = torch.rand(wshape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    mesh = torchpm.cic_paint(x, w, shape, offset=offset, periodic=periodic)
    ref = cic_paint_reference(x, w, shape, offset, periodic)
    scale = ref.abs().max()
    torch.testing.assert_close(mesh / scale, ref / scale, **TOLERANCES[dtype])

    field_shape = (2, *shape) if channels in (None, 1) else (2, channels, *shape)
    field = torch.randn(field_shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    values = torchpm.cic_readout(field, x, offset=offset, periodic=periodic)
    torch.testing.assert_close(values, cic_readout_reference(field, x, offset, periodic), **TOLERANCES[dtype])


def test_non_contiguous_inputs(device):
    shape = (8, 8, 8)
    x = random_positions(3, 200, shape, torch.float64, device).transpose(0, 1).contiguous().transpose(0, 1)
    w = torch.rand(200, 3, dtype=torch.float64, device=device).t()
    assert not x.is_contiguous() and not w.is_contiguous()
    torch.testing.assert_close(
        torchpm.cic_paint(x, w, shape), cic_paint_reference(x.contiguous(), w.contiguous(), shape)
    )
    field = torch.randn(8, 8, 8, 3, dtype=torch.float64, device=device).permute(3, 0, 1, 2).unsqueeze(0).expand(3, 3, 8, 8, 8)
    torch.testing.assert_close(torchpm.cic_readout(field, x), cic_readout_reference(field.contiguous(), x.contiguous()))


def test_empty_inputs(device):
    x = torch.empty(2, 0, 3, device=device)
    mesh = torchpm.cic_paint(x, None, (4, 4, 4))
    assert mesh.shape == (2, 4, 4, 4) and mesh.abs().sum().item() == 0
    values = torchpm.cic_readout(torch.randn(2, 3, 4, 4, 4, device=device), x)
    assert values.shape == (2, 0, 3)
    x.requires_grad_(True)
    torchpm.cic_paint(x, None, (4, 4, 4)).sum().backward()
    assert x.grad.shape == (2, 0, 3)


def test_cpu_paint_does_not_depend_on_thread_count():
    shape = (15, 8, 8)  # odd periodic x: the last plane is painted in a phase of its own
    x = lattice_positions(15, torch.float32, "cpu", displacement=2.0)[..., :] % 8
    x[..., 0] = x[..., 0] * 15 / 8
    w = torch.rand(x.shape[:2])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = torchpm.cic_paint(x, w, shape)
        torch.set_num_threads(max(2, threads))
        parallel = torchpm.cic_paint(x, w, shape)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, parallel)


# --------------------------------------------------------------------------- identities


@pytest.mark.parametrize("mode", ["periodic", "block"])
def test_mass_conservation_and_adjoint_identity(device, mode):
    if mode == "periodic":
        shape, offset, periodic = (16, 12, 10), (0, 0, 0), (True, True, True)
    else:
        shape, offset, periodic = BLOCK["shape"], BLOCK["offset"], BLOCK["periodic"]
    x = random_positions(2, 5000, shape, torch.float64, device, offset, periodic, seed=3)
    w = torch.rand(2, 5000, dtype=torch.float64, device=device)
    mesh = torchpm.cic_paint(x, w, shape, offset=offset, periodic=periodic)
    torch.testing.assert_close(mesh.sum(dim=(1, 2, 3)), w.sum(1), rtol=1e-13, atol=0)
    f = torch.randn(2, *shape, dtype=torch.float64, device=device)
    lhs = (mesh * f).sum()
    rhs = (w * torchpm.cic_readout(f, x, offset=offset, periodic=periodic)).sum()
    assert abs(lhs.item() - rhs.item()) <= 1e-12 * abs(lhs.item())
    # unit mass: mean density is N / cells
    unit = torchpm.cic_paint(x, None, shape, offset=offset, periodic=periodic)
    assert unit.sum().item() == pytest.approx(2 * 5000, rel=1e-13)


# --------------------------------------------------------------------------- gradients


def gradcheck_positions(shape, count, device, offset=(0, 0, 0), periodic=(True,) * 3):
    """Positions whose fractional parts stay away from cell faces, where the CIC
    weights have kinks and finite differences are meaningless."""
    x = random_positions(1, count, shape, torch.float64, device, offset, periodic, seed=5)
    frac = x - torch.floor(x)
    x = torch.floor(x) + 0.1 + 0.8 * frac
    return x.requires_grad_(True)


@pytest.mark.parametrize("mode", ["periodic", "block"])
@pytest.mark.parametrize("channels", [1, 3])
def test_gradcheck_paint(device, mode, channels):
    shape, offset, periodic = ((5, 4, 6), (0, 0, 0), (True,) * 3) if mode == "periodic" else tuple(BLOCK.values())
    x = gradcheck_positions(shape, 6, device, offset, periodic)
    wshape = (1, 6) if channels == 1 else (1, 6, channels)
    w = torch.rand(wshape, dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda x, w: torchpm.cic_paint(x, w, shape, offset=offset, periodic=periodic)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w), eps=1e-6, atol=1e-8)
    fn_unit = lambda x: torchpm.cic_paint(x, None, shape, offset=offset, periodic=periodic)  # noqa: E731
    assert torch.autograd.gradcheck(fn_unit, (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", ["periodic", "block"])
@pytest.mark.parametrize("channels", [None, 3])
def test_gradcheck_readout(device, mode, channels):
    shape, offset, periodic = ((5, 4, 6), (0, 0, 0), (True,) * 3) if mode == "periodic" else tuple(BLOCK.values())
    x = gradcheck_positions(shape, 6, device, offset, periodic)
    mshape = (1, *shape) if channels is None else (1, channels, *shape)
    mesh = torch.randn(mshape, dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda m, x: torchpm.cic_readout(m, x, offset=offset, periodic=periodic)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (mesh, x), eps=1e-6, atol=1e-8)


def test_gradients_match_reference_autograd(device):
    shape = (7, 6, 5)
    x = gradcheck_positions(shape, 300, device)
    w = torch.rand(1, 300, 3, dtype=torch.float64, device=device, requires_grad=True)
    f = torch.randn(1, 3, *shape, dtype=torch.float64, device=device)
    ours = torch.autograd.grad((torchpm.cic_paint(x, w, shape) * f).sum(), (x, w))
    ref = torch.autograd.grad((cic_paint_reference(x, w, shape) * f).sum(), (x, w))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["periodic", "block"])
def test_gradgradcheck(device, mode):
    shape, offset, periodic = ((5, 4, 6), (0, 0, 0), (True,) * 3) if mode == "periodic" else tuple(BLOCK.values())
    x = gradcheck_positions(shape, 5, device, offset, periodic)
    mesh = torch.randn(1, 3, *shape, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.rand(1, 5, dtype=torch.float64, device=device, requires_grad=True)
    read = lambda m, x: torchpm.cic_readout(m, x, offset=offset, periodic=periodic)  # noqa: E731
    paint = lambda x, w: torchpm.cic_paint(x, w, shape, offset=offset, periodic=periodic)  # noqa: E731
    assert torch.autograd.gradgradcheck(read, (mesh, x), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradgradcheck(paint, (x, w), eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- opcheck / compile


def opcheck_cases(device):
    shape = (5, 4, 6)
    x = gradcheck_positions(shape, 9, device).detach()
    w = torch.rand(1, 9, dtype=torch.float64, device=device)
    w3 = torch.rand(1, 9, 3, dtype=torch.float64, device=device)
    m = torch.randn(1, *shape, dtype=torch.float64, device=device)
    m3 = torch.randn(1, 3, *shape, dtype=torch.float64, device=device)
    block = BLOCK
    xb = gradcheck_positions(block["shape"], 9, device, block["offset"], block["periodic"]).detach()
    ops = torch.ops.torchpm
    return [
        (ops.paint.default, (x, w, list(shape), [0, 0, 0], [True] * 3, 2, True)),
        (ops.paint.default, (x, None, list(shape), [0, 0, 0], [True] * 3, 2, True)),
        (ops.paint.default, (x, w3, list(shape), [0, 0, 0], [True] * 3, 2, True)),
        (ops.paint.default, (xb, w, list(block["shape"]), list(block["offset"]), list(block["periodic"]), 2, True)),
        (ops.readout.default, (m, x, [0, 0, 0], [True] * 3, 2, True)),
        (ops.readout.default, (m3, x, [0, 0, 0], [True] * 3, 2, True)),
        (ops._position_gradient.default, (m3, x, w3, [0, 0, 0], [True] * 3, 2)),
        (ops._position_gradient.default, (m, x, None, [0, 0, 0], [True] * 3, 2)),
    ]


def test_opcheck(device):
    for op, args in opcheck_cases(device):
        grad_args = tuple(a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args)
        for case in (args, grad_args):
            torch.library.opcheck(op, case)


def test_torch_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    shape = (8, 8, 8)

    def paint_then_read(x, w):
        rho = torchpm.cic_paint(x, w, shape)
        force = torch.stack([rho, 2 * rho, rho * rho], dim=1)
        return torchpm.cic_readout(force, x).sum()

    x0 = gradcheck_positions(shape, 64, device).detach()
    w0 = torch.rand(1, 64, dtype=torch.float64, device=device)
    compiled = torch.compile(paint_then_read, fullgraph=True)
    results = []
    for fn in (paint_then_read, compiled):
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        out = fn(x, w)
        out.backward()
        results.append((out.detach(), x.grad, w.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e15])
def test_non_finite_or_absurd_positions_raise(device, bad):
    x = random_positions(1, 10, (4, 4, 4), torch.float64, device)
    x[0, 3, 2] = bad
    with pytest.raises(ValueError, match=r"1 of 10 particles.*particle 3 of batch 0"):
        torchpm.cic_paint(x, None, (4, 4, 4))
        torchpm.check()  # on CUDA the error is deferred by default
    with pytest.raises(ValueError, match=r"1 of 10 particles"):
        torchpm.cic_readout(torch.zeros(1, 4, 4, 4, dtype=torch.float64, device=device), x)
        torchpm.check()


@pytest.mark.parametrize(
    "positions_shape, match",
    [((10, 3), r"`positions` of shape \(B, N, 3\)"), ((1, 10, 2), r"`positions` of shape \(B, N, 3\)"), ((1, 1, 10, 3), "positions")],
)
def test_wrong_position_shapes_raise(device, positions_shape, match):
    x = torch.rand(positions_shape, device=device)
    with pytest.raises(ValueError, match=match):
        torchpm.cic_paint(x, None, (4, 4, 4))
    with pytest.raises(ValueError, match=match):
        torchpm.cic_readout(torch.zeros(1, 4, 4, 4, device=device), x)


def test_wrong_weights_and_mesh_raise(device):
    x = torch.rand(2, 10, 3, device=device)
    with pytest.raises(ValueError, match=r"`weights` of shape \(B, N\)"):
        torchpm.cic_paint(x, torch.ones(2, 9, device=device), (4, 4, 4))
    with pytest.raises(ValueError, match="`weights` to have the dtype of `positions`"):
        torchpm.cic_paint(x, torch.ones(2, 10, dtype=torch.float64, device=device), (4, 4, 4))
    with pytest.raises(ValueError, match="float32 or float64"):
        torchpm.cic_paint(x.to(torch.float16), None, (4, 4, 4))
    with pytest.raises(ValueError, match="float32 or float64"):
        torchpm.cic_paint((x * 4).long(), None, (4, 4, 4))
    with pytest.raises(ValueError, match=r"`mesh` of shape \(B, nx, ny, nz\)"):
        torchpm.cic_readout(torch.zeros(4, 4, 4, device=device), x)
    with pytest.raises(ValueError, match=r"with B = 2"):
        torchpm.cic_readout(torch.zeros(3, 4, 4, 4, device=device), x)
    with pytest.raises(ValueError, match="`mesh` to have the dtype"):
        torchpm.cic_readout(torch.zeros(2, 4, 4, 4, dtype=torch.float64, device=device), x)


@pytest.mark.parametrize("shape", [(0, 4, 4), (4, -1, 4), (4, 4), (4, 4, 4, 4), None])
def test_bad_mesh_sizes_raise(device, shape):
    x = torch.rand(1, 5, 3, device=device)
    with pytest.raises(ValueError, match="`shape`"):
        torchpm.cic_paint(x, None, shape)
    if shape is not None and len(shape) == 3:
        with pytest.raises(ValueError, match="`shape`"):
            torch.ops.torchpm.paint(x, None, list(shape), [0, 0, 0], [True] * 3)


def test_bad_geometry_arguments_raise():
    x = torch.rand(1, 5, 3)
    with pytest.raises(ValueError, match="`offset`"):
        torchpm.cic_paint(x, None, (4, 4, 4), offset=(0, 0))
    with pytest.raises(ValueError, match="`periodic`"):
        torchpm.cic_paint(x, None, (4, 4, 4), periodic=(True, False))


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torchpm.has_cuda_kernels()), reason="needs CUDA")
def test_device_mismatch_raises():
    x = torch.rand(1, 5, 3, device="cuda")
    with pytest.raises(RuntimeError, match="on the device of `positions`"):
        torchpm.cic_paint(x, torch.ones(1, 5), (4, 4, 4))
    with pytest.raises(RuntimeError, match="on the device of `positions`"):
        torchpm.cic_readout(torch.zeros(1, 4, 4, 4), x)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torchpm.has_cuda_kernels()), reason="needs CUDA")
def test_cuda_deterministic_mode():
    x = random_positions(1, 20000, (8, 8, 8), torch.float32, "cuda")
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="deterministic"):
            torch.ops.torchpm.paint(x, None, [8, 8, 8], [0, 0, 0], [True] * 3)
        first = torchpm.cic_paint(x, None, (8, 8, 8))
        second = torchpm.cic_paint(x, None, (8, 8, 8))
        # the readout's backward paints: it must take the deterministic path too
        mesh = torch.randn(1, 3, 8, 8, 8, device="cuda", requires_grad=True)
        torchpm.cic_readout(mesh, x).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, torchpm.cic_paint(x, None, (8, 8, 8)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mesh.grad, torchpm.cic_paint(x, torch.ones(1, x.shape[1], 3, device="cuda"), (8, 8, 8)), rtol=1e-5, atol=1e-4)


def test_build_reports_cuda_kernels_and_registers_cuda_dispatch():
    # Either real CUDA kernels or the helpful-error stubs are registered.
    for name in ("paint", "readout", "_position_gradient"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torchpm::{name}", "CUDA")
    assert torchpm.has_cuda_kernels() == (torch.version.cuda is not None)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_ops_library_is_the_loaded_library():
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if "libtorchpm_ops" in line}
    assert mapped == {os.path.realpath(torchpm.ops_library())}
