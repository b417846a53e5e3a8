"""Tests of the mass-assignment ops of every order (NGP, CIC, TSC, PCS): hand-computed
stencils, the pure-torch twin, an independent brute-force evaluation of the textbook
window functions in numpy, conservation and adjoint identities, gradcheck, opcheck,
torch.compile, halo widths, argument validation, window compensation and the aliasing
of a Poisson-sampled uniform field. Every device-dependent test runs on cpu and (when
available) cuda."""

import math

import numpy as np
import pytest
import torch

import torchpm
from torchpm.analysis import paint_density, power_spectrum
from torchpm.fourier import FourierKernels
from torchpm.ops import halo_widths, paint_reference, position_gradient_reference, readout_reference

ORDERS = ["ngp", "cic", "tsc", "pcs"]
WIDTH = {"ngp": 1, "cic": 2, "tsc": 3, "pcs": 4}
BLOCK = dict(shape=(9, 8, 10), offset=(3, -2, 0), periodic=(False, False, True))


def accepted_range(order, offset, n):
    """[lo, hi) of positions a block axis accepts (module docs of torchpm.ops.mass_assignment)."""
    p = WIDTH[order]
    return offset + p / 2 - 1, offset + n - p / 2


def random_positions(batch, count, order, shape, offset, periodic, dtype, device, seed=0, t_range=None):
    """Positions inside the accepted range of each axis (periodic axes: also outside
    [0, n) to exercise wrapping). ``t_range`` keeps the stencil fraction t away
    from the breakpoints of the piecewise polynomial weights (for gradchecks)."""
    g = torch.Generator().manual_seed(seed)
    p = WIDTH[order]
    columns = []
    for d in range(3):
        u = torch.rand(batch, count, generator=g, dtype=torch.float64)
        if periodic[d]:
            x = offset[d] + (3 * u - 1) * shape[d]
        else:
            lo, hi = accepted_range(order, offset[d], shape[d])
            x = lo + u * (hi - lo) * 0.999
        if t_range is not None:
            shift = 1 - p / 2
            first = torch.floor(x + shift)
            if not periodic[d]:
                first = first.clamp(max=math.floor(hi + shift - 1e-9))
            t = t_range[0] + (t_range[1] - t_range[0]) * torch.rand(batch, count, generator=g, dtype=torch.float64)
            x = first + t - shift
        columns.append(x)
    return torch.stack(columns, -1).to(dtype=dtype, device=device)


def geometry(mode, small=False):
    """Shape, offset and periodic flags of the periodic mesh or the block; ``small``
    for gradcheck and opcheck, whose cost grows with the number of mesh cells."""
    if mode == "periodic":
        return ((5, 4, 4) if small else (7, 6, 5)), (0, 0, 0), (True, True, True)
    if small:
        return (6, 5, 3), (3, -2, 0), (False, False, True)
    return BLOCK["shape"], BLOCK["offset"], BLOCK["periodic"]


# --------------------------------------------------------------------------- hand cases

# 1-D weights on nodes (relative to the particle's node j or cell), worked out by hand
# from the B-spline definitions.
HAND_1D = {
    # particle on node 2
    ("node", "ngp"): (2.0, {2: 1.0}),
    ("node", "cic"): (2.0, {2: 1.0}),
    ("node", "tsc"): (2.0, {1: 1 / 8, 2: 3 / 4, 3: 1 / 8}),
    ("node", "pcs"): (2.0, {1: 1 / 6, 2: 2 / 3, 3: 1 / 6}),
    # particle at a cell centre, 2.5 (NGP rounds half up)
    ("centre", "ngp"): (2.5, {3: 1.0}),
    ("centre", "cic"): (2.5, {2: 0.5, 3: 0.5}),
    ("centre", "tsc"): (2.5, {2: 0.5, 3: 0.5}),
    ("centre", "pcs"): (2.5, {1: 1 / 48, 2: 23 / 48, 3: 23 / 48, 4: 1 / 48}),
    # across the periodic boundary of an 8-node axis
    ("wrap", "ngp"): (7.75, {0: 1.0}),
    ("wrap", "cic"): (7.75, {7: 0.25, 0: 0.75}),
    ("wrap", "tsc"): (7.75, {7: 0.5 * 0.75**2, 0: 0.75 - 0.25**2, 1: 0.5 * 0.25**2}),
    ("wrap", "pcs"): (
        7.25,
        {6: 0.75**3 / 6, 7: (4 - 6 * 0.25**2 + 3 * 0.25**3) / 6, 0: (4 - 6 * 0.75**2 + 3 * 0.75**3) / 6, 1: 0.25**3 / 6},
    ),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("case", ["node", "centre", "wrap"])
def test_hand_computed_stencils(device, order, case):
    x1, nodes = HAND_1D[(case, order)]
    # the same 1-D case along x, a node along y (so its weights are those of "node"), z the wrap
    y1, ynodes = HAND_1D[("node", order)]
    z1, znodes = HAND_1D[("wrap", order)]
    x = torch.tensor([[[x1, y1 + 3, z1]]], dtype=torch.float64, device=device)
    mesh = torchpm.paint(x, None, (8, 8, 8), order=order).cpu()
    expected = torch.zeros(1, 8, 8, 8, dtype=torch.float64)
    for i, wi in nodes.items():
        for j, wj in ynodes.items():
            for k, wk in znodes.items():
                expected[0, i, j + 3, k] += wi * wj * wk
    torch.testing.assert_close(mesh, expected, rtol=0, atol=1e-15)
    field = torch.randn(1, 8, 8, 8, dtype=torch.float64)
    value = torchpm.readout(field.to(device), x, order=order).cpu()
    torch.testing.assert_close(value, (expected * field).sum().view(1, 1), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("order", ORDERS)
def test_block_edges_accept_exactly_the_documented_range(device, order):
    shape, offset, periodic = (6, 4, 4), (3, 0, 0), (False, True, True)
    lo, hi = accepted_range(order, 3, 6)
    inside = torch.tensor([[[lo, 1.0, 1.0], [hi - 1e-9, 1.0, 1.0]]], dtype=torch.float64, device=device)
    mesh = torchpm.paint(inside, None, shape, order=order, offset=offset, periodic=periodic).cpu()
    assert mesh.sum().item() == pytest.approx(2.0, rel=1e-14)
    # at the lower edge the first node is the block's first plane, with weight the
    # 1-D weight of t = 0 for that order
    first_weight = {"ngp": 1.0, "cic": 1.0, "tsc": 0.5, "pcs": 1 / 6}[order]
    assert mesh[0, 0].sum().item() == pytest.approx(first_weight, rel=1e-12)
    for bad in (lo - 1e-9, hi):
        outside = torch.tensor([[[4.0 + WIDTH[order] / 2, 1.0, 1.0], [bad, 1.0, 1.0]]], dtype=torch.float64, device=device)
        with pytest.raises(ValueError, match=r"1 of 2 particles.*particle 1 of batch 0.*halo_widths"):
            torchpm.paint(outside, None, shape, order=order, offset=offset, periodic=periodic)
            torchpm.check()  # on CUDA the error is deferred by default
        with pytest.raises(ValueError, match="1 of 2 particles"):
            torchpm.readout(torch.zeros(1, *shape, dtype=torch.float64, device=device), outside, order=order,
                            offset=offset, periodic=periodic)
            torchpm.check()


@pytest.mark.parametrize("order", ORDERS)
def test_halo_widths_cover_the_owned_interval_and_are_tight(order):
    below, above = halo_widths(order)
    assert (below, above) == {"ngp": (0, 1), "cic": (0, 1), "tsc": (1, 2), "pcs": (1, 2)}[order]
    o, n = 5, 4
    # a dense set of coordinates in [o, o + n), including both ends (o + n minus rounding)
    xs = torch.cat([torch.linspace(o, o + n, 4001, dtype=torch.float64)[:-1], torch.tensor([o + n - 1e-12], dtype=torch.float64)])
    x = torch.stack([xs, torch.ones_like(xs), torch.ones_like(xs)], -1).unsqueeze(0)
    shape, periodic = (n + below + above, 3, 3), (False, True, True)
    mesh = torchpm.paint(x, None, shape, order=order, offset=(o - below, 0, 0), periodic=periodic)
    assert mesh.sum().item() == pytest.approx(xs.numel(), rel=1e-13)
    # one cell less on either side rejects some owned particle
    if below > 0:
        with pytest.raises(ValueError, match="cannot be deposited"):
            torchpm.paint(x, None, (n + below - 1 + above, 3, 3), order=order, offset=(o - below + 1, 0, 0), periodic=periodic)
    with pytest.raises(ValueError, match="cannot be deposited"):
        torchpm.paint(x, None, (n + below + above - 1, 3, 3), order=order, offset=(o - below, 0, 0), periodic=periodic)


# --------------------------------------------------------------------------- an independent evaluation


def textbook_window(s, order):
    """The mass-assignment kernels of Hockney & Eastwood as functions of the distance
    s (cells) between particle and node, written directly from their definitions."""
    s = np.abs(s)
    if order == "ngp":
        return (s < 0.5).astype(float)
    if order == "cic":
        return np.where(s < 1, 1 - s, 0.0)
    if order == "tsc":
        return np.where(s < 0.5, 0.75 - s**2, np.where(s < 1.5, 0.5 * (1.5 - s) ** 2, 0.0))
    return np.where(s < 1, (4 - 6 * s**2 + 3 * s**3) / 6, np.where(s < 2, (2 - s) ** 3 / 6, 0.0))


@pytest.mark.parametrize("order", ORDERS)
def test_paint_matches_textbook_windows_evaluated_by_brute_force(device, order):
    # pylians (MAS_library) did not install on this machine within 5 minutes; this
    # evaluates the textbook kernels at every (particle, node) pair with the minimum
    # image distance, independently of both the kernels and the pure-torch twin.
    shape = (6, 5, 7)
    rng = np.random.default_rng(1)
    x = rng.uniform(-3, 10, size=(40, 3))
    if order == "ngp":  # keep away from the ties at half-integers
        frac = x - np.floor(x)
        x = np.where(np.abs(frac - 0.5) < 1e-3, x + 0.01, x)
    w = rng.uniform(0.5, 2.0, size=40)
    expected = np.ones((40,) + shape)
    for d, n in enumerate(shape):
        nodes = np.arange(n)
        s = x[:, d : d + 1] - nodes[None, :]
        s = s - n * np.round(s / n)  # minimum image
        factor = textbook_window(s, order)
        expected = expected * np.expand_dims(factor, tuple(a + 1 for a in range(3) if a != d))
    expected = np.tensordot(w, expected, axes=1)
    positions = torch.tensor(x, dtype=torch.float64, device=device).unsqueeze(0)
    weights = torch.tensor(w, dtype=torch.float64, device=device).unsqueeze(0)
    mesh = torchpm.paint(positions, weights, shape, order=order)[0].cpu().numpy()
    np.testing.assert_allclose(mesh, expected, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- twin agreement

TOLERANCES = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["periodic", "block"])
@pytest.mark.parametrize("channels", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_paint_readout_and_position_gradient_match_the_twin(device, order, mode, channels, dtype):
    shape, offset, periodic = geometry(mode)
    p = WIDTH[order]
    count = 9
    x = random_positions(2, count, order, shape, offset, periodic, dtype, device)
    g = torch.Generator().manual_seed(1)
    wshape = (2, count) if channels is None else (2, count, channels)
    w = torch.rand(wshape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    mesh = torchpm.paint(x, w, shape, order=order, offset=offset, periodic=periodic)
    ref = paint_reference(x, w, shape, offset, periodic, p)
    scale = ref.abs().max()
    torch.testing.assert_close(mesh / scale, ref / scale, **TOLERANCES[dtype])
    fshape = (2, *shape) if channels is None else (2, channels, *shape)
    field = torch.randn(fshape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    values = torchpm.readout(field, x, order=order, offset=offset, periodic=periodic)
    torch.testing.assert_close(values, readout_reference(field, x, offset, periodic, p), **TOLERANCES[dtype])
    grad = torch.ops.torchpm._position_gradient(field, x, w, offset, periodic, p)
    ref_grad = position_gradient_reference(field, x, w, offset, periodic, p)
    torch.testing.assert_close(grad, ref_grad, **TOLERANCES[dtype])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["periodic", "block"])
def test_binned_parallel_paint_and_chunked_readout_match_the_twin(device, order, mode):
    # 2 x 20 000 particles: above the CPU kernel's serial limit (the binned path)
    shape, offset, periodic = geometry(mode)
    if mode == "periodic":
        shape = (13, 6, 5)  # not a multiple of 3 or 4: tail planes after the phases
    p = WIDTH[order]
    x = random_positions(2, 20_000, order, shape, offset, periodic, torch.float64, device, seed=4)
    w = torch.rand(2, 20_000, dtype=torch.float64, device=device)
    mesh = torchpm.paint(x, w, shape, order=order, offset=offset, periodic=periodic)
    torch.testing.assert_close(mesh, paint_reference(x, w, shape, offset, periodic, p), rtol=1e-12, atol=1e-12)
    field = torch.randn(2, *shape, dtype=torch.float64, device=device)
    torch.testing.assert_close(
        torchpm.readout(field, x, order=order, offset=offset, periodic=periodic),
        readout_reference(field, x, offset, periodic, p),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["periodic", "block"])
@pytest.mark.parametrize("channels,readout_channels", [(None, 1), (4, 3), (3, 0), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_readout_and_position_gradient_equal_the_separate_ops(
    device, order, mode, channels, readout_channels, dtype
):
    # The adjoint's reverse step relies on the fused readout giving the forward
    # pass's forces bit for bit; 3000 particles span several parallel chunks.
    shape, offset, periodic = geometry(mode)
    p = WIDTH[order]
    count = 3000
    x = random_positions(2, count, order, shape, offset, periodic, dtype, device, seed=7)
    g = torch.Generator().manual_seed(8)
    fshape = (2, *shape) if channels is None else (2, channels, *shape)
    vshape = (2, count) if channels is None else (2, count, channels)
    field = torch.randn(fshape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    values = torch.randn(vshape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    read, grad = torch.ops.torchpm._readout_and_position_gradient(
        field, x, values, readout_channels, offset, periodic, p
    )
    assert read.shape == (2, count, readout_channels) and grad.shape == (2, count, 3)
    separate = torch.ops.torchpm._position_gradient(field, x, values, offset, periodic, p)
    assert torch.equal(grad, separate)
    torch.testing.assert_close(grad, position_gradient_reference(field, x, values, offset, periodic, p), **TOLERANCES[dtype])
    if readout_channels:
        part = field if channels is None else field[:, :readout_channels]
        expected = torchpm.readout(part, x, order=order, offset=offset, periodic=periodic)
        assert torch.equal(read, expected.reshape(2, count, readout_channels))


def _copies(fn):
    """Names of the copy ops ``fn()`` dispatches (aten::copy_, clone, contiguous)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["periodic", "block"])
@pytest.mark.parametrize("channels", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_interleaved_meshes_are_read_in_place_with_the_planar_bits(device, order, mode, channels, dtype):
    # A mesh in channels_last_3d (a node's channels side by side: the fd4 force
    # field's layout) is read in place by the readout, the position gradient and
    # the fused op, with exactly the planar mesh's results. A slice of one has
    # channels-last strides and is copied into that layout; other strides are
    # copied planar; all give the same bits.
    shape, offset, periodic = geometry(mode)
    p = WIDTH[order]
    count = 3000
    x = random_positions(2, count // 2, order, shape, offset, periodic, dtype, device, seed=11)
    # The second half in (x, y) cell order: the CPU gather's coherent path (module
    # docs of test_coherent_and_scattered_particle_runs_match_the_twin).
    key = torch.floor(x[..., 0]) * 4096 + torch.floor(x[..., 1])
    x = torch.cat([x, torch.gather(x, 1, key.argsort(dim=1).unsqueeze(-1).expand(-1, -1, 3))], dim=1)
    g = torch.Generator().manual_seed(12)
    planar = torch.randn(2, channels, *shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    values = torch.randn(2, count, channels, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    interleaved = planar.contiguous(memory_format=torch.channels_last_3d)
    assert interleaved.stride(1) == 1
    wide = torch.randn(2, channels + 1, *shape, dtype=dtype, device=device).contiguous(
        memory_format=torch.channels_last_3d)
    wide[:, 1:] = planar
    sliced = wide[:, 1:]  # channels-last strides, not dense
    assert not sliced.is_contiguous(memory_format=torch.channels_last_3d)
    other = planar.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)  # y outside x: neither layout
    ops = torch.ops.torchpm
    read = ops.readout(planar, x, offset, periodic, p, True)
    grad = ops._position_gradient(planar, x, values, offset, periodic, p)
    k = min(channels, 3)
    fused = ops._readout_and_position_gradient(planar, x, values, k, offset, periodic, p)
    for name, mesh in (("interleaved", interleaved), ("sliced", sliced), ("other", other)):
        assert torch.equal(ops.readout(mesh, x, offset, periodic, p, True), read), name
        assert torch.equal(ops._position_gradient(mesh, x, values, offset, periodic, p), grad), name
        got = ops._readout_and_position_gradient(mesh, x, values, k, offset, periodic, p)
        assert torch.equal(got[0], fused[0]) and torch.equal(got[1], fused[1]), name
    torch.testing.assert_close(read, readout_reference(planar, x, offset, periodic, p), **TOLERANCES[dtype])
    if device == "cpu":  # the profiler sees the kernels' own ATen calls on the CPU
        assert _copies(lambda: ops.readout(interleaved, x, offset, periodic, p, True)) == []
        assert _copies(lambda: ops._readout_and_position_gradient(interleaved, x, values, k, offset, periodic, p)) == []
        assert _copies(lambda: ops.readout(other, x, offset, periodic, p, True)) != []


def test_fused_readout_and_position_gradient_validates_and_checks(device):
    shape, offset, periodic = geometry("periodic")
    x = random_positions(1, 5, "cic", shape, offset, periodic, torch.float64, device)
    field = torch.randn(1, 3, *shape, dtype=torch.float64, device=device)
    values = torch.randn(1, 5, 3, dtype=torch.float64, device=device)
    op = torch.ops.torchpm._readout_and_position_gradient
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="readout_channels"):
            op(field, x, values, bad, offset, periodic, 2)
    torch.library.opcheck(
        op.default, (field, x, values, 2, list(offset), list(periodic), 2),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )
    # A particle outside the mesh is an error, never a silently dropped force.
    bad_x = x.clone()
    bad_x[0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"1 of 5 particles .*non-finite .*`positions`"):
        op(field, bad_x, values, 3, offset, periodic, 2)
        torchpm.check()  # deferred mode (CUDA): the report comes here


@pytest.mark.parametrize("order", ORDERS)
def test_coherent_and_scattered_particle_runs_match_the_twin(device, order):
    # The CPU gather visits runs of particles that stay within a few cells in x
    # and y directly and prefetches for any other run: a jittered lattice in
    # Lagrangian order (runs along z, wrapping through the periodic edges) with a
    # shuffled stretch in the middle exercises both paths and the switches.
    shape = (12, 10, 16)
    p = WIDTH[order]
    g = torch.Generator().manual_seed(11)
    lattice = torch.stack(torch.meshgrid(*[torch.arange(n, dtype=torch.float64) for n in shape], indexing="ij"), -1)
    x = (lattice.reshape(1, -1, 3) + 0.6 * torch.rand(1, lattice[..., 0].numel(), 3, generator=g) - 0.3)
    middle = slice(700, 1300)
    x[:, middle] = x[:, middle][:, torch.randperm(600, generator=g)]
    x = x.to(device)
    field = torch.randn(1, 3, *shape, generator=g, dtype=torch.float64).to(device)
    values = torch.randn(1, x.shape[1], 3, generator=g, dtype=torch.float64).to(device)
    geo = ((0, 0, 0), (True, True, True))
    torch.testing.assert_close(
        torchpm.readout(field, x, order=order), readout_reference(field, x, *geo, p), rtol=1e-12, atol=1e-12
    )
    read, grad = torch.ops.torchpm._readout_and_position_gradient(field, x, values, 3, *geo, p)
    torch.testing.assert_close(read, readout_reference(field, x, *geo, p), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, position_gradient_reference(field, x, values, *geo, p), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("order", ["tsc", "pcs"])
def test_cpu_paint_does_not_depend_on_thread_count(order):
    # odd periodic x (not a multiple of the width): the tail planes go in a phase of their own
    for nx in (13, 14):
        shape = (nx, 8, 8)
        x = random_positions(1, 40_000, order, shape, (0, 0, 0), (True,) * 3, torch.float32, "cpu", seed=2)
        w = torch.rand(x.shape[:2])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            serial = torchpm.paint(x, w, shape, order=order)
            torch.set_num_threads(max(2, threads))
            parallel = torchpm.paint(x, w, shape, order=order)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(serial, parallel)


def _spline_weights(t, width):
    """bspline_weights (csrc/stencil.h) with its operations in its order, so that in
    IEEE arithmetic they give its bits: (W, ...) weights of fractions t."""
    one, u = torch.ones_like(t), 1 - t
    if width == 1:
        return one.unsqueeze(0)
    if width == 2:
        return torch.stack([u, t])
    if width == 3:
        half = torch.full_like(t, 0.5)
        return torch.stack([half * u * u, 0.75 - (t - 0.5) * (t - 0.5), half * t * t])
    sixth = one / 6
    return torch.stack([sixth * u * u * u, sixth * ((4 - 6 * t * t) + 3 * t * t * t),
                        sixth * ((4 - 6 * u * u) + 3 * u * u * u), sixth * t * t * t])


def paint_in_particle_order(x, w, shape, offset, periodic, width):
    """Paint that adds every particle's contribution to each of its nodes one particle
    after another, as a serial loop would, with the kernel's rounding: each node's
    contributions are sorted by particle (stable) and added in rounds, the r-th
    contribution of every node in round r. (B, C, *shape) like the op."""
    batch, count, _ = x.shape
    channels = 1 if w is None else (1 if w.dim() == 2 else w.shape[2])
    values = torch.ones(batch, count, 1, dtype=x.dtype) if w is None else (w.unsqueeze(2) if w.dim() == 2 else w)
    shift = 1 - width / 2
    nodes, weights = [], []
    for d in range(3):
        shifted = x[..., d] + shift
        floor = torch.floor(shifted)
        t = shifted - floor
        first = floor.long() - offset[d]
        k = torch.arange(width)
        node = first.unsqueeze(-1) + k
        if periodic[d]:
            node = node % shape[d]
        nodes.append(node)  # (B, N, W)
        weights.append(_spline_weights(t, width).movedim(0, -1))  # (B, N, W)
    cells = math.prod(shape)
    mesh = torch.zeros(batch * channels * cells, dtype=x.dtype)
    a, b, c = torch.meshgrid(*(torch.arange(width),) * 3, indexing="ij")
    a, b, c = a.reshape(-1), b.reshape(-1), c.reshape(-1)
    index = (nodes[0][..., a] * shape[1] + nodes[1][..., b]) * shape[2] + nodes[2][..., c]  # (B, N, W^3)
    wab = weights[0][..., a] * weights[1][..., b]
    for ch in range(channels):
        contribution = values[..., ch : ch + 1] * (wab * weights[2][..., c])  # (B, N, W^3)
        target = (torch.arange(batch).view(batch, 1, 1) * channels + ch) * cells + index
        target, contribution = target.reshape(-1), contribution.reshape(-1)  # particle-major
        order = torch.sort(target, stable=True).indices
        target, contribution = target[order], contribution[order]
        start = torch.ones_like(target, dtype=torch.bool)
        start[1:] = target[1:] != target[:-1]
        group = torch.cumsum(start.long(), 0) - 1
        first_of_group = torch.nonzero(start).squeeze(1)
        rank = torch.arange(target.numel()) - first_of_group[group]
        by_round = torch.sort(rank, stable=True)
        target, contribution = target[by_round.indices], contribution[by_round.indices]
        bounds = torch.searchsorted(by_round.values, torch.arange(int(rank.max()) + 2)).tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            mesh[target[lo:hi]] = mesh[target[lo:hi]] + contribution[lo:hi]
    return mesh.reshape(batch, channels, *shape)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["periodic", "block"])
@pytest.mark.parametrize("channels", [None, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_paint_of_ordered_particles_adds_in_particle_order(order, mode, channels, dtype):
    # Particles in spatial order (the simulation's), 2 x 40 000: above the serial
    # limit, painted by plane ownership, whose every node receives its contributions
    # in particle order, bit for bit whatever the thread count. The order is rolled
    # so that one chunk holds particles on both sides of the periodic seam.
    shape, offset, periodic = geometry(mode)
    if mode == "periodic":
        shape = (13, 6, 5)
    width = WIDTH[order]
    count = 40_000
    x = random_positions(2, count, order, shape, offset, periodic, torch.float64, "cpu", seed=11)
    key = torch.floor(x + (1 - width / 2)) - torch.tensor(offset)
    for d in range(3):
        if periodic[d]:
            key[..., d] %= shape[d]
    key = (key[..., 0] * shape[1] + key[..., 1]) * shape[2] + key[..., 2]
    spatial = torch.roll(torch.sort(key, dim=1, stable=True).indices, 50, dims=1)
    x = torch.gather(x, 1, spatial.unsqueeze(-1).expand(-1, -1, 3)).to(dtype)
    g = torch.Generator().manual_seed(12)
    w = None if channels is None else torch.rand(2, count, channels, generator=g, dtype=torch.float64).to(dtype)
    mesh = _assert_painted_in_particle_order(x, w, shape, offset, periodic, order)
    # the float64 twin, to its rounding
    reference = paint_reference(x.double(), None if w is None else w.double(), shape, offset, periodic, width)
    torch.testing.assert_close(mesh.double().reshape(reference.shape), reference,
                               rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-4 if dtype == torch.float32 else 1e-11)


@pytest.mark.parametrize("order", ["cic", "tsc", "pcs"])
def test_cpu_paint_of_dispersed_lagrangian_particles_in_a_thin_block_adds_in_particle_order(order):
    # A rank's slab of 36 x planes (non-periodic x, as on a process grid) holding
    # particles in Lagrangian (lattice) order that have moved up to 1.25 planes: the
    # chunks of 128 consecutive particles span a few planes, as late in a run. Plane
    # ownership still paints them fastest (measured on 64^3 on 2 ranks: 1.9 ms against
    # 3.9 ms for the counting sort), so they must take it: every node then receives its
    # contributions in particle order, which the counting sort by plane would not give.
    width = WIDTH[order]
    shape, offset, periodic = (36, 6, 5), (10, 0, 0), (False, True, True)
    count = 40_000
    g = torch.Generator().manual_seed(31)
    lo, hi = accepted_range(order, offset[0], shape[0])
    lagrangian = torch.arange(count, dtype=torch.float64) * (hi - lo) / count + lo
    x = torch.rand(2, count, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 6.0, 5.0])
    x[..., 0] = (lagrangian + (x[..., 0] - 0.5) * 2.5).clamp(lo, hi - 1e-3)
    x = x.to(torch.float32)
    # The regime: chunks wider on average than the old limit max(W + 2, nx / 8),
    # within the new one max(2 W + 2, nx / 8).
    nodes = torch.floor(x[..., 0].double() + 1 - width / 2) - offset[0]
    chunks = nodes[:, : count // 128 * 128].reshape(-1, 128)
    mean_length = float((chunks.max(1).values - chunks.min(1).values + width).mean())
    assert max(width + 2, shape[0] // 8) < mean_length <= max(2 * width + 2, shape[0] // 8), mean_length
    w = torch.rand(2, count, generator=g, dtype=torch.float64).to(torch.float32)
    by_plane = _sorted_by_plane(x, w, width)
    assert not torch.equal(paint_in_particle_order(*by_plane, shape, offset, periodic, width),
                           paint_in_particle_order(x, w, shape, offset, periodic, width)), (
        "the test cannot tell the two summation orders apart")
    _assert_painted_in_particle_order(x, w, shape, offset, periodic, order)


def _sorted_by_plane(x, w, width):
    """Particles stably sorted by their first x node: the counting sort's order."""
    node = torch.floor(x[..., 0].double() + 1 - width / 2)
    order = torch.sort(node, dim=1, stable=True).indices
    return torch.gather(x, 1, order.unsqueeze(-1).expand(-1, -1, 3)), torch.gather(w, 1, order)


def _assert_painted_in_particle_order(x, w, shape, offset, periodic, order):
    """The CPU paint on 1 and 3 threads equals, bit for bit, every node's contributions
    added in particle order (paint_in_particle_order). Returns the painted mesh."""
    expected = paint_in_particle_order(x, w, shape, offset, periodic, WIDTH[order])
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            mesh = torchpm.paint(x, w, shape, order=order, offset=offset, periodic=periodic)
            mesh = mesh.reshape(expected.shape)
            assert torch.equal(mesh, expected), (n_threads, (mesh - expected).abs().max())
    finally:
        torch.set_num_threads(threads)
    return mesh


# --------------------------------------------------------------------------- identities


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["periodic", "block"])
def test_mass_conservation_and_adjoint_identity(device, order, mode):
    shape, offset, periodic = geometry(mode)
    x = random_positions(2, 3000, order, shape, offset, periodic, torch.float64, device, seed=3)
    generator = torch.Generator().manual_seed(4)
    w = torch.rand(2, 3000, dtype=torch.float64, generator=generator).to(device)
    mesh = torchpm.paint(x, w, shape, order=order, offset=offset, periodic=periodic)
    torch.testing.assert_close(mesh.sum(dim=(1, 2, 3)), w.sum(1), rtol=1e-13, atol=0)
    f = torch.randn(2, *shape, dtype=torch.float64, generator=generator).to(device)
    lhs = (mesh * f).sum().item()
    rhs = (w * torchpm.readout(f, x, order=order, offset=offset, periodic=periodic)).sum().item()
    # f has both signs, so <mesh, f> can cancel: the rounding scales with the sum of |terms|.
    scale = (mesh.abs() * f.abs()).sum().item()
    assert abs(lhs - rhs) <= 1e-12 * scale, (lhs, rhs, scale)


def test_small_periodic_mesh_wraps_a_wide_stencil_several_times(device):
    # a 2-node axis with PCS: 4 nodes wrap onto 2, weights add up
    x = torch.tensor([[[0.3, 0.0, 0.0]]], dtype=torch.float64, device=device)
    mesh = torchpm.paint(x, None, (2, 1, 1), order="pcs")
    assert mesh.sum().item() == pytest.approx(1.0, rel=1e-14)
    torch.testing.assert_close(mesh, paint_reference(x, None, (2, 1, 1), order=4))


# --------------------------------------------------------------------------- gradients


def gradcheck_positions(order, mode, count, device, seed=5):
    shape, offset, periodic = geometry(mode, small=True)
    return random_positions(1, count, order, shape, offset, periodic, torch.float64, device, seed, t_range=(0.1, 0.9))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["periodic", "block"])
def test_gradcheck_every_input(device, order, mode):
    shape, offset, periodic = geometry(mode, small=True)
    x = gradcheck_positions(order, mode, 5, device).requires_grad_(True)
    w = torch.rand(1, 5, 2, dtype=torch.float64, device=device, requires_grad=True)
    mesh = torch.randn(1, 2, *shape, dtype=torch.float64, device=device, requires_grad=True)
    geo = dict(order=order, offset=offset, periodic=periodic)
    assert torch.autograd.gradcheck(lambda x, w: torchpm.paint(x, w, shape, **geo), (x, w), eps=1e-6, atol=1e-8)
    assert torch.autograd.gradcheck(lambda m, x: torchpm.readout(m, x, **geo), (mesh, x), eps=1e-6, atol=1e-8)
    assert torch.autograd.gradgradcheck(lambda m, x: torchpm.readout(m, x, **geo), (mesh, x), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradgradcheck(lambda x, w: torchpm.paint(x, w, shape, **geo), (x, w), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("order", ["cic", "tsc", "pcs"])
@pytest.mark.parametrize("mode", ["periodic", "block"])
def test_second_derivatives_of_nonlinear_losses(device, order, mode):
    # gradgradcheck draws its cotangents independently of the inputs; in a Hessian-vector
    # product or a gradient penalty the cotangent of paint or readout depends on the same
    # positions (here sum(paint(x)**2): 2 paint(x)). The gradient of such a loss, as a
    # function of every input, against its numerical Jacobian (second derivatives),
    # and against the double backward of the pure-torch twins.
    shape, offset, periodic = geometry(mode, small=True)
    geo = dict(order=order, offset=offset, periodic=periodic)
    number = {"cic": 2, "tsc": 3, "pcs": 4}[order]
    x = gradcheck_positions(order, mode, 5, device).requires_grad_(True)
    w = torch.rand(1, 5, 2, dtype=torch.float64, device=device, requires_grad=True)
    mesh = torch.randn(1, 2, *shape, dtype=torch.float64, device=device, requires_grad=True)

    def paint_loss(paint):
        return lambda x, w: torch.autograd.grad((paint(x, w) ** 2).sum(), (x, w), create_graph=True)

    def readout_loss(readout):
        return lambda m, x: torch.autograd.grad((readout(m, x) ** 2).sum(), (m, x), create_graph=True)

    ours_paint = paint_loss(lambda x, w: torchpm.paint(x, w, shape, **geo))
    ours_readout = readout_loss(lambda m, x: torchpm.readout(m, x, **geo))
    assert torch.autograd.gradcheck(ours_paint, (x, w), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(ours_readout, (mesh, x), eps=1e-6, atol=1e-7)
    twin_paint = paint_loss(lambda x, w: paint_reference(x, w, shape, offset, periodic, number))
    twin_readout = readout_loss(lambda m, x: readout_reference(m, x, offset, periodic, number))
    for ours, twin, inputs in ((ours_paint, twin_paint, (x, w)), (ours_readout, twin_readout, (mesh, x))):
        direction = [torch.randn_like(t) for t in inputs]

        def hvp(function):
            first = function(*inputs)
            dot = sum((g * d).sum() for g, d in zip(first, direction))
            return torch.autograd.grad(dot, inputs)

        for got, expected in zip(hvp(ours), hvp(twin)):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_ngp_position_gradient_is_zero(device):
    shape = (6, 6, 6)
    x = gradcheck_positions("ngp", "periodic", 20, device).requires_grad_(True)
    mesh = torch.randn(1, *shape, dtype=torch.float64, device=device)
    (grad,) = torch.autograd.grad(torchpm.readout(mesh, x, order="ngp").sum(), x)
    assert torch.equal(grad, torch.zeros_like(grad))


# --------------------------------------------------------------------------- opcheck / compile


@pytest.mark.parametrize("order", [1, 3, 4])
def test_opcheck(device, order):
    shape, offset, periodic = geometry("block", small=True)
    x = gradcheck_positions(WIDTH_NAME[order], "block", 6, device)
    w = torch.rand(1, 6, 3, dtype=torch.float64, device=device)
    m = torch.randn(1, 3, *shape, dtype=torch.float64, device=device)
    ops = torch.ops.torchpm
    geo = (list(offset), list(periodic), order)
    cases = [
        (ops.paint.default, (x, w, list(shape), *geo, True)),
        (ops.paint.default, (x, None, list(shape), *geo, True)),
        (ops.readout.default, (m, x, *geo, True)),
        (ops._position_gradient.default, (m, x, w, *geo)),
    ]
    for op, args in cases:
        grad_args = tuple(a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args)
        for case in (args, grad_args):
            torch.library.opcheck(op, case)


WIDTH_NAME = {v: k for k, v in WIDTH.items()}


def test_torch_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    shape = (8, 8, 8)

    def paint_then_read(x, w):
        rho = torchpm.paint(x, w, shape, order="tsc")
        force = torch.stack([rho, 2 * rho, rho * rho], dim=1)
        return torchpm.readout(force, x, order="pcs").sum() + torchpm.readout(rho, x, order="ngp").sum()

    x0 = random_positions(1, 64, "pcs", shape, (0, 0, 0), (True,) * 3, torch.float64, device, t_range=(0.1, 0.9))
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


# --------------------------------------------------------------------------- bad input (issue 11)

X = torch.rand(1, 5, 3) * 4


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(offset=(0.5, 0, 0)), TypeError, r"`offset` must be.*0\.5.*not rounded"),
        (dict(offset=(float("nan"), 0, 0)), TypeError, "`offset`"),
        (dict(offset=(float("inf"), 0, 0)), TypeError, "`offset`"),
        (dict(offset=0), TypeError, r"`offset` must be None or 3 integers.*got 0"),
        (dict(offset=(0, 0)), ValueError, "`offset` must have 3 entries"),
        (dict(periodic="FFF"), TypeError, r"`periodic` must be a bool or 3 bools, got 'FFF'"),
        (dict(periodic=None), TypeError, "`periodic` must be a bool or 3 bools, got None"),
        (dict(periodic=(1, 0, 1)), TypeError, "`periodic`"),
        (dict(order="quadratic"), ValueError, "`order` must be one of"),
        (dict(order=5), ValueError, "`order`"),
        (dict(order=True), TypeError, "`order`"),
        (dict(check_finite="no"), TypeError, "`check_finite` must be a bool"),
    ],
)
def test_bad_geometry_arguments_raise_clearly(kwargs, error, match):
    with pytest.raises(error, match=match):
        torchpm.paint(X, None, (4, 4, 4), **kwargs)
    if "check_finite" not in kwargs:
        with pytest.raises(error, match=match):
            torchpm.readout(torch.zeros(1, 4, 4, 4), X, **kwargs)


@pytest.mark.parametrize(
    "shape, error, match",
    [
        ((4.7, 4, 4), TypeError, r"`shape` must be 3 positive integers.*4\.7"),
        ((4.0, 4, 4), TypeError, "`shape`"),
        ("444", TypeError, "`shape`"),
        ((2**31,) * 3, ValueError, "below 2\\^31"),
        ((0, 4, 4), ValueError, "`shape`"),
    ],
)
def test_bad_shapes_raise_clearly(shape, error, match):
    with pytest.raises(error, match=match):
        torchpm.paint(X, None, shape)


def test_huge_meshes_are_refused_before_allocating():
    with pytest.raises(ValueError, match="would need .* bytes"):
        torch.ops.torchpm.paint(X, None, [2**30, 2**30, 2**20], [0, 0, 0], [True] * 3)
    with pytest.raises(ValueError, match="below 2\\^31"):
        torch.ops.torchpm.paint(X, None, [2**31, 4, 4], [0, 0, 0], [True] * 3)


def test_integer_like_arguments_are_accepted():
    ref = torchpm.paint(X, None, (4, 4, 4), offset=(1, 0, 0), periodic=True)
    out = torchpm.paint(X, None, np.array([4, 4, 4]), offset=(np.int64(1), 0, torch.tensor(0)), periodic=np.bool_(True))
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("positions", [X.numpy(), X.tolist()])
def test_non_tensor_positions_raise_a_type_error(positions):
    with pytest.raises(TypeError, match=r"`positions` must be a torch.Tensor.*torch.as_tensor"):
        torchpm.paint(positions, None, (4, 4, 4))
    with pytest.raises(TypeError, match="`positions` must be a torch.Tensor"):
        torchpm.readout(torch.zeros(1, 4, 4, 4), positions)
    with pytest.raises(TypeError, match="`mesh` must be a torch.Tensor"):
        torchpm.readout(np.zeros((1, 4, 4, 4)), X)


@pytest.mark.parametrize("order", ["cic", "pcs"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_and_meshes_raise(device, order, bad):
    x = X.to(torch.float64).to(device)
    w = torch.ones(1, 5, 2, dtype=torch.float64, device=device)
    w[0, 3, 1] = bad
    with pytest.raises(ValueError, match=r"`weights` contains NaN or Inf.*particle 3 of batch 0"):
        torchpm.paint(x, w, (4, 4, 4), order=order)
        torchpm.check()  # on CUDA the error is deferred by default
    assert not torch.isfinite(torchpm.paint(x, w, (4, 4, 4), order=order, check_finite=False)).all()
    mesh = torch.zeros(1, 4, 4, 4, dtype=torch.float64, device=device)
    nodes = torchpm.paint(x[:, 2:3], None, (4, 4, 4), order=order) > 0
    mesh[nodes] = bad  # only particle 2's stencil (and maybe others sharing its nodes)
    with pytest.raises(ValueError, match="`mesh` contains NaN or Inf"):
        torchpm.readout(mesh, x, order=order)
        torchpm.check()
    assert not torch.isfinite(torchpm.readout(mesh, x, order=order, check_finite=False)).all()
    # a NaN far from every particle is not read, hence no error
    far = torch.zeros(1, 8, 8, 8, dtype=torch.float64, device=device)
    far[0, 7, 7, 7] = bad
    near = torch.full((1, 5, 3), 3.0, dtype=torch.float64, device=device)
    assert torch.isfinite(torchpm.readout(far, near, order=order)).all()


def _rows_at_the_top_corner(n, rows, dtype, device, generator):
    """Particles in spatial order along z rows of 16 (the readout's coherent chunks, read
    straight from the block's nodes) around the last node of an n^3 mesh, some of them
    one period outside the box."""
    base = torch.tensor([n - 0.7, n - 0.4, 0.0], dtype=torch.float64)
    rows_xyz = []
    for r in range(rows):
        z = torch.sort(torch.rand(16, generator=generator, dtype=torch.float64) * 3.0 + (n - 2.0))[0]
        row = base.repeat(16, 1) + torch.rand(16, 3, generator=generator, dtype=torch.float64) * 0.6
        row[:, 2] = z  # up to n + 1: past the periodic seam, unwrapped
        rows_xyz.append(row)
    return torch.cat(rows_xyz).unsqueeze(0).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels", [1, 3, 4])
def test_cic_readout_at_the_end_of_the_mesh_storage(device, dtype, channels):
    """Interleaved channels are read four lanes at a time; the mesh's last node (its
    fourth lane past the end of the storage for 3 channels) must be read element by
    element, and every value equal the pure-torch reference's."""
    generator = torch.Generator().manual_seed(7)
    n = 8
    x = _rows_at_the_top_corner(n, 64, dtype, device, generator)
    mesh = torch.randn(1, channels, n, n, n, generator=generator, dtype=torch.float64).to(dtype).to(device)
    if channels > 1:
        mesh = mesh.contiguous(memory_format=torch.channels_last_3d)
        assert mesh.untyped_storage().nbytes() == mesh.numel() * mesh.element_size()
    got = torchpm.readout(mesh, x, order="cic")
    torch.testing.assert_close(got, readout_reference(mesh, x, order=2), **TOLERANCES[dtype])


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_readout_reports_a_non_finite_node_read_by_many_particles(device, channels, bad):
    """The readout checks the values it wrote, a run of particles at a time: a non-finite
    node read by particles of the second run raises, one no particle reads does not."""
    generator = torch.Generator().manual_seed(8)
    n = 8
    x = _rows_at_the_top_corner(n, 160, torch.float32, device, generator)  # 2560 particles
    mesh = torch.randn(1, channels, n, n, n, generator=generator).to(device)
    if channels > 1:
        mesh = mesh.contiguous(memory_format=torch.channels_last_3d)
    far = mesh.clone()
    far[0, channels - 1, 3, 3, 3] = bad  # no particle's stencil reaches (3, 3, 3)
    assert torch.isfinite(torchpm.readout(far, x, order="cic")).all()
    near = mesh.clone()
    near[0, channels - 1, n - 1, n - 1, 0] = bad  # across the seam: read by the particles past z = n - 1
    with pytest.raises(ValueError, match="`mesh` contains NaN or Inf"):
        torchpm.readout(near, x, order="cic")
        torchpm.check()
    assert not torch.isfinite(torchpm.readout(near, x, order="cic", check_finite=False)).all()


def test_fake_kernels_check_what_needs_no_values():
    m = torch.device("meta")
    x = torch.empty(2, 5, 3, device=m)
    ops = torch.ops.torchpm
    geo = ([0, 0, 0], [True] * 3, 3)
    with pytest.raises(ValueError, match="float32 or float64"):
        ops.paint(x.half(), None, [4, 4, 4], *geo)
    with pytest.raises(ValueError, match=r"`weights` of shape"):
        ops.paint(x, torch.empty(2, 4, device=m), [4, 4, 4], *geo)
    with pytest.raises(ValueError, match="dtype of `positions`"):
        ops.paint(x, torch.empty(2, 5, device=m, dtype=torch.float64), [4, 4, 4], *geo)
    with pytest.raises(ValueError, match="`shape`"):
        ops.paint(x, None, [4, 0, 4], *geo)
    with pytest.raises(ValueError, match="`order`"):
        ops.paint(x, None, [4, 4, 4], [0, 0, 0], [True] * 3, 7)
    with pytest.raises(ValueError, match=r"`mesh` of shape"):
        ops.readout(torch.empty(4, 4, 4, device=m), x, *geo)
    with pytest.raises(ValueError, match="positive"):
        ops.readout(torch.empty(2, 4, 0, 4, device=m), x, *geo)
    with pytest.raises(ValueError, match="zero channels"):
        ops.readout(torch.empty(2, 0, 4, 4, 4, device=m), x, *geo)
    with pytest.raises(ValueError, match="one entry per channel"):
        ops._position_gradient(torch.empty(2, 3, 4, 4, 4, device=m), x, torch.empty(2, 5, 2, device=m), *geo)
    with pytest.raises(RuntimeError, match="device of `positions`"):
        ops.readout(torch.empty(2, 4, 4, 4), x, *geo)
    # the position gradient is a fresh contiguous (B, N, 3), whatever the input strides
    permuted = torch.empty(5, 2, 3, device=m).transpose(0, 1)
    out = ops._position_gradient(torch.empty(2, 4, 4, 4, device=m), permuted, None, *geo)
    assert out.shape == (2, 5, 3) and out.is_contiguous()
    assert ops.paint(x, torch.empty(2, 5, 2, device=m), [4, 5, 6], *geo).shape == (2, 2, 4, 5, 6)


@pytest.mark.parametrize("positions", [torch.zeros(2, 5, 3, dtype=torch.float16), torch.zeros(2, 5, 2), torch.zeros(5, 3)])
def test_fake_kernels_say_what_the_cpu_op_says(positions):
    """A bad `positions` gets the same message from the fake kernel (meta tensors,
    torch.compile) as from the C++ op."""
    geo = ([0, 0, 0], [True] * 3, 3)
    messages = []
    for p in (positions, positions.to("meta")):
        with pytest.raises(ValueError) as info:
            torch.ops.torchpm.paint(p, None, [4, 4, 4], *geo)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "`positions`" in messages[0]


def test_fake_kernels_return_the_layout_of_the_kernels():
    # permuted positions (a transposed view): the kernels make them contiguous and
    # return fresh contiguous results; a fake with other strides would fail
    # Inductor's stride assertions
    positions = (torch.rand(5, 2, 3, dtype=torch.float64) * 4).transpose(0, 1)
    mesh = torch.randn(2, 3, 4, 4, 4, dtype=torch.float64)
    values = torch.randn(5, 2, 3, dtype=torch.float64).transpose(0, 1)
    ops = torch.ops.torchpm
    geo = ([0, 0, 0], [True] * 3, 3)
    meta = lambda t: t.to("meta")  # noqa: E731  (.to keeps the strides)
    cases = [
        (ops._position_gradient.default, (mesh, positions, values, *geo)),
        (ops.readout.default, (mesh, positions, *geo, True)),
        (ops.paint.default, (positions, values, [4, 4, 4], *geo, True)),
    ]
    for op, args in cases:
        real = op(*args)
        fake = op(*(meta(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert real.shape == fake.shape and real.stride() == fake.stride(), op
        torch.library.opcheck(op, args)


# --------------------------------------------------------------------------- physics


def test_force_kernel_window_compensation():
    mesh = torchpm.LocalMesh((8, 6, 10))
    cell = (1.0, 1.0, 1.0)
    plain = FourierKernels(mesh, cell, dtype=torch.float64)
    w = mesh.wavevectors(dtype=torch.float64)
    for order, p in WIDTH.items():
        window = 1.0
        for wi in w:
            window = window * (torch.sin(wi / 2) / (wi / 2)).nan_to_num(1.0).where(wi != 0, torch.ones_like(wi)) ** p
        comp = FourierKernels(mesh, cell, window_compensation=order, dtype=torch.float64)
        torch.testing.assert_close(comp.inverse_laplacian, plain.inverse_laplacian / window**2, rtol=1e-12, atol=0)
    # the older switch keeps its meaning: the CIC window once
    old = FourierKernels(mesh, cell, cic_compensation=True, dtype=torch.float64)
    cic = FourierKernels(mesh, cell, window_compensation="cic", dtype=torch.float64)
    torch.testing.assert_close(old.inverse_laplacian**2, cic.inverse_laplacian * plain.inverse_laplacian, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="at most one"):
        FourierKernels(mesh, cell, cic_compensation=True, window_compensation="tsc")


def test_simulation_paint_order_runs_and_uses_its_window():
    common = dict(n_particles=8, box_size=64.0, a_start=0.2, steps=2, dtype=torch.float64)
    sim = torchpm.Simulation(paint_order="tsc", window_compensation=True, **common)
    kernels = sim.kernels("force")
    expected = FourierKernels(sim.force_mesh, sim.cell_size, window_compensation="tsc", dtype=torch.float64)
    torch.testing.assert_close(kernels.inverse_laplacian, expected.inverse_laplacian)
    noise = sim.white_noise(seed=1)
    tsc = sim(noise)
    cic = torchpm.Simulation(**common)(noise)
    assert torch.isfinite(tsc.positions).all()
    difference = tsc.positions - cic.positions
    difference = (difference - 64.0 * torch.round(difference / 64.0)).abs().max().item()  # periodic
    assert 0 < difference < 4.0  # a different window, the same cosmology: below half a cell (8 Mpc/h)
    with pytest.raises(TypeError, match="`cic_compensation` must be"):
        torchpm.Simulation(cic_compensation="false", **common)
    with pytest.raises(ValueError, match="`paint_order`"):
        torchpm.Simulation(paint_order="quartic", **common)


def test_local_mesh_paint_and_readout_take_the_order():
    mesh = torchpm.LocalMesh(6)
    x = random_positions(1, 50, "pcs", (6, 6, 6), (0, 0, 0), (True,) * 3, torch.float64, "cpu")
    torch.testing.assert_close(mesh.paint(x, order="pcs"), paint_reference(x, None, (6, 6, 6), order=4))
    f = torch.randn(1, 6, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(mesh.readout(f, x, order="tsc"), readout_reference(f, x, order=3))


def test_power_spectrum_window_compensation_by_the_right_power():
    field = torch.randn(8, 8, 8, dtype=torch.float64)
    mesh = torchpm.LocalMesh(8)
    plain = power_spectrum(field, 8.0, bins=[0.5, 1.0], mesh=mesh)
    for order, p in WIDTH.items():
        compensated = power_spectrum(field, 8.0, bins=[0.5, 1.0], window=order, mesh=mesh)
        # the first shell (|k| = 2 pi / 8 along one axis) has 6 modes, all with W = sinc(1/8)^p
        window = (math.sin(math.pi / 8) / (math.pi / 8)) ** p
        assert compensated.power[0].item() == pytest.approx(plain.power[0].item() / window**2, rel=1e-12)
    old = power_spectrum(field, 8.0, compensate_cic=True, mesh=mesh)
    new = power_spectrum(field, 8.0, window="cic", mesh=mesh)
    torch.testing.assert_close(old.power, new.power)


@pytest.mark.parametrize("order", ["cic", "tsc", "pcs"])
def test_compensated_interlaced_poisson_power_is_shot_noise(order):
    """A Poisson-sampled uniform field has P(k) = V/N at every k. Painted with a
    window, the measured power is V/N sum_n W^2(k + 2 pi n): the compensated and
    interlaced estimate must stay within a few per cent of V/N up to 0.7 Nyquist,
    the uncompensated one must fall well below it."""
    n, count, seeds = 48, 48**3, 3
    mesh = torchpm.LocalMesh(n)
    noise = n**3 / count  # box = n cells of size 1
    edges = torch.linspace(0.2, 0.7, 6) * math.pi
    measured = {"interlaced": 0, "plain": 0, "uncompensated": 0}
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(1, count, 3, generator=g, dtype=torch.float64) * n
        interlaced = paint_density(x, mesh, order=order, interlacing=True)[0]
        plain = paint_density(x, mesh, order=order)[0]
        measured["interlaced"] += power_spectrum(interlaced, float(n), bins=edges, window=order, mesh=mesh).power / seeds
        measured["plain"] += power_spectrum(plain, float(n), bins=edges, window=order, mesh=mesh).power / seeds
        measured["uncompensated"] += power_spectrum(plain, float(n), bins=edges, mesh=mesh).power / seeds
    ratio = {key: value / noise for key, value in measured.items()}
    assert (ratio["interlaced"] - 1).abs().max().item() < 0.04, ratio
    assert ratio["uncompensated"][-1].item() < 0.55, ratio
    # interlacing removes the aliasing the compensation alone leaves near 0.7 Nyquist
    # (a wrong interlacing phase would add aliasing instead; for PCS that residue is
    # already below the sample variance of this test)
    if order in ("cic", "tsc"):
        assert abs(ratio["interlaced"][-1].item() - 1) < abs(ratio["plain"][-1].item() - 1), ratio


def test_paint_density_normalisation():
    mesh = torchpm.LocalMesh(8)
    x = random_positions(2, 500, "tsc", (8, 8, 8), (0, 0, 0), (True,) * 3, torch.float64, "cpu", seed=7)
    w = torch.rand(2, 500, dtype=torch.float64)
    delta = paint_density(x, mesh, weights=w, order="tsc")
    expected = paint_reference(x, w, (8, 8, 8), order=3) * (512 / w.sum(1)).view(2, 1, 1, 1) - 1
    torch.testing.assert_close(delta, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="no particles"):
        paint_density(x[:, :0], mesh)
    # a shape where the mesh goes: the error says to pass it as `shape`
    with pytest.raises(TypeError, match=r"got tuple; for the whole mesh of that shape pass shape=\(8, 8, 8\)"):
        paint_density(x, (8, 8, 8))
    torch.testing.assert_close(paint_density(x, shape=(8, 8, 8), weights=w, order="tsc"), delta, rtol=0, atol=0)
