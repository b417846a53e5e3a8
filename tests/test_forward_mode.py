"""Forward-mode AD: torchpm's ops have reverse-mode derivatives only, so a forward-mode
tangent (torch.autograd.forward_ad dual tensors, torch.func.jvp) raises, naming the op,
instead of being dropped (torch.library.register_autograd's kernel ran such a call
below autograd and returned a zero tangent). torch.autograd.functional.jvp, which takes
a Jacobian-vector product by double backward, works: checked against central finite
differences."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import torchpm
from torchpm.distributed._ops import pack_blocks, unpack_blocks
from torchpm.ops import fd4_gradient, fd4_gradient_transpose
from torchpm.ordering import permute
from torchpm.pm import add_scaled

SHAPE = (6, 5, 4)


def _inputs():
    generator = torch.Generator().manual_seed(7)
    positions = torch.rand(1, 30, 3, generator=generator, dtype=torch.float64) * torch.tensor(SHAPE, dtype=torch.float64)
    field = torch.randn(1, *SHAPE, generator=generator, dtype=torch.float64)
    return positions, field


# (name of the op that must be named, function of the one dual argument, the primal)
CASES = {
    "paint (positions)": ("torchpm::paint", lambda x, f: torchpm.cic_paint(x, None, SHAPE), 0),
    "paint (weights)": ("torchpm::paint", lambda w, f: torchpm.paint(_inputs()[0], w, SHAPE, order="tsc"), "weights"),
    "readout (field)": ("torchpm::readout", lambda f, x: torchpm.cic_readout(f, _inputs()[0]), 1),
    "readout (positions)": ("torchpm::readout", lambda x, f: torchpm.cic_readout(f, x), 0),
    "fd4_gradient": ("torchpm::_fd4_gradient", lambda f, x: fd4_gradient(f, (1.0, 1.0, 1.0)), 1),
    "fd4_gradient_transpose": ("torchpm::_fd4_gradient_transpose",
                               lambda f, x: fd4_gradient_transpose(f.unsqueeze(1).expand(1, 3, *SHAPE).contiguous(), (1.0, 1.0, 1.0)), 1),
    "add_scaled": ("torchpm::_add_scaled", lambda x, f: add_scaled(x, torch.ones_like(x), torch.tensor(0.5, dtype=torch.float64)), 0),
    "permute": ("torchpm::_gather_rows", lambda x, f: permute(torch.arange(30).flip(0).unsqueeze(0), x)[0], 0),
    "pack_blocks": ("torchpm::pack_blocks", lambda f, x: pack_blocks(f, 1, [2, 4]), 1),
    "unpack_blocks": ("torchpm::unpack_blocks", lambda f, x: unpack_blocks(f.reshape(-1), (1, *SHAPE), 1, [3, 3]), 1),
}


def _primal(which):
    positions, field = _inputs()
    if which == "weights":
        return torch.rand(1, 30, dtype=torch.float64), field
    return (positions, field) if which == 0 else (field, positions)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_forward_mode_tangent_raises_naming_the_op(case):
    op, function, which = CASES[case]
    primal, other = _primal(which)
    expected = function(primal, other)  # the call itself is valid
    with fwAD.dual_level():
        dual = fwAD.make_dual(primal, torch.ones_like(primal))
        with pytest.raises(NotImplementedError, match=f"{op}: forward-mode AD"):
            function(dual, other)
        # Without a tangent the same call inside a dual level runs as before.
        assert torch.equal(function(primal.clone(), other), expected)
    with pytest.raises(NotImplementedError, match=f"{op}: forward-mode AD"):
        torch.func.jvp(lambda p: function(p, other), (primal,), (torch.ones_like(primal),))


def test_func_jvp_through_a_simulation_raises():
    sim = torchpm.Simulation(4, 16.0, steps=1, dtype=torch.float64)
    noise = sim.white_noise(seed=1)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda n: sim(n).positions, (noise,), (torch.ones_like(noise),))
    # jacfwd and hessian (vmap over forward mode) get the forward-mode advice, not vmap's
    for transform in (torch.func.jacfwd, torch.func.hessian):
        with pytest.raises(NotImplementedError, match=r"forward-mode AD \(torch.func.jvp, jacfwd, hessian.*jacrev"):
            transform(lambda n: sim(n).positions.sum())(noise)


def test_autograd_functional_jvp_through_a_simulation_matches_finite_differences():
    sim = torchpm.Simulation(6, 24.0, steps=2, dtype=torch.float64)
    noise = sim.white_noise(seed=2)
    tangent = torch.randn(noise.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def final(n):
        state = sim(n)
        return torch.cat([state.positions, state.momenta], dim=-1)

    _, jvp = torch.autograd.functional.jvp(final, noise, tangent)
    eps = 1e-5
    difference = (final(noise + eps * tangent) - final(noise - eps * tangent)) / (2 * eps)
    scale = float(difference.abs().max())
    assert scale > 0.1
    assert float((jvp - difference).abs().max()) <= 1e-6 * scale
