"""The paint accumulated tile by tile (torch.ops.torchpm._paint_tiled,
csrc/tile_paint.h): what torchpm.paint runs on CUDA after
torchpm.ops.set_paint_method("tiled"), for clustered particles.

The CPU op runs the CUDA passes one after another with the same functions
(binning, chunks of at most 1024 particles, the tile copy, the flush with its
periodic wrap), so these tests check the GPU's index arithmetic here; the CUDA
cases run the kernels themselves when a GPU is there. What it shares with the
node-by-node paint (equality with the scatter paint and the twin on partial tiles,
periodic axes shorter than the stencil, clustered particles in many chunks, error
reports, gradients, opcheck, CUDA-graph capture) is tested in
test_paint_variants.py; here, hand-computed stencils across a tile boundary and the
periodic wrap, a tile of exactly two chunks, set_paint_method and its routing.
"""

import pytest
import torch

import torchpm
from conftest import DEVICES
from torchpm.ops import mass_assignment

CUDA_ONLY = [p for p in DEVICES if not isinstance(p, str)]
ops = torch.ops.torchpm


def test_stencils_across_tile_boundaries_and_the_periodic_wrap(device):
    # hand-computed CIC: a particle at (7.5, 7.5, 7.5) is binned to tile 0 and
    # puts 1/8 on nodes 7 and 8 of each axis (8 is in tile 1: the halo of tile
    # 0's copy); one at (15.75, 0.25, 8) of a 16^3 mesh wraps from node 15 to 0
    # along x, with weights 1/4, 3/4 (x), 3/4, 1/4 (y), 1 (z)
    x = torch.tensor([[[7.5, 7.5, 7.5], [15.75, 0.25, 8.0]]], dtype=torch.float64, device=device)
    w = torch.tensor([[8.0, 16.0]], dtype=torch.float64, device=device)
    mesh = ops._paint_tiled(x, w, [16, 16, 16], [0, 0, 0], [True] * 3, 2, True).cpu()
    expected = torch.zeros(1, 16, 16, 16, dtype=torch.float64)
    expected[0, 7:9, 7:9, 7:9] = 1.0
    expected[0, 15, 0, 8] = 16 * 0.25 * 0.75
    expected[0, 15, 1, 8] = 16 * 0.25 * 0.25
    expected[0, 0, 0, 8] = 16 * 0.75 * 0.75
    expected[0, 0, 1, 8] = 16 * 0.75 * 0.25
    assert torch.equal(mesh, expected)


def test_a_tile_of_exactly_two_chunks(device):
    # (test_paint_variants.py's clustered case has a tile of 20 chunks, the last
    # partial)
    y = torch.full((1, 2048, 3), 2.5, dtype=torch.float64, device=device)
    mesh = ops._paint_tiled(y, None, [8, 8, 8], [0, 0, 0], [True] * 3, 2, True).cpu()
    assert torch.equal(mesh[0, 2:4, 2:4, 2:4], torch.full((2, 2, 2), 256.0, dtype=torch.float64))
    assert mesh.sum() == 2048


def test_set_paint_method():
    assert torchpm.ops.get_paint_method() == "auto"
    with pytest.raises(
        ValueError,
        match=r"set_paint_method: expected `method` to be one of \('auto', 'scatter', 'tiled'\), got 'shared'",
    ):
        torchpm.ops.set_paint_method("shared")
    assert torchpm.ops.get_paint_method() == "auto"
    # the CPU keeps its scatter kernel: the same bits whatever the choice
    g = torch.Generator().manual_seed(12)
    x = torch.rand(1, 3000, 3, generator=g) * 8
    w = torch.rand(1, 3000, generator=g)
    scatter = ops.paint(x, w, [8, 8, 8], [0, 0, 0], [True] * 3, 2, True)
    assert not torch.equal(scatter, ops._paint_tiled(x, w, [8, 8, 8], [0, 0, 0], [True] * 3, 2, True))
    assert torchpm.ops.set_paint_method("tiled") == "auto"
    try:
        assert torchpm.ops.get_paint_method() == "tiled"
        out = torchpm.paint(x, w, (8, 8, 8))
    finally:
        assert torchpm.ops.set_paint_method("auto") == "tiled"
    assert torch.equal(out, scatter)


@pytest.mark.parametrize(
    "order, weight_shape, expected",
    [(1, None, "scatter"), (2, None, "scatter"), (2, (1, 5), "scatter"), (2, (1, 5, 1), "scatter"),
     (3, None, "tiled"), (4, (1, 5), "tiled"), (1, (1, 5, 3), "tiled"), (2, (1, 5, 2), "tiled"),
     (2, (1, 5, 4), "tiled")],
)
def test_auto_paint_method_takes_the_tiled_paint_for_wide_windows_and_channels(order, weight_shape, expected):
    """The default: tiled for TSC/PCS and for several channels, scatter for one NGP/CIC
    channel and beyond the tiled paint's particle count; a forced method is used as it is."""
    weights = None if weight_shape is None else torch.ones(weight_shape)
    positions = torch.zeros(1, 5, 3)
    assert torchpm.ops.get_paint_method() == "auto"
    assert mass_assignment._cuda_paint_method(order, positions, weights) == expected
    # beyond the tiled paint's 2^31 - 1 particles per call: the scatter (a stride-0
    # view, nothing allocated)
    many = torch.zeros(()).expand(2, 2**30, 3)
    assert mass_assignment._cuda_paint_method(order, many, weights) == "scatter"
    assert mass_assignment._cuda_paint_method(order, many[:, : 2**30 - 1], weights) == expected
    for forced in ("scatter", "tiled"):
        previous = torchpm.ops.set_paint_method(forced)
        try:
            assert mass_assignment._cuda_paint_method(order, positions, weights) == forced
        finally:
            torchpm.ops.set_paint_method(previous)


@pytest.mark.parametrize("shape", [(), (3,), (5, 3), (1, 5, 2)])
def test_auto_paint_method_leaves_bad_positions_to_the_op(shape):
    """The routing reads no entry of `positions.shape` that may be missing: a tensor of
    the wrong shape reaches the op, whose ValueError names it (on CUDA as on the CPU)."""
    assert torchpm.ops.get_paint_method() == "auto"
    assert mass_assignment._cuda_paint_method(2, torch.zeros(shape), None) == "scatter"
    with pytest.raises(ValueError, match=r"expected `positions` of shape \(B, N, 3\)"):
        torchpm.paint(torch.zeros(shape), None, (4, 4, 4))


def _ops_called(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return {event.key for event in profile.key_averages()}


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
def test_cuda_paint_and_readout_backward_take_the_tiled_paint(device):
    g = torch.Generator().manual_seed(13)
    x = (torch.rand(2, 200000, 3, generator=g) * 32).to(device)
    w = torch.rand(2, 200000, 3, generator=g).to(device)
    field = torch.randn(2, 3, 32, 32, 32, generator=g).to(device).requires_grad_(True)
    # the default ("auto"): one CIC channel scatters, TSC and several channels tile
    called = _ops_called(lambda: torchpm.paint(x, None, (32, 32, 32)))
    assert "torchpm::paint" in called and "torchpm::_paint_tiled" not in called
    called = _ops_called(lambda: torchpm.paint(x, None, (32, 32, 32), order="tsc"))
    assert "torchpm::_paint_tiled" in called and "torchpm::paint" not in called
    called = _ops_called(lambda: torchpm.readout(field, x).backward(w))
    assert "torchpm::_paint_tiled" in called and "torchpm::paint" not in called
    field.grad = None
    previous = torchpm.ops.set_paint_method("scatter")
    try:
        called = _ops_called(lambda: torchpm.paint(x, w, (32, 32, 32), order="tsc"))
        assert "torchpm::paint" in called and "torchpm::_paint_tiled" not in called
        scatter = torchpm.paint(x, w, (32, 32, 32), order="tsc")
        torchpm.readout(field, x).backward(w)
        grad_scatter, field.grad = field.grad, None
    finally:
        torchpm.ops.set_paint_method(previous)
    previous = torchpm.ops.set_paint_method("tiled")
    try:
        called = _ops_called(lambda: torchpm.paint(x, w, (32, 32, 32), order="tsc"))
        tiled = torchpm.paint(x, w, (32, 32, 32), order="tsc")
        assert "torchpm::_paint_tiled" in called and "torchpm::paint" not in called
        called = _ops_called(lambda: torchpm.readout(field, x).backward(w))
        assert "torchpm::_paint_tiled" in called
        # deterministic mode wins: the node-by-node paint
        torch.use_deterministic_algorithms(True)
        try:
            called = _ops_called(lambda: torchpm.paint(x, w, (32, 32, 32)))
        finally:
            torch.use_deterministic_algorithms(False)
        assert "torchpm::_paint_deterministic" in called and "torchpm::_paint_tiled" not in called
    finally:
        torchpm.ops.set_paint_method(previous)
    torch.testing.assert_close(tiled, scatter, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(field.grad, grad_scatter, rtol=1e-5, atol=1e-4)
    # the CPU runs the same passes: equal up to float32 rounding of the sums
    cpu = ops._paint_tiled(x.cpu(), w.cpu(), [32, 32, 32], [0, 0, 0], [True] * 3, 3, True)
    torch.testing.assert_close(tiled.cpu(), cpu, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
def test_cuda_clustered_float32_and_float64(device):
    # the case the tiled paint is for: most particles in a few tiles
    g = torch.Generator().manual_seed(15)
    halo = 20 + 0.5 * torch.randn(1, 500000, 3, generator=g, dtype=torch.float64)
    field = torch.rand(1, 100000, 3, generator=g, dtype=torch.float64) * 64
    x = torch.cat([halo, field], dim=1)
    for dtype, tolerance in ((torch.float64, 1e-11), (torch.float32, 1e-3)):
        y = x.to(device, dtype)
        for order in (1, 2, 3, 4):
            tiled = ops._paint_tiled(y, None, [64, 64, 64], [0, 0, 0], [True] * 3, order, True)
            scatter = ops.paint(y, None, [64, 64, 64], [0, 0, 0], [True] * 3, order, True)
            torch.testing.assert_close(tiled, scatter, rtol=tolerance, atol=tolerance)
            assert abs(tiled.double().sum().item() - 600000) < 600000 * tolerance
