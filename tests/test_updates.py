"""torch.ops.torchpm._add_scaled and torchpm.pm.add_scaled: x + y * f in one pass with the
rounding of torch's mul then add (the oracle: those two torch ops), bit for bit."""

import pytest
import torch

import torchpm  # noqa: F401  (loads the ops)
from torchpm.pm import add_scaled


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
        got = torch.ops.torchpm._add_scaled(x, y, factor)
        expected = torch_two_ops(x, y, factor)
        assert torch.equal(got.isnan(), expected.isnan())
        same = got.eq(expected) | got.isnan()
        assert bool(same.all()), f"factor {factor}: {int((~same).sum())} entries differ"


def test_strided_inputs(device):
    base = torch.randn(2, 5, 8, device=device)
    x, y = base[:, :, :3], base[:, :, 4:7]
    assert torch.equal(torch.ops.torchpm._add_scaled(x, y, 0.5), torch_two_ops(x, y, 0.5))


def test_front_end_takes_the_same_steps_with_and_without_a_graph(device):
    x = torch.randn(1, 1000, 3, device=device)
    y = torch.randn(1, 1000, 3, device=device)
    factor = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        plain = add_scaled(x, y, factor)
    recorded = add_scaled(x.requires_grad_(True), y, factor)
    assert recorded.requires_grad and torch.equal(plain, recorded.detach())
    (grad_factor,) = torch.autograd.grad(recorded.sum(), factor)
    torch.testing.assert_close(grad_factor, y.double().sum().to(grad_factor), rtol=1e-6, atol=0)


def test_autograd_and_opcheck(device):
    x = torch.randn(2, 7, 3, dtype=torch.float64, device=device, requires_grad=True)
    y = torch.randn(2, 7, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.torchpm._add_scaled(a, b, -0.7), (x, y))
    torch.library.opcheck(torch.ops.torchpm._add_scaled, (x, y, -0.7))


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
