"""torch.ops.torchpm._readout_kick_drift_ (torchpm.pm.readout_kick_drift_): the readout of
the force with the integrator's updates in its pass. The oracle is the composition it
replaces, bit for bit: torchpm.readout, then _add_scaled_ for each kick and the drift
(whose own oracle is torch's mul then add, test_updates.py)."""

import pytest
import torch

import torchpm
from torchpm.ops import fd4_gradient, readout
from torchpm.pm import add_scaled_, readout_kick_drift_

ORDERS = {"ngp": 1, "cic": 2, "tsc": 3, "pcs": 4}


def composed(field, x, p, offset, periodic, order, kicks, drift, check_finite=True):
    x, p = x.clone(), p.clone()
    force = readout(field, x, order=order, offset=offset, periodic=periodic, check_finite=check_finite)
    for k in kicks:
        add_scaled_(p, force, torch.tensor(k, dtype=torch.float64))
    if drift is not None:
        add_scaled_(x, p, torch.tensor(drift, dtype=torch.float64))
    return x, p


def particles(batch, count, low, high, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = low + (high - low) * torch.rand(batch, count, 3, generator=generator, dtype=torch.float64)
    p = torch.randn(batch, count, 3, generator=generator, dtype=torch.float64)
    return x.to(dtype).to(device), p.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("layout", ["interleaved", "planar"])
def test_equals_readout_then_updates(device, dtype, order, layout):
    shape = (12, 10, 9)
    generator = torch.Generator().manual_seed(1)
    potential = torch.randn(2, *shape, generator=generator, dtype=torch.float64).to(dtype).to(device)
    field = fd4_gradient(potential, [0.7, -1.1, 0.9])  # (B, 3, ...) interleaved, as the simulation reads it
    if layout == "planar":
        field = field.contiguous()
    assert (field.stride(1) == 1) == (layout == "interleaved")
    # Periodic, and one period outside on each side (unwrapped drifted particles); more
    # particles than one run of the kernel, in random order.
    x, p = particles(2, 5000, -12.0, 24.0, dtype, device)
    for kicks, drift in (([0.31], None), ([0.31], 0.057), ([0.31, -0.17], 0.057), ([0.31, -0.17], None)):
        want_x, want_p = composed(field, x, p, [0, 0, 0], [True] * 3, order, kicks, drift)
        got_x, got_p = x.clone(), p.clone()
        with torch.no_grad():
            out = readout_kick_drift_(torchpm.LocalMesh(shape), field, got_x, got_p,
                                      [torch.tensor(k, dtype=torch.float64) for k in kicks],
                                      None if drift is None else torch.tensor(drift, dtype=torch.float64),
                                      order=order)
        assert out[0] is got_x and out[1] is got_p  # in place
        assert torch.equal(got_p, want_p), (kicks, drift)
        assert torch.equal(got_x, want_x), (kicks, drift)
        if drift is None:
            assert torch.equal(got_x, x)


@pytest.mark.parametrize("order", ["cic", "pcs"])
def test_block_geometry(device, order):
    """A rank's block: non-periodic x and y with an offset (particles inside the block
    less the stencil's reach), periodic z."""
    width = ORDERS[order]
    shape, offset = (10, 8, 16), [20, -4, 0]
    generator = torch.Generator().manual_seed(2)
    field = torch.randn(1, 3, *shape, generator=generator, dtype=torch.float64).to(device)
    x, p = particles(1, 3000, 0.0, 1.0, torch.float64, device, seed=3)
    for d in range(2):
        low, high = offset[d] + width / 2 - 1, offset[d] + shape[d] - width / 2
        x[..., d] = low + (high - low) * 0.999 * x[..., d]
    x[..., 2] = -16.0 + 48.0 * x[..., 2]
    periodic = [False, False, True]
    want_x, want_p = composed(field, x, p, offset, periodic, order, [0.2, 0.3], 0.1)
    with torch.no_grad():
        torch.ops.torchpm._readout_kick_drift_(field, x, p, offset, periodic, ORDERS[order], [0.2, 0.3], 0.1)
    assert torch.equal(p, want_p) and torch.equal(x, want_x)


@pytest.fixture(params=["immediate", "deferred"])
def checking(request):
    """Runs a test in each error-checking mode (restored afterwards). Returns the mode;
    `raising` below says what its error names."""
    previous = torchpm.set_error_checking(request.param)
    yield request.param
    torchpm.set_error_checking(previous)


def raising(device, mode, named, unnamed):
    """The error of a left-out particle: the CPU op names it in both modes, the CUDA op
    only in immediate mode (deferred, it keeps nothing to name it by). Either way the
    error says what the op did; deferred, it surfaces at torchpm.check() at the latest."""
    if device.type == "cuda" and mode == "deferred":
        detail = unnamed + r".*every other particle was updated.*cannot be named"
    else:
        detail = named + r".*every other particle was updated"
    return pytest.raises(ValueError, match=r"torchpm\._readout_kick_drift_: .*" + detail)


def test_rejected_particle_raises_and_is_left_out(device, checking):
    """A particle outside the block: the op raises naming it, where it was read; every
    other particle is updated as the composition updates it, the rejected one is not
    (momentum NaN, position unchanged)."""
    shape = (8, 8, 8)
    field = torch.randn(1, 3, *shape, dtype=torch.float64, device=device)
    x, p = particles(1, 3000, 1.0, 6.0, torch.float64, device, seed=4)
    x[0, 1234] = torch.tensor([7.5, 3.0, 3.0], dtype=torch.float64)  # past the block's last CIC cell along x
    periodic = [False, True, True]
    keep = torch.ones(3000, dtype=torch.bool)
    keep[1234] = False
    want_x, want_p = composed(field, x[:, keep], p[:, keep], [0, 0, 0], periodic, "cic", [0.2], 0.1)
    before = x[0, 1234].clone()
    with torch.no_grad(), raising(device, checking, r"particle 1234 of batch 0 at position \(7.5, 3, 3\)",
                                  r"found 1 particles whose `positions` are non-finite or outside"):
        torch.ops.torchpm._readout_kick_drift_(field, x, p, [0, 0, 0], periodic, 2, [0.2], 0.1)
        torchpm.check()  # deferred: raised here
    assert torch.equal(x[:, keep], want_x) and torch.equal(p[:, keep], want_p)
    assert torch.equal(x[0, 1234], before) and torch.isnan(p[0, 1234]).all()


def test_non_finite_mesh_value(device, checking):
    """A particle reading a NaN node raises (check_finite), naming it, and is left out
    (momentum NaN in every component, position as read); with check_finite=False the
    NaN is carried into its momentum and position, as the composition carries it."""
    shape = (8, 8, 8)
    field = torch.randn(1, 3, *shape, dtype=torch.float64, device=device)
    field[0, 1, 2, 2, 2] = float("nan")
    x, p = particles(1, 2000, 5.0, 8.0, torch.float64, device, seed=5)
    x[0, 777] = torch.tensor([2.5, 2.5, 2.5], dtype=torch.float64)  # reads node (2, 2, 2)
    want_x, want_p = composed(field, x, p, [0, 0, 0], [True] * 3, "cic", [0.2, 0.1], 0.3, check_finite=False)
    assert not torch.isfinite(want_p[0, 777]).all()
    got_x, got_p = x.clone(), p.clone()
    with torch.no_grad():
        torch.ops.torchpm._readout_kick_drift_(field, got_x, got_p, [0, 0, 0], [True] * 3, 2, [0.2, 0.1], 0.3, False)
    for got, want in ((got_x, want_x), (got_p, want_p)):  # NaN where the composition has NaN, else equal
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    keep = torch.ones(2000, dtype=torch.bool)
    keep[777] = False
    with torch.no_grad(), raising(device, checking, r"`mesh` contains NaN or Inf values for 1 particles, the first "
                                                    r"is particle 777 of batch 0",
                                  r"found 1 particles with NaN or Inf `mesh`"):
        torch.ops.torchpm._readout_kick_drift_(field, x, p, [0, 0, 0], [True] * 3, 2, [0.2, 0.1], 0.3)
        torchpm.check()  # deferred: raised here
    assert torch.equal(x[:, keep], want_x[:, keep]) and torch.equal(p[:, keep], want_p[:, keep])
    assert torch.isnan(p[0, 777]).all() and torch.equal(x[0, 777], torch.tensor([2.5] * 3, dtype=torch.float64,
                                                                                 device=device))


def test_non_finite_value_with_finite_components_is_left_out(device):
    """A particle reading an Inf in one component only is left out whole: momentum NaN
    in all three, position as read (not Inf in that component and updated in the
    others)."""
    shape = (8, 8, 8)
    field = torch.randn(1, 3, *shape, dtype=torch.float64, device=device)
    field[0, 1, 3, 3, 3] = float("inf")
    x, p = particles(1, 500, 5.0, 8.0, torch.float64, device, seed=9)
    x[0, 7] = torch.tensor([3.25, 3.0, 3.75], dtype=torch.float64)  # reads node (3, 3, 3) with weight > 0
    before = x[0, 7].clone()
    previous = torchpm.set_error_checking("deferred")
    try:
        with torch.no_grad():
            torch.ops.torchpm._readout_kick_drift_(field, x, p, [0, 0, 0], [True] * 3, 2, [0.2], 0.1)
        assert torch.isnan(p[0, 7]).all() and torch.equal(x[0, 7], before)
        with pytest.raises(ValueError, match=r"_readout_kick_drift_: .*(`mesh` contains NaN or Inf|NaN or Inf `mesh`)"):
            torchpm.check()
    finally:
        torchpm.set_error_checking(previous)


def test_in_place_writes_bump_the_version_counters(device):
    """As torch's in-place ops do: whatever kept the tensors (autograd, a deferred error
    check) sees that they changed."""
    field = torch.randn(1, 3, 6, 6, 6, dtype=torch.float64, device=device)
    x, p = particles(1, 50, 0.0, 6.0, torch.float64, device, seed=10)
    versions = x._version, p._version
    with torch.no_grad():
        torch.ops.torchpm._readout_kick_drift_(field, x, p, [0, 0, 0], [True] * 3, 2, [0.2], 0.1)
    assert x._version > versions[0] and p._version > versions[1]
    versions = x._version, p._version
    with torch.no_grad():
        readout_kick_drift_(torchpm.LocalMesh(6), field, x, p, [torch.tensor(0.5, dtype=torch.float64)],
                            torch.tensor(0.25, dtype=torch.float64))
    assert x._version > versions[0] and p._version > versions[1]


def test_deferred_error_is_reported_by_the_next_op(device):
    shape = (8, 8, 8)
    field = torch.randn(1, 3, *shape, dtype=torch.float64, device=device)
    x, p = particles(1, 100, 1.0, 6.0, torch.float64, device, seed=6)
    x[0, 5, 0] = float("nan")
    previous = torchpm.set_error_checking("deferred")
    try:
        with torch.no_grad():
            torch.ops.torchpm._readout_kick_drift_(field, x, p, [0, 0, 0], [True] * 3, 2, [0.2], 0.1)
        assert torch.isnan(p[0, 5]).all()
        with pytest.raises(ValueError, match="non-finite"):
            torchpm.check()
    finally:
        torchpm.set_error_checking(previous)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f, x, p: (f[:, :1], x, p), r"expected `mesh` of shape \(B, 3, nx, ny, nz\)"),
        (lambda f, x, p: (f, x, p[:, :-1]), "expected `momenta` of the shape, dtype and device of `positions`"),
        (lambda f, x, p: (f, x, p.float()), "expected `momenta` of the shape, dtype and device of `positions`"),
        (lambda f, x, p: (f, x.transpose(0, 1), p.transpose(0, 1)), "contiguous"),
        (lambda f, x, p: (f, x, x), "`positions` and `momenta` share memory"),
        # A mesh that holds the particles: read while they are written.
        (lambda f, x, p: (f, f.view(-1)[:30].view(2, 5, 3), p), "`mesh` and `positions` share memory"),
        (lambda f, x, p: (f, x, f.view(-1)[-30:].view(2, 5, 3)), "`mesh` and `momenta` share memory"),
        (lambda f, x, p: (f, x[..., :2], p[..., :2]), r"expected `positions` of shape \(B, N, 3\)"),
    ],
)
def test_bad_arguments_raise(device, change, message):
    field = torch.zeros(2, 3, 4, 4, 4, dtype=torch.float64, device=device)
    x = torch.ones(2, 5, 3, dtype=torch.float64, device=device)
    p = torch.zeros(2, 5, 3, dtype=torch.float64, device=device)
    f, x, p = change(field, x, p)
    with pytest.raises(ValueError, match=message):
        torch.ops.torchpm._readout_kick_drift_(f, x, p, [0, 0, 0], [True] * 3, 2, [0.2], 0.1)


@pytest.mark.parametrize("kicks", [[], [0.1, 0.2, 0.3]])
def test_one_or_two_kicks(device, kicks):
    field = torch.zeros(1, 3, 4, 4, 4, device=device)
    x, p = torch.ones(1, 5, 3, device=device), torch.zeros(1, 5, 3, device=device)
    with pytest.raises(ValueError, match="expected one or two `kicks`"):
        torch.ops.torchpm._readout_kick_drift_(field, x, p, [0, 0, 0], [True] * 3, 2, kicks, None)


def test_opcheck(device):
    field = torch.randn(2, 3, 5, 6, 7, dtype=torch.float64, device=device)
    x, p = particles(2, 40, 0.0, 5.0, torch.float64, device, seed=7)
    torch.library.opcheck(torch.ops.torchpm._readout_kick_drift_,
                          (field, x, p, [0, 0, 0], [True] * 3, 2, [0.2, -0.1], 0.05))


def test_front_end_refuses_a_graph_and_composes_otherwise(device):
    field = torch.randn(1, 3, 6, 6, 6, dtype=torch.float64, device=device)
    x, p = particles(1, 300, 0.0, 6.0, torch.float64, device, seed=8)
    mesh = torchpm.LocalMesh(6)
    with pytest.raises(ValueError, match="outside a graph"):
        readout_kick_drift_(mesh, field.requires_grad_(True), x, p, [torch.tensor(0.5, dtype=torch.float64)])
    field = field.detach()
    # A strided momentum array is not the op's: the front end composes readout and add_scaled_.
    wide = torch.zeros(1, 300, 6, dtype=torch.float64, device=device)
    strided = wide[..., ::2]
    strided.copy_(p)
    want_x, want_p = composed(field, x, p, [0, 0, 0], [True] * 3, "cic", [0.5], 0.25)
    with torch.no_grad():
        got_x, got_p = readout_kick_drift_(mesh, field, x, strided, [torch.tensor(0.5, dtype=torch.float64)],
                                           torch.tensor(0.25, dtype=torch.float64))
    assert torch.equal(got_x, want_x) and torch.equal(got_p, want_p)
