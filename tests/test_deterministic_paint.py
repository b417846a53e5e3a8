"""The paint computed node by node (torch.ops.torchpm._paint_deterministic,
csrc/node_paint.h): what torchpm.paint runs on CUDA under
torch.use_deterministic_algorithms(True), instead of the scatter kernel's atomics.

The CPU op runs the same per-particle, per-key and per-node functions as the CUDA
kernels, so these tests check the GPU's arithmetic here; the CUDA cases run the
kernels themselves when a GPU is there. What it shares with the tiled paint
(equality with the scatter paint and the twin, error reports, gradients, opcheck,
CUDA-graph capture) is tested in test_paint_variants.py; here, what makes it
deterministic: a hand-computed float32 sum whose value depends on the order of its
terms, independence of the thread count, and the routing in deterministic mode.
"""

import pytest
import torch

import torchpm
from conftest import DEVICES

CUDA_ONLY = [p for p in DEVICES if not isinstance(p, str)]
ops = torch.ops.torchpm


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
