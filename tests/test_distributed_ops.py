"""Single-process tests of the transposer ops and of the 1 x 1 decomposition."""

import pytest
import torch

import torchpm  # noqa: F401  (loads the ops)
from torchpm.distributed import PencilDecomposition, pack_blocks, split_sizes, unpack_blocks
from torchpm.distributed._reference import pack_blocks_reference, unpack_blocks_reference

DTYPES = [torch.float32, torch.float64, torch.complex64, torch.complex128, torch.int16, torch.uint8]
LAYOUTS = [
    ((2, 5, 3), 1, [2, 0, 3]),
    ((4, 6, 7), -1, [3, 2, 2]),
    ((6, 4, 5, 9), 0, [1, 2, 3]),
    ((3, 8, 5, 2), 2, [5]),
    ((7,), 0, [3, 4]),
]


def make(shape, dtype, device):
    generator = torch.Generator().manual_seed(sum(shape))
    if dtype.is_complex:
        return torch.randn(*shape, dtype=dtype, generator=generator).to(device)
    if dtype.is_floating_point:
        return torch.randn(*shape, dtype=dtype, generator=generator).to(device)
    return torch.randint(0, 100, shape, generator=generator).to(dtype=dtype, device=device)


def test_pack_hand_case():
    x = torch.arange(12.0).reshape(2, 6)
    # Chunks of columns [0, 1] and [2..5], each row-major.
    expected = torch.tensor([0.0, 1, 6, 7, 2, 3, 4, 5, 8, 9, 10, 11])
    assert torch.equal(pack_blocks(x, 1, [2, 4]), expected)
    assert torch.equal(unpack_blocks(expected, [2, 6], 1, [2, 4]), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,sizes", LAYOUTS)
def test_pack_unpack_match_reference(device, dtype, shape, dim, sizes):
    x = make(shape, dtype, device)
    packed = pack_blocks(x, dim, sizes)
    assert torch.equal(packed.cpu(), pack_blocks_reference(x.cpu(), dim, sizes))
    buffer = make((x.numel(),), dtype, device)
    assert torch.equal(
        unpack_blocks(buffer, shape, dim, sizes).cpu(),
        unpack_blocks_reference(buffer.cpu(), shape, dim, sizes),
    )
    assert torch.equal(unpack_blocks(packed, shape, dim, sizes), x)


def test_pack_non_contiguous_and_offset_input(device):
    base = make((5, 9, 6), torch.complex64, device)
    x = base[1:, ::2, 1:].transpose(0, 2)  # strided view with a storage offset
    assert torch.equal(pack_blocks(x, 1, [2, 3]).cpu(), pack_blocks_reference(x.cpu(), 1, [2, 3]))


@pytest.mark.parametrize("shape,dim,sizes", LAYOUTS[:3])
def test_opcheck(device, shape, dim, sizes):
    x = make(shape, torch.float64, device).requires_grad_()
    torch.library.opcheck(torch.ops.torchpm.pack_blocks.default, (x, dim, sizes))
    buffer = make((x.numel(),), torch.complex128, device).requires_grad_()
    torch.library.opcheck(torch.ops.torchpm.unpack_blocks.default, (buffer, list(shape), dim, sizes))


def test_gradcheck_pack_unpack(device):
    x = make((3, 5, 4), torch.float64, device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: pack_blocks(t, 1, [1, 3, 1]), (x,))
    b = make((60,), torch.complex128, device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: unpack_blocks(t, [3, 5, 4], 2, [3, 1]), (b,))


def test_pack_errors():
    x = torch.zeros(2, 5, 3)
    with pytest.raises(ValueError, match="sum to 4 but dimension 1"):
        pack_blocks(x, 1, [2, 2])
    with pytest.raises(ValueError, match="out of range"):
        pack_blocks(x, 3, [3])
    with pytest.raises(ValueError, match="non-negative"):
        pack_blocks(x, 1, [6, -1])
    with pytest.raises(ValueError, match="1-D with prod"):
        unpack_blocks(torch.zeros(29), [2, 5, 3], 1, [5])


def test_all_to_all_unknown_group():
    with pytest.raises(ValueError, match="no process group is registered under the name"):
        torch.ops.torchpm._all_to_all(torch.zeros(4), [4], [4], "no-such-group")


def test_split_sizes():
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(14, 4) == [4, 4, 3, 3]
    assert split_sizes(8, 2) == [4, 4]


def test_balanced_grid_takes_the_most_square_grid_the_meshes_allow():
    from torchpm.distributed import balanced_grid

    assert [balanced_grid(n) for n in (1, 2, 4, 6, 7, 8, 12)] == [(1, 1), (2, 1), (2, 2), (3, 2), (7, 1), (4, 2), (4, 3)]
    assert balanced_grid(4, [(8, 8, 8)]) == (2, 2)
    # (2, 2) leaves 1 x plane per rank where the stencil reaches 2: (4, 1) has nx = 2 < 4
    # ranks, so the y split (1, 4) with 4 planes per rank
    assert balanced_grid(4, [(2, 16, 16)], reach=2) == (1, 4)
    assert balanced_grid(4, [(2, 16, 16)], reach=1) == (2, 2)
    # 6 ranks: (3, 2) gives x blocks of 2 planes, below a reach of 3; (2, 3) gives 3 and 4
    assert balanced_grid(6, [(6, 12, 12)], reach=3) == (2, 3)
    # every mesh counts, each with its own reach: the stencil's on the force mesh (4, 32,
    # 32) leaves (2, 2) possible; the same reach on the particle grid (2, 16, 16) does not
    assert balanced_grid(4, [(2, 16, 16), (4, 32, 32)], reach=(1, 2)) == (2, 2)
    assert balanced_grid(4, [(2, 16, 16), (4, 32, 32)], reach=2) == (1, 4)
    # no grid fits (ny = 1 cannot be split, nor hold the transposed x planes): the most
    # square one, whose construction names the problem
    assert balanced_grid(4, [(8, 1, 8)]) == (2, 2)


# ----------------------------------------------------------------------------
# A 1 x 1 grid (no process group): plain torch.fft.


@pytest.mark.parametrize("shape", [(8, 6, 10), (5, 7, 9)])
def test_local_decomposition_is_torch_fft(device, shape):
    d = PencilDecomposition(shape)
    assert d.grid_shape == (1, 1) and d.is_local
    assert d.local_real_shape == shape and d.local_real_offset == (0, 0, 0)
    assert d.local_fourier_shape == (shape[0], shape[1], shape[2] // 2 + 1)
    x = torch.randn(2, *shape, dtype=torch.float64, device=device)
    k = d.rfftn(x)
    assert torch.equal(k, torch.fft.rfftn(x, dim=(-3, -2, -1)))
    assert torch.equal(d.irfftn(k), torch.fft.irfftn(k, s=shape, dim=(-3, -2, -1)))
    wx, wy, wz = d.wavevectors(dtype=torch.float64, device=device)
    assert wx.shape == (shape[0], 1, 1) and wy.shape == (1, shape[1], 1) and wz.shape == (1, 1, shape[2] // 2 + 1)
    assert torch.allclose(wz.reshape(-1).cpu(), 2 * torch.pi * torch.arange(shape[2] // 2 + 1, dtype=torch.float64) / shape[2])
    assert wy.reshape(-1)[-1].item() == pytest.approx(-2 * torch.pi / shape[1])


def test_local_halo_wraps_periodically(device):
    d = PencilDecomposition((4, 5, 3))
    x = torch.randn(1, 4, 5, 3, dtype=torch.float64, device=device)
    filled = d.fill_halo(d.pad_halo(x, (1, 2)), (1, 2))
    ix = torch.arange(-1, 6) % 4
    iy = torch.arange(-1, 7) % 5
    assert torch.equal(filled, x[:, ix][:, :, iy])
    assert torch.equal(d.strip_halo(filled, (1, 2)), x)
    # add_halo folds the halo back: the total is conserved and the halo is zero.
    y = torch.randn(1, *d.halo_shape(1), dtype=torch.float64, device=device)
    added = d.add_halo(y, 1)
    assert added.sum().item() == pytest.approx(y.sum().item())
    assert torch.equal(d.pad_halo(d.strip_halo(added, 1), 1), added)


def test_decomposition_errors():
    with pytest.raises(ValueError, match="global_shape"):
        PencilDecomposition((4, 5))
    with pytest.raises(ValueError, match="global_shape"):
        PencilDecomposition((4, 0, 5))
    d = PencilDecomposition((4, 5, 6))
    with pytest.raises(ValueError, match=r"expected `field` of shape \(\.\.\., 4, 5, 6\)"):
        d.rfftn(torch.zeros(1, 4, 5, 7))
    with pytest.raises(ValueError, match="real floating"):
        d.rfftn(torch.zeros(1, 4, 5, 6, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex `field_k`"):
        d.irfftn(torch.zeros(1, 4, 5, 4))
    with pytest.raises(ValueError, match="halo `width`"):
        d.fill_halo(torch.zeros(1, 14, 15, 6), 5)
    with pytest.raises(ValueError, match=r"halo `width` \(-1, 1\) along y must be non-negative"):
        d.fill_halo(torch.zeros(1, 6, 7, 6), ((1, 1), (-1, 1)))
    d.check_paint_order("pcs")  # one rank: no split axis, any stencil fits
    with pytest.raises(ValueError, match="grid coordinates"):
        d.real_block((1, 0))
