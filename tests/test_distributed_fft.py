"""Distributed FFT, transposes and halo exchange on gloo process groups.

One pool of processes is spawned per world size (1 to 4) and runs every case
of that world size inside it (see _spawn.py); each pytest test below reports
one case. Expected values come from torch.fft on the whole field, which every
rank can rebuild from a shared seed, and from block layouts computed here with
numpy.array_split, independently of torchpm.
"""

from __future__ import annotations

import datetime
import math
import time

import numpy as np
import pytest
import torch

from _spawn import grid_context, rank_errors, run_grid_case, world_results_fixture

pytestmark = pytest.mark.distributed

GRIDS = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 3: [(1, 3), (3, 1)], 4: [(2, 2), (1, 4), (4, 1)]}
# Divisible and uneven meshes; every one is large enough for every grid above.
SHAPES = [(8, 12, 10), (10, 14, 9), (16, 12, 10), (7, 5, 6)]
GRAD_SHAPE = (5, 4, 6)
HALO_SHAPE = (9, 8, 6)
HALO_WIDTHS = [1, (0, 1), (2, 1)]
TOLERANCE = 1e-12
FAILFAST_TIMEOUT = datetime.timedelta(seconds=3)

CASE_KINDS = [
    "layout", "fft", "fft_float32", "transpose_adjoint", "fft_adjoint", "kvector",
    "halo", "halo_adjoint", "gradcheck_fft", "gradcheck_halo", "fd4",
]


def case_ids(world_size):
    ids = [f"{kind}-{p0}x{p1}" for (p0, p1) in GRIDS[world_size] for kind in CASE_KINDS]
    if world_size <= 2:
        # Full (not fast-mode) gradchecks, affordable with two ranks.
        ids += [f"gradcheck_full-{p0}x{p1}" for (p0, p1) in GRIDS[world_size]]
    if world_size == 1:
        ids.append("staged-1x1")
    if world_size == 4:
        ids.append("devicemesh-2x2")
    if world_size > 1:
        # Last: it leaves a broken process group behind.
        ids.append(f"failfast-{GRIDS[world_size][0][0]}x{GRIDS[world_size][0][1]}")
    return ids


# ----------------------------------------------------------------------------
# Independent expectations.


def block_sizes(n, parts):
    return [len(a) for a in np.array_split(np.arange(n), parts)]


def block(n, parts, index):
    sizes = block_sizes(n, parts)
    return sizes[index], sum(sizes[:index])


def expected_layout(shape, grid, coords):
    nx, ny, nz = shape
    (p0, p1), (r0, r1) = grid, coords
    (lx, ox), (ly, oy) = block(nx, p0, r0), block(ny, p1, r1)
    (lky, oky), (lkz, okz) = block(ny, p0, r0), block(nz // 2 + 1, p1, r1)
    return ((lx, ly, nz), (ox, oy, 0)), ((nx, lky, lkz), (0, oky, okz))


def real_slices(shape, grid, coords):
    ((lx, ly, _), (ox, oy, _)), _ = expected_layout(shape, grid, coords)
    return (..., slice(ox, ox + lx), slice(oy, oy + ly), slice(None))


def fourier_slices(shape, grid, coords):
    _, ((_, lky, lkz), (_, oky, okz)) = expected_layout(shape, grid, coords)
    return (..., slice(None), slice(oky, oky + lky), slice(okz, okz + lkz))


def all_coords(grid):
    return [divmod(r, grid[1]) for r in range(grid[0] * grid[1])]


def global_random(shape, seed, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=dtype)


def global_sum(value):
    import torch.distributed as dist

    value = value.detach().clone().reshape(1)
    dist.all_reduce(value)
    return value[0]


def real_inner(a, b):
    """Re <a, b> summed over this rank's elements."""
    return (a.conj() * b).real.sum() if a.is_complex() else (a * b).sum()


def assert_close(actual, expected, scale, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert error <= TOLERANCE * scale, f"{what}: max abs error {error:.3e} > {TOLERANCE:g} x scale {scale:.3e}"


# ----------------------------------------------------------------------------
# Gradcheck of a collective function: every rank holds the same global input
# and sees the same global output, so gradcheck makes the same calls (and the
# same collectives) on every rank and checks the full Jacobian.


class _Replicated(torch.autograd.Function):
    """Identity whose backward sums the gradient over ranks (the input is shared)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


class _GatherFlat(torch.autograd.Function):
    """Concatenate every rank's 1-D tensor; backward keeps this rank's part."""

    @staticmethod
    def forward(ctx, local, numels):
        import torch.distributed as dist

        rank = dist.get_rank()
        ctx.part = (sum(numels[:rank]), numels[rank])
        width = max(numels)
        padded = torch.cat([local, local.new_zeros(width - local.numel())])
        parts = [torch.empty_like(padded) for _ in numels]
        dist.all_gather(parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, numels)])

    @staticmethod
    def backward(ctx, grad):
        start, count = ctx.part
        return grad.narrow(0, start, count), None


def as_global_function(fn, in_shapes, out_shapes):
    import torch.distributed as dist

    rank = dist.get_rank()
    in_numels = [math.prod(s) for s in in_shapes]
    out_numels = [math.prod(s) for s in out_shapes]

    def wrapped(x_flat):
        x = _Replicated.apply(x_flat)
        mine = x.narrow(0, sum(in_numels[:rank]), in_numels[rank]).view(in_shapes[rank])
        return _GatherFlat.apply(fn(mine).reshape(-1), out_numels)

    return wrapped, sum(in_numels)


# ----------------------------------------------------------------------------
# The cases (run inside the spawned processes).


def make_context(world_size):
    from torchpm.distributed import process_grid_groups

    ctx = grid_context(world_size, GRIDS)
    if world_size > 1:
        ctx["failfast_groups"] = process_grid_groups(GRIDS[world_size][0], timeout=FAILFAST_TIMEOUT)
    if world_size == 4:
        from torch.distributed.device_mesh import init_device_mesh

        ctx["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    return ctx


def run_case(case_id, ctx):
    run_grid_case(globals(), case_id, ctx)


def decomposition(shape, grid, ctx):
    from torchpm.distributed import PencilDecomposition

    return PencilDecomposition(shape, ctx["groups"][grid])


def coords_of(ctx, grid):
    return divmod(ctx["rank"], grid[1])


def case_layout(grid, ctx):
    coords = coords_of(ctx, grid)
    for shape in SHAPES:
        d = decomposition(shape, grid, ctx)
        (real_shape, real_offset), (fourier_shape, fourier_offset) = expected_layout(shape, grid, coords)
        assert d.grid_shape == grid and d.grid_coords == coords, (d.grid_shape, d.grid_coords)
        assert d.local_real_shape == real_shape and d.local_real_offset == real_offset, repr(d)
        assert d.local_fourier_shape == fourier_shape and d.local_fourier_offset == fourier_offset, repr(d)
        for other in all_coords(grid):
            assert d.real_block(other) == expected_layout(shape, grid, other)[0]
            assert d.fourier_block(other) == expected_layout(shape, grid, other)[1]
        whole = global_random((2, *shape), 7)
        assert torch.equal(d.local_real_part(whole), whole[real_slices(shape, grid, coords)])
        whole_k = torch.fft.rfftn(whole, dim=(-3, -2, -1))
        assert torch.equal(d.local_fourier_part(whole_k), whole_k[fourier_slices(shape, grid, coords)])


def case_fft(grid, ctx):
    coords = coords_of(ctx, grid)
    for seed, shape in enumerate(SHAPES):
        d = decomposition(shape, grid, ctx)
        whole = global_random((2, *shape), seed)
        local = whole[real_slices(shape, grid, coords)].contiguous()
        expected = torch.fft.rfftn(whole, dim=(-3, -2, -1))
        scale = expected.abs().max().item()
        field_k = d.rfftn(local)
        assert_close(field_k, expected[fourier_slices(shape, grid, coords)], scale, f"rfftn {shape}")
        back = d.irfftn(field_k)
        assert_close(back, local, whole.abs().max().item(), f"irfftn(rfftn) {shape}")
        # irfftn of a spectrum that is not exactly Hermitian matches torch too.
        spectrum = torch.complex(global_random(expected.shape, 100 + seed), global_random(expected.shape, 200 + seed))
        expected_real = torch.fft.irfftn(spectrum, s=shape, dim=(-3, -2, -1))
        actual_real = d.irfftn(spectrum[fourier_slices(shape, grid, coords)].contiguous())
        assert_close(actual_real, expected_real[real_slices(shape, grid, coords)],
                     expected_real.abs().max().item(), f"irfftn {shape}")


def case_fft_float32(grid, ctx):
    coords = coords_of(ctx, grid)
    shape = SHAPES[1]
    d = decomposition(shape, grid, ctx)
    whole = global_random((1, *shape), 7, torch.float32)
    field_k = d.rfftn(whole[real_slices(shape, grid, coords)].contiguous())
    assert field_k.dtype == torch.complex64
    expected = torch.fft.rfftn(whole.double(), dim=(-3, -2, -1))[fourier_slices(shape, grid, coords)]
    error = (field_k.to(torch.complex128) - expected).abs().max().item()
    assert error < 1e-5 * expected.abs().max().item(), error


def case_transpose_adjoint(grid, ctx):
    """<T x, y> = <x, T^-1 y> for both transposes (T is a permutation), and T^-1 T = 1."""
    coords = coords_of(ctx, grid)
    for seed, shape in enumerate(SHAPES):
        d = decomposition(shape, grid, ctx)
        nx, ny, nz = shape
        (lx, ly, _), _ = expected_layout(shape, grid, coords)[0]
        _, ((_, lky, lkz), _) = expected_layout(shape, grid, coords)
        before = {1: (2, lx, ly, nz // 2 + 1), 0: (2, lx, ny, lkz)}
        after = {1: (2, lx, ny, lkz), 0: (2, nx, lky, lkz)}
        generator = torch.Generator().manual_seed(1000 * seed + ctx["rank"])
        for axis in (1, 0):
            x = torch.randn(*before[axis], dtype=torch.complex128, generator=generator)
            y = torch.randn(*after[axis], dtype=torch.complex128, generator=generator)
            tx = d.transpose(x, axis)
            assert tuple(tx.shape) == after[axis], (axis, tx.shape)
            assert torch.equal(d.transpose(tx, axis, inverse=True), x), f"inverse transpose {axis}"
            lhs = global_sum(real_inner(tx, y))
            rhs = global_sum(real_inner(x, d.transpose(y, axis, inverse=True)))
            assert abs(lhs - rhs) <= TOLERANCE * (abs(lhs) + 1), (axis, lhs, rhs)
            # Autograd of the transpose is its adjoint.
            xg = x.clone().requires_grad_()
            (grad,) = torch.autograd.grad(d.transpose(xg, axis), xg, grad_outputs=y)
            assert torch.equal(grad, d.transpose(y, axis, inverse=True)), f"backward of transpose {axis}"


def case_fft_adjoint(grid, ctx):
    """Re<F x, y> = <x, F^H y> with F^H from autograd, for rfftn and irfftn."""
    coords = coords_of(ctx, grid)
    shape = SHAPES[1]
    d = decomposition(shape, grid, ctx)
    generator = torch.Generator().manual_seed(ctx["rank"])
    _, (fourier_shape, _) = expected_layout(shape, grid, coords)
    real_shape = expected_layout(shape, grid, coords)[0][0]
    x = torch.randn(2, *real_shape, dtype=torch.float64, generator=generator, requires_grad=True)
    y = torch.randn(2, *fourier_shape, dtype=torch.complex128, generator=generator)
    forward = d.rfftn(x)
    (adjoint_y,) = torch.autograd.grad(forward, x, grad_outputs=y)
    lhs, rhs = global_sum(real_inner(forward.detach(), y)), global_sum(real_inner(x.detach(), adjoint_y))
    assert abs(lhs - rhs) <= 1e-11 * (abs(lhs) + 1), ("rfftn", lhs, rhs)
    k = y.clone().requires_grad_()
    r = torch.randn(2, *real_shape, dtype=torch.float64, generator=generator)
    inverse = d.irfftn(k)
    (adjoint_r,) = torch.autograd.grad(inverse, k, grad_outputs=r)
    lhs, rhs = global_sum(real_inner(inverse.detach(), r)), global_sum(real_inner(k.detach(), adjoint_r))
    assert abs(lhs - rhs) <= 1e-11 * (abs(lhs) + 1), ("irfftn", lhs, rhs)


def case_kvector(grid, ctx):
    """Gradient of the inverse Laplacian, -i w / |w|^2, against the serial computation."""
    coords = coords_of(ctx, grid)
    for seed, shape in enumerate(SHAPES):
        d = decomposition(shape, grid, ctx)
        nx, ny, nz = shape
        whole = global_random((1, *shape), 50 + seed)
        kx = 2 * np.pi * np.fft.fftfreq(nx)
        ky = 2 * np.pi * np.fft.fftfreq(ny)
        kz = 2 * np.pi * np.fft.rfftfreq(nz)
        serial_w = [torch.from_numpy(k) for k in np.meshgrid(kx, ky, kz, indexing="ij")]
        serial_w2 = sum(w**2 for w in serial_w)
        serial_w2[0, 0, 0] = 1.0
        delta_k = torch.fft.rfftn(whole, dim=(-3, -2, -1))
        w = d.wavevectors(dtype=torch.float64)
        for axis, wi in enumerate(w):
            expected = torch.from_numpy((kx, ky, kz)[axis])
            sl = fourier_slices(shape, grid, coords)[1 + axis]
            assert torch.equal(wi.reshape(-1), expected[sl]), f"wavevector {axis}"
        w2 = w[0] ** 2 + w[1] ** 2 + w[2] ** 2
        w2 = torch.where(w2 == 0, torch.ones_like(w2), w2)
        local_k = d.rfftn(whole[real_slices(shape, grid, coords)].contiguous())
        for axis in range(3):
            serial_kernel = -1j * serial_w[axis] / serial_w2
            serial_kernel[0, 0, 0] = 0
            expected = torch.fft.irfftn(serial_kernel * delta_k, s=shape, dim=(-3, -2, -1))
            actual = d.irfftn(-1j * w[axis] / w2 * local_k)
            assert_close(actual, expected[real_slices(shape, grid, coords)], expected.abs().max().item(),
                         f"gradient of inverse Laplacian, axis {axis}, {shape}")


def _haloed_reference(whole, shape, grid, coords, lo, hi):
    ((lx, ly, _), (ox, oy, _)), _ = expected_layout(shape, grid, coords)
    ix = torch.arange(ox - lo, ox + lx + hi) % shape[0]
    iy = torch.arange(oy - lo, oy + ly + hi) % shape[1]
    return whole[..., ix, :, :][..., :, iy, :], ix, iy


def case_halo(grid, ctx):
    coords = coords_of(ctx, grid)
    shape = HALO_SHAPE
    d = decomposition(shape, grid, ctx)
    whole = global_random((2, *shape), 3)
    for width in HALO_WIDTHS:
        lo, hi = (width, width) if isinstance(width, int) else width
        expected, _, _ = _haloed_reference(whole, shape, grid, coords, lo, hi)
        local = whole[real_slices(shape, grid, coords)].contiguous()
        padded = d.pad_halo(local, width) + 0.5  # garbage halo: must be ignored
        padded[..., lo:lo + local.shape[-3], lo:lo + local.shape[-2], :] = local
        given = padded.clone()
        filled = d.fill_halo(padded, width)
        assert torch.equal(filled, expected), f"fill_halo width {width}"
        assert torch.equal(padded, given), f"fill_halo width {width} wrote into its input"
        # add_halo: every rank's haloed block, added into the global mesh at
        # its periodic indices, then cut back to this rank's block.
        total = torch.zeros(2, *shape, dtype=torch.float64)
        mine = None
        for rank, other in enumerate(all_coords(grid)):
            block, ix, iy = _haloed_reference(whole, shape, grid, other, lo, hi)
            values = global_random(block.shape, 500 + rank)
            if other == coords:
                mine = values
            index = (torch.arange(2)[:, None, None], ix[None, :, None], iy[None, None, :])
            total.index_put_(index, values, accumulate=True)
        given = mine.clone()
        added = d.add_halo(mine, width)
        assert torch.equal(mine, given), f"add_halo width {width} wrote into its input"
        expected_added = torch.zeros_like(mine)
        lx, ly = local.shape[-3], local.shape[-2]
        expected_added[..., lo:lo + lx, lo:lo + ly, :] = total[real_slices(shape, grid, coords)]
        assert_close(added, expected_added, total.abs().max().item(), f"add_halo width {width}")


def case_halo_adjoint(grid, ctx):
    coords = coords_of(ctx, grid)
    d = decomposition(HALO_SHAPE, grid, ctx)
    generator = torch.Generator().manual_seed(77 + ctx["rank"])
    for width in HALO_WIDTHS:
        a = torch.randn(2, *d.halo_shape(width), dtype=torch.float64, generator=generator)
        b = torch.randn(2, *d.halo_shape(width), dtype=torch.float64, generator=generator)
        lhs = global_sum(real_inner(d.fill_halo(a, width), b))
        rhs = global_sum(real_inner(a, d.add_halo(b, width)))
        assert abs(lhs - rhs) <= TOLERANCE * (abs(lhs) + 1), (width, lhs, rhs)
        ag = a.clone().requires_grad_()
        (grad,) = torch.autograd.grad(d.fill_halo(ag, width), ag, grad_outputs=b)
        assert torch.equal(grad, d.add_halo(b, width)), f"backward of fill_halo, width {width}"
        (grad,) = torch.autograd.grad(d.add_halo(ag, width), ag, grad_outputs=b)
        assert torch.equal(grad, d.fill_halo(b, width)), f"backward of add_halo, width {width}"
    del coords


def case_fd4(grid, ctx):
    """The real-space 4-point gradient on a grid (halo of 2 filled from the neighbours)
    is the single-device periodic one's local block; its transpose (halo added back)
    likewise, and it is the backward of the gradient. A block thinner than the halo
    sends the force kernels back to the Fourier gradient, which still agrees."""
    from torchpm.fourier import FourierKernels, gradient_inverse_laplacian
    from torchpm.mesh import LocalMesh
    from torchpm.ops import fd4_gradient, fd4_gradient_transpose

    coords = coords_of(ctx, grid)
    scale = (0.5, -1.5, 2.0)
    for seed, shape in enumerate(SHAPES[:3]):
        d = decomposition(shape, grid, ctx)
        assert d.fd4_halo() is not None, repr(d)
        whole = global_random((2, *shape), 300 + seed)
        local = whole[real_slices(shape, grid, coords)].contiguous()
        expected = fd4_gradient(whole, scale)
        size = expected.abs().max().item()
        channels = (slice(None), slice(None), *real_slices(shape, grid, coords)[1:])
        assert_close(d.fd4_gradient(local, scale), expected[channels], size, f"fd4_gradient {shape}")
        other = global_random(expected.shape, 400 + seed)
        other_local = other[channels].contiguous()
        expected_t = fd4_gradient_transpose(other, scale)
        assert_close(d.fd4_gradient_transpose(other_local, scale), expected_t[real_slices(shape, grid, coords)],
                     expected_t.abs().max().item(), f"fd4_gradient_transpose {shape}")
        leaf = local.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(d.fd4_gradient(leaf, scale), leaf, grad_outputs=other_local)
        assert_close(grad, d.fd4_gradient_transpose(other_local, scale), expected_t.abs().max().item(),
                     f"backward of fd4_gradient {shape}")
        check_fd4_gradient_readout(d, shape, grid, coords, whole, local, expected, seed)
    if grid[0] > 1:
        shape = (grid[0], 8, 6)  # one x plane per rank: no room for a halo of 2
        d = decomposition(shape, grid, ctx)
        assert d.fd4_halo() is None
        kernels = FourierKernels(d, (1.0, 1.0, 1.0), dtype=torch.float64)
        assert not kernels.real_space_gradient
        whole = global_random((1, *shape), 500)
        local = whole[real_slices(shape, grid, coords)].contiguous()
        field = gradient_inverse_laplacian(d.rfftn(local), kernels)
        single = FourierKernels(LocalMesh(shape), (1.0, 1.0, 1.0), dtype=torch.float64)
        expected = gradient_inverse_laplacian(torch.fft.rfftn(whole, dim=(-3, -2, -1)), single)
        channels = (slice(None), slice(None), *real_slices(shape, grid, coords)[1:])
        assert_close(field, expected[channels], expected.abs().max().item(), "Fourier gradient on thin blocks")


def owned_positions(shape, grid, coords, seed, count=300):
    """Global random positions (shared seed) wrapped into the box, those in this
    rank's block along x and y (as migration leaves them)."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.rand(count, 3, generator=generator, dtype=torch.float64) * 3 - 1) * torch.tensor(shape)
    ((lx, ly, _), (ox, oy, _)), _ = expected_layout(shape, grid, coords)
    wrapped = torch.remainder(x, torch.tensor(shape, dtype=torch.float64))
    mine = (wrapped[:, 0] >= ox) & (wrapped[:, 0] < ox + lx) & (wrapped[:, 1] >= oy) & (wrapped[:, 1] < oy + ly)
    return wrapped[mine][None].expand(2, -1, -1).contiguous()


def check_fd4_gradient_readout(d, shape, grid, coords, whole, local, expected, seed):
    """fd4_gradient with `halo_for` (one wide halo, or a second exchange on thin
    blocks) read with `haloed=True` gives the single-device gradient at owned
    particles, for the readout orders with the smallest and the largest reach; its
    halo is the one with_stencil_halo fills; its backward is the two-exchange path's."""
    from torchpm.ops import readout

    scale = (0.5, -1.5, 2.0)
    for order in ("cic", "tsc"):
        x = owned_positions(shape, grid, coords, 600 + seed)
        haloed = d.fd4_gradient(local, scale, halo_for=order)
        assert haloed.shape[-3:] == d.halo_shape(d.stencil_halo(order)), (order, haloed.shape)
        assert_close(haloed, d.with_stencil_halo(d.fd4_gradient(local, scale), order), expected.abs().max().item(),
                     f"halo of fd4_gradient(halo_for={order}) {shape}")
        got = d.readout(haloed, x, order=order, haloed=True)
        assert_close(got, readout(expected, x, order=order), expected.abs().max().item(), f"haloed readout {shape} {order}")
        if grid != (1, 1):  # a field without the halo is refused, naming the shape it needs
            try:
                d.readout(d.fd4_gradient(local, scale), x, order=order, haloed=True)
            except ValueError as error:
                assert "PencilDecomposition.readout: expected `field` of shape" in str(error), str(error)
            else:
                raise AssertionError(f"readout(haloed=True) accepted a field without the halo {shape} {order}")
        widths = d.fd4_readout_halo(order)
        split = [axis for axis in (0, 1) if grid[axis] > 1]
        sizes = (d.layout.real_x, d.layout.real_y)
        thin = any(2 + max(halo_widths_of(order)) > min(sizes[axis]) for axis in split)
        assert (widths is None) == thin, (order, widths, sizes)
        leaf = local.clone().requires_grad_(True)
        cotangent = global_random(got.shape, 700 + seed)
        one = d.readout(d.fd4_gradient(leaf, scale, halo_for=order), x, order=order, haloed=True)
        (grad,) = torch.autograd.grad(one, leaf, cotangent)
        (two,) = torch.autograd.grad(d.readout(d.fd4_gradient(leaf, scale), x, order=order), leaf, cotangent)
        assert_close(grad, two, two.abs().max().item() + 1, f"backward of fd4_gradient(halo_for={order}) {shape}")


def halo_widths_of(order):
    # CIC reaches 0 planes below and 1 above, TSC 1 and 2 (torchpm.ops.halo_widths)
    return {"cic": (0, 1), "tsc": (1, 2)}[order]


def case_gradcheck_fft(grid, ctx, shape=GRAD_SHAPE, fast_mode=True):
    d = decomposition(shape, grid, ctx)
    coords = all_coords(grid)
    real_shapes = [(1, *expected_layout(shape, grid, c)[0][0]) for c in coords]
    fourier_shapes = [(1, *expected_layout(shape, grid, c)[1][0]) for c in coords]
    forward, n = as_global_function(d.rfftn, real_shapes, fourier_shapes)
    x = global_random((n,), 11).requires_grad_()
    assert torch.autograd.gradcheck(forward, (x,), atol=1e-8, rtol=1e-6, fast_mode=fast_mode), "rfftn"
    inverse, n = as_global_function(d.irfftn, fourier_shapes, real_shapes)
    k = torch.complex(global_random((n,), 12), global_random((n,), 13)).requires_grad_()
    assert torch.autograd.gradcheck(inverse, (k,), atol=1e-8, rtol=1e-6, fast_mode=fast_mode), "irfftn"


def case_gradcheck_halo(grid, ctx, shape=HALO_SHAPE, fast_mode=True):
    d = decomposition(shape, grid, ctx)
    width = (1, 2)
    shapes = []
    for c in all_coords(grid):
        (lx, ly, nz), _ = expected_layout(shape, grid, c)[0]
        shapes.append((1, lx + 3, ly + 3, nz))
    for name in ("fill_halo", "add_halo"):
        method = getattr(d, name)
        fn, n = as_global_function(lambda t: method(t, width), shapes, shapes)
        x = global_random((n,), 21).requires_grad_()
        assert torch.autograd.gradcheck(fn, (x,), atol=1e-8, rtol=1e-6, fast_mode=fast_mode), name


def case_gradcheck_full(grid, ctx):
    case_gradcheck_fft(grid, ctx, shape=(3, 4, 6), fast_mode=False)
    case_gradcheck_halo(grid, ctx, shape=(5, 4, 2), fast_mode=False)


def case_devicemesh(grid, ctx):
    from torchpm.distributed import PencilDecomposition

    coords = coords_of(ctx, grid)
    shape = SHAPES[3]
    d = PencilDecomposition(shape, mesh=ctx["mesh"])
    assert d.grid_shape == grid and d.grid_coords == coords, repr(d)
    whole = global_random((1, *shape), 9)
    expected = torch.fft.rfftn(whole, dim=(-3, -2, -1))
    actual = d.rfftn(whole[real_slices(shape, grid, coords)].contiguous())
    assert_close(actual, expected[fourier_slices(shape, grid, coords)], expected.abs().max().item(), "rfftn on mesh")


def case_staged(grid, ctx):
    """The full pipeline (pack, C++ all-to-all, unpack) on a group of size 1."""
    import torch.distributed as dist

    from torchpm.distributed import PencilDecomposition

    world = dist.group.WORLD
    for seed, shape in enumerate(SHAPES):
        d = PencilDecomposition(shape, (world, world), always_transpose=True)
        whole = global_random((2, *shape), seed)
        expected = torch.fft.rfftn(whole, dim=(-3, -2, -1))
        field_k = d.rfftn(whole)
        assert_close(field_k, expected, expected.abs().max().item(), f"staged rfftn {shape}")
        assert_close(d.irfftn(field_k), whole, whole.abs().max().item(), f"staged roundtrip {shape}")


def case_failfast(grid, ctx):
    """A rank raises before the FFT; the others must fail with a clear error, quickly."""
    from torchpm.distributed import PencilDecomposition

    shape = SHAPES[0]
    d = PencilDecomposition(shape, ctx["failfast_groups"])
    local = torch.zeros(1, *d.local_real_shape, dtype=torch.float64)
    if ctx["rank"] == 1:
        try:
            raise RuntimeError("simulated failure on rank 1 before the collective")
        except RuntimeError:
            # This rank never joins the transform but stays alive, so the others
            # cannot see a closed socket and must rely on the group's timeout.
            time.sleep(FAILFAST_TIMEOUT.total_seconds() + 5)
            return
    start = time.monotonic()
    try:
        d.rfftn(local)
    except torch.distributed.DistBackendError as error:
        elapsed = time.monotonic() - start
        message = str(error)
        # The first collective a rank reaches is the agreement check (or, with the
        # check off, the all-to-all): either names the operation and the timeout.
        assert ("torchpm._all_to_all" in message or "PencilDecomposition.rfftn" in message) \
            and "timeout" in message, message
        assert elapsed < FAILFAST_TIMEOUT.total_seconds() + 20, f"took {elapsed:.1f} s to fail: {message}"
        return
    raise AssertionError("rfftn completed although rank 1 never joined the collective")


# ----------------------------------------------------------------------------
# The pytest side: one spawn per world size, one test per case.

world_results = world_results_fixture(__name__, case_ids, "world")


@pytest.mark.parametrize(
    "world_size,case_id", [(w, c) for w in sorted(GRIDS) for c in case_ids(w)]
)
def test_distributed(world_results, world_size, case_id):
    errors = rank_errors(world_results(world_size)[case_id])
    if errors:
        pytest.fail(errors)
