"""The real-space 4-point gradient (torch.ops.torchpm._fd4_gradient) and its transpose.

Oracles: the Fourier multiplier ``i (8 sin w - sin 2w) / 6`` applied with torch.fft,
polynomials of degree <= 4 (the stencil differentiates them exactly), the adjoint
identity ``<D f, g> = <f, D^T g>``, gradcheck, opcheck, and the Fourier-space force
path of :func:`torchpm.fourier.gradient_inverse_laplacian`.
"""

import itertools
import math

import pytest
import torch

import torchpm
from torchpm.fourier import FourierKernels, gradient_inverse_laplacian, gradient_transpose_k
from torchpm.mesh import LocalMesh
from torchpm.ops import fd4_gradient, fd4_gradient_transpose

PERIODIC = list(itertools.product([True, False], repeat=3))


def fourier_fd4(field, scale):
    """Pure-torch periodic reference: ``scale_i * IDFT[i (8 sin w_i - sin 2 w_i)/6 DFT(f)]``."""
    shape = field.shape[1:]
    spectrum = torch.fft.fftn(field.to(torch.float64), dim=(1, 2, 3))
    out = []
    for axis, n in enumerate(shape):
        w = 2 * math.pi * torch.fft.fftfreq(n, dtype=torch.float64, device=field.device)
        multiplier = 1j * (8 * torch.sin(w) - torch.sin(2 * w)) / 6
        view = [1, 1, 1, 1]
        view[axis + 1] = n
        out.append(float(scale[axis]) * torch.fft.ifftn(spectrum * multiplier.view(view), dim=(1, 2, 3)).real)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# Small fields go node by node through the functions the CUDA kernels are made of
# (csrc/finite_difference.h), larger ones (>= 4096 output nodes) through the CPU's
# row kernel: both are in every list below.
@pytest.mark.parametrize("shape", [(8, 6, 5), (1, 2, 3), (4, 7, 16), (5, 1, 9), (24, 20, 18), (3, 40, 50)])
def test_periodic_matches_fourier_multiplier(device, dtype, shape):
    torch.manual_seed(0)
    field = torch.randn(2, *shape, dtype=dtype, device=device)
    scale = (1.5, -0.25, 3.0)
    got = fd4_gradient(field, scale)
    expected = fourier_fd4(field, scale)
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    assert got.shape == (2, 3, *shape) and got.dtype == dtype
    # Written interleaved (a node's three components side by side) on every path.
    assert got.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("periodic", PERIODIC)
@pytest.mark.parametrize("shape", [(9, 10, 11), (24, 22, 20)])
def test_polynomials_are_differentiated_exactly(device, periodic, shape):
    """``D x^3 = 3 x^2`` and ``D x^4 = 4 x^3`` along a non-periodic axis (the stencil is
    exact to degree 4); a periodic axis sees a constant and gives 0."""
    axes = [torch.arange(n, dtype=torch.float64, device=device) for n in shape]
    x, y, z = torch.meshgrid(*axes, indexing="ij")
    coefficients = [0.0 if p else 1.0 for p in periodic]
    field = coefficients[0] * x**3 + coefficients[1] * y**4 + coefficients[2] * (z**3 - 2 * z**2) + 7.0
    got = fd4_gradient(field[None], (1.0, 1.0, 1.0), periodic)[0]
    # The output node o sits at input node o + 2 on a non-periodic axis.
    inner = tuple(slice(None) if p else slice(2, n - 2) for p, n in zip(periodic, shape))
    x, y, z = x[inner], y[inner], z[inner]
    expected = torch.stack([
        coefficients[0] * 3 * x**2,
        coefficients[1] * 4 * y**3,
        coefficients[2] * (3 * z**2 - 4 * z),
    ])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("periodic", PERIODIC)
@pytest.mark.parametrize("shape", [(9, 6, 7), (20, 18, 16)])
def test_transpose_is_the_adjoint(device, dtype, periodic, shape):
    torch.manual_seed(1)
    field = torch.randn(2, *shape, dtype=dtype, device=device)
    scale = torch.tensor([0.5, -2.0, 1.25], dtype=dtype, device=device)
    gradient = fd4_gradient(field, scale, periodic)
    other = torch.randn_like(gradient)
    back = fd4_gradient_transpose(other, scale, periodic)
    assert back.shape == field.shape
    lhs = (gradient.double() * other.double()).sum()
    rhs = (field.double() * back.double()).sum()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert abs(lhs - rhs) <= tolerance * (gradient.double().norm() * other.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_node_by_node_path_equals_the_row_kernel_bit_for_bit(device, dtype):
    """A large field (row kernel on the CPU) against crops of it small enough for the
    node-by-node path: with non-periodic x and y the stencil is local, so each crop's
    gradient is a block of the whole one, and both paths round alike."""
    torch.manual_seed(7)
    field = torch.randn(1, 20, 20, 20, dtype=dtype, device=device)
    scale = (0.3, -1.7, 2.9)
    whole = fd4_gradient(field, scale, (False, False, True))
    assert whole[0, 0].numel() >= 4096
    for x0 in range(0, 16, 5):
        for y0 in range(0, 16, 5):
            crop = field[:, x0 : x0 + 9, y0 : y0 + 9].contiguous()
            part = fd4_gradient(crop, scale, (False, False, True))
            assert part[0, 0].numel() < 4096
            assert torch.equal(part, whole[:, :, x0 : x0 + 5, y0 : y0 + 5]), (x0, y0)


@pytest.mark.parametrize("periodic", [(True, True, True), (False, True, False)])
def test_non_periodic_axis_is_the_periodic_result_on_a_filled_halo(device, periodic):
    """A block whose halo of 2 holds the periodic neighbours gives the periodic gradient
    of its interior: the distributed mesh's use of the op."""
    torch.manual_seed(2)
    field = torch.randn(1, 8, 9, 10, dtype=torch.float64, device=device)
    padded = field
    for axis, p in enumerate(periodic):
        if not p:
            dim = axis + 1
            n = field.shape[dim]
            padded = torch.cat([padded.narrow(dim, n - 2, 2), padded, padded.narrow(dim, 0, 2)], dim=dim)
    torch.testing.assert_close(fd4_gradient(padded, (1.0, 2.0, 3.0), periodic),
                               fd4_gradient(field, (1.0, 2.0, 3.0), True), rtol=0, atol=1e-12)


def test_channel_slice_is_read_in_place(device):
    """Channels 1..3 of a 4-channel mesh (strided batch) give the contiguous result."""
    torch.manual_seed(3)
    painted = torch.randn(2, 4, 6, 5, 7, dtype=torch.float64, device=device)
    view = painted[:, 1:]
    scale = (1.0, 0.5, -1.0)
    torch.testing.assert_close(fd4_gradient_transpose(view, scale), fd4_gradient_transpose(view.contiguous(), scale),
                               rtol=0, atol=0)
    torch.testing.assert_close(fd4_gradient(painted[:, 2], scale), fd4_gradient(painted[:, 2].contiguous(), scale),
                               rtol=0, atol=0)


@pytest.mark.parametrize("periodic", [(True, True, True), (False, True, False)])
def test_gradcheck(device, periodic):
    torch.manual_seed(4)
    field = torch.randn(2, 6, 5, 7, dtype=torch.float64, device=device, requires_grad=True)
    scale = torch.tensor([0.7, -1.1, 0.3], dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f, s: fd4_gradient(f, s, periodic), (field, scale))
    assert torch.autograd.gradgradcheck(lambda f, s: fd4_gradient(f, s, periodic), (field, scale))
    grad = fd4_gradient(field, scale, periodic).detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda g, s: fd4_gradient_transpose(g, s, periodic), (grad, scale))
    assert torch.autograd.gradgradcheck(lambda g, s: fd4_gradient_transpose(g, s, periodic), (grad, scale))


def test_opcheck(device):
    field = torch.randn(2, 6, 5, 7, dtype=torch.float64, device=device, requires_grad=True)
    scale = torch.tensor([0.7, -1.1, 0.3], dtype=torch.float64, device=device)
    for periodic in ([True, True, True], [False, True, False]):
        torch.library.opcheck(torch.ops.torchpm._fd4_gradient, (field, scale, periodic))
        grad = torch.randn(2, 3, *fd4_gradient(field, scale, periodic).shape[2:], dtype=torch.float64,
                           device=device, requires_grad=True)
        torch.library.opcheck(torch.ops.torchpm._fd4_gradient_transpose, (grad, scale, periodic))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda d: fd4_gradient(torch.zeros(6, 5, 7, device=d), (1, 1, 1)), "shape \\(B, nx, ny, nz\\)"),
        (lambda d: fd4_gradient(torch.zeros(1, 6, 5, 7, dtype=torch.int64, device=d), (1, 1, 1)),
         "`field` to be float32 or float64"),
        (lambda d: fd4_gradient(torch.zeros(1, 6, 4, 7, device=d), (1, 1, 1), (True, False, True)),
         "at least 5 nodes along axis 1"),
        (lambda d: fd4_gradient(torch.zeros(1, 6, 5, 7, device=d), (1, 1)), "`scale` must have 3 entries"),
        (lambda d: torch.ops.torchpm._fd4_gradient(torch.zeros(1, 6, 5, 7, device=d),
                                                    torch.ones(3, dtype=torch.float64, device=d), [True] * 3),
         "`scale` to be a \\(3,\\) tensor"),
        (lambda d: fd4_gradient(torch.zeros(1, 6, 5, 7, device=d), (1, 1, 1), (True, 1, True)),
         "`periodic` must be a bool or 3 bools"),
        (lambda d: fd4_gradient_transpose(torch.zeros(1, 2, 6, 5, 7, device=d), (1, 1, 1)),
         "shape \\(B, 3, ox, oy, oz\\)"),
    ],
)
def test_bad_arguments_raise(device, call, message):
    with pytest.raises(ValueError, match=message):
        call(device)


def test_scale_of_the_wrong_type_raises():
    with pytest.raises(TypeError, match="`scale` must be 3 numbers or a \\(3,\\) tensor"):
        fd4_gradient(torch.zeros(1, 6, 5, 7), (1.0, "a", 1.0))
    with pytest.raises(TypeError, match="`scale` must be 3 numbers"):
        fd4_gradient(torch.zeros(1, 6, 5, 7), 2.0)


def test_fake_kernels_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = fd4_gradient(torch.zeros(2, 9, 6, 7), torch.ones(3), (False, True, True))
    with FakeTensorMode():
        field = torch.empty(2, 9, 6, 7)
        scale = torch.empty(3)
        fake = fd4_gradient(field, scale, (False, True, True))
        assert fake.shape == (2, 3, 5, 6, 7)
        assert fake.stride() == real.stride()
        assert fd4_gradient_transpose(torch.empty(2, 3, 5, 6, 7), scale, (False, True, True)).shape == (2, 9, 6, 7)
        with pytest.raises(ValueError, match="at least 5 nodes along axis 1"):
            fd4_gradient(torch.empty(2, 9, 4, 7), scale, (True, False, True))


# ------------------------------------------------------------- force-field use


@pytest.mark.parametrize("shape", [(16, 12, 10), (6, 6, 6)])
def test_forces_in_real_space_match_fourier_space(device, shape):
    """The fd4 force field and its transpose spectrum through the real-space stencil
    equal the Fourier-space products (non-cubic cells, per-axis factors)."""
    torch.manual_seed(5)
    mesh = LocalMesh(shape)
    kernels = FourierKernels(mesh, (1.0, 0.8, 1.3), dtype=torch.float64, device=device)
    assert kernels.real_space_gradient
    fourier = FourierKernels(mesh, (1.0, 0.8, 1.3), dtype=torch.float64, device=device)
    fourier.real_space_gradient = False
    density_k = mesh.rfftn(torch.randn(2, *shape, dtype=torch.float64, device=device))
    factors = [2.0, torch.tensor(0.5, dtype=torch.float64), 1.5]
    real = gradient_inverse_laplacian(density_k, kernels, gradient_scale=factors)
    reference = gradient_inverse_laplacian(density_k, fourier, gradient_scale=factors)
    torch.testing.assert_close(real, reference, rtol=0, atol=1e-13 * reference.abs().max().item())
    cotangent = torch.randn(2, 3, *shape, dtype=torch.float64, device=device)
    real_k = gradient_transpose_k(cotangent, kernels, factors)
    reference_k = gradient_transpose_k(cotangent, fourier, factors)
    torch.testing.assert_close(real_k, reference_k, rtol=0, atol=1e-12 * reference_k.abs().max().item())


def test_exact_gradient_stays_in_fourier_space():
    kernels = FourierKernels(LocalMesh(8), (1.0, 1.0, 1.0), gradient="exact")
    assert not kernels.real_space_gradient


def test_force_scale_gradient_flows_through_the_stencil():
    """d/d(Omega_m) of a force sum through the real-space path equals the Fourier path's."""
    torch.manual_seed(6)
    mesh = LocalMesh(8)
    positions = torch.rand(1, 100, 3, dtype=torch.float64) * 8
    results = []
    for real in (True, False):
        kernels = FourierKernels(mesh, (2.0, 2.0, 2.0), dtype=torch.float64)
        kernels.real_space_gradient = real
        omega = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
        forces = torchpm.pm.compute_forces(positions, kernels, a=1.0, particle_mass=512 / 100,
                                           force_scale=1.5 * omega)
        (grad,) = torch.autograd.grad((forces * torch.linspace(-1, 1, 300, dtype=torch.float64).view(1, 100, 3)).sum(),
                                      omega)
        results.append((forces.detach(), grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-12, atol=0)
    assert results[0][1].abs() > 0
