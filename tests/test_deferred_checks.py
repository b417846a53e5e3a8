"""When bad particles are reported (torchpm.ops.error_checking): inside the call
("immediate"), or by the next torchpm op or torchpm.check() ("deferred"), never
dropped. The bookkeeping is device-generic, so deferred mode is exercised on the
CPU too; CUDA cases (graph capture, torch.compile reduce-overhead) run on a GPU."""

import os
import subprocess
import sys

import pytest
import torch

import torchpm
from torchpm.ops import paint_reference, readout_reference

from conftest import DEVICES

SHAPE = (4, 8, 8)
OFFSET = (2, 0, 0)
PERIODIC = (False, True, True)  # a block along x: it accepts x in [2, 5) for CIC
GEO = dict(offset=OFFSET, periodic=PERIODIC)

CUDA_ONLY = [p for p in DEVICES if not isinstance(p, str)]


@pytest.fixture
def mode():
    """Sets a mode for one test; restores the previous mode and clears whatever the
    test left pending."""
    previous = torchpm.get_error_checking()
    yield torchpm.set_error_checking
    torchpm.set_error_checking(previous)
    for _ in range(8):
        try:
            torchpm.check()
            break
        except ValueError:
            pass


def particles(device, bad_x=6.5):
    """Particle 0 inside the block, particle 1 at x = bad_x outside it."""
    return torch.tensor([[[3.25, 1.5, 2.0], [bad_x, 2.0, 2.0]]], dtype=torch.float64, device=device)


def settle(device):
    # Deferred counts reach the host when the stream gets there; waiting makes
    # "the next op raises" deterministic on CUDA (on the CPU they are there).
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def test_immediate_raises_inside_the_call(device, mode):
    mode("immediate")
    x = particles(device)
    with pytest.raises(ValueError, match=r"torchpm.paint: 1 of 2 particles.*nothing was painted"):
        torchpm.paint(x, None, SHAPE, **GEO)
    with pytest.raises(ValueError, match=r"torchpm.readout: 1 of 2 particles"):
        torchpm.readout(torch.zeros(1, *SHAPE, dtype=torch.float64, device=device), x, **GEO)
    torchpm.check()  # nothing was left behind


def test_auto_is_immediate_on_the_cpu(mode):
    mode("auto")
    with pytest.raises(ValueError, match=r"torchpm.paint: 1 of 2 particles"):
        torchpm.paint(particles("cpu"), None, SHAPE, **GEO)


def test_deferred_paint_is_reported_by_the_next_op(device, mode):
    mode("deferred")
    x = particles(device)
    mesh = torchpm.paint(x, None, SHAPE, **GEO)  # returns
    # the valid particle is painted as alone; the bad one poisons node (0, 0, 0)
    alone = paint_reference(x[:, :1].cpu(), None, list(SHAPE), list(OFFSET), list(PERIODIC), 2)
    mesh = mesh.cpu()
    assert torch.isnan(mesh[0, 0, 0, 0])
    expected = alone.clone()
    expected[0, 0, 0, 0] = mesh[0, 0, 0, 0]
    torch.testing.assert_close(mesh, expected, equal_nan=True, rtol=1e-12, atol=1e-12)
    settle(device)
    field = torch.ones(1, *SHAPE, dtype=torch.float64, device=device)
    with pytest.raises(ValueError) as error:
        torchpm.readout(field, x[:, :1], **GEO)
    message = str(error.value)
    assert message.startswith("torchpm.paint: 1 of 2 particles cannot be deposited")
    assert "particle 1 of batch 0" in message and "[2, 5)" in message
    assert "returned NaN in place" in message and "Reported late, by torchpm.readout" in message
    # raised once: the next op and check() are clean
    torch.testing.assert_close(torchpm.readout(field, x[:, :1], **GEO).cpu(), torch.ones(1, 1, dtype=torch.float64))
    torchpm.check()


def test_deferred_paint_of_many_particles_paints_the_valid_ones(mode):
    # above the CPU kernel's serial limit: the binned, threaded path
    mode("deferred")
    g = torch.Generator().manual_seed(5)
    x = torch.rand(1, 40000, 3, generator=g, dtype=torch.float64) * torch.tensor([2.9, 8.0, 8.0], dtype=torch.float64)
    x[..., 0] += 2.05  # inside [2, 5) along the block axis
    x[0, 12345, 0] = 5.5  # one outside
    mesh = torchpm.paint(x, None, SHAPE, **GEO)
    valid = torch.cat([x[:, :12345], x[:, 12346:]], dim=1)
    expected = paint_reference(valid, None, list(SHAPE), list(OFFSET), list(PERIODIC), 2)
    assert torch.isnan(mesh[0, 0, 0, 0])
    mesh[0, 0, 0, 0] = expected[0, 0, 0, 0]
    torch.testing.assert_close(mesh, expected, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"^torchpm.paint: 1 of 40000 particles.*particle 12345 of batch 0"):
        torchpm.check()


def test_deferred_readout_returns_nan_for_the_bad_particle_and_check_raises(device, mode):
    mode("deferred")
    x = particles(device)
    field = torch.randn(1, 3, *SHAPE, dtype=torch.float64, device=device)
    values = torchpm.readout(field, x, **GEO).cpu()
    good = readout_reference(field.cpu(), x[:, :1].cpu(), list(OFFSET), list(PERIODIC), 2)
    torch.testing.assert_close(values[:, :1], good, rtol=1e-12, atol=1e-12)
    assert torch.isnan(values[0, 1]).all()
    with pytest.raises(ValueError, match=r"torchpm.readout: 1 of 2 particles.*particle 1 of batch 0.*torchpm.check\(\)"):
        torchpm.check()
    torchpm.check()


def test_deferred_position_gradient_is_nan_for_the_bad_particle(device, mode):
    mode("deferred")
    x = particles(device, bad_x=float("nan"))
    field = torch.randn(1, *SHAPE, dtype=torch.float64, device=device)
    grad = torch.ops.torchpm._position_gradient(field, x, None, list(OFFSET), list(PERIODIC), 2).cpu()
    assert torch.isfinite(grad[0, 0]).all() and torch.isnan(grad[0, 1]).all()
    with pytest.raises(ValueError, match=r"torchpm._position_gradient: 1 of 2 particles.*non-finite \(NaN or Inf\) `positions`"):
        torchpm.check()


def test_deferred_non_finite_weights_name_the_argument(device, mode):
    mode("deferred")
    x = particles(device)[:, :1].expand(1, 4, 3).contiguous()
    w = torch.ones(1, 4, dtype=torch.float64, device=device)
    w[0, 2] = float("inf")
    mesh = torchpm.paint(x, w, SHAPE, **GEO)
    assert not torch.isfinite(mesh).all()  # painted: the Inf is in the mesh
    with pytest.raises(ValueError, match=r"torchpm.paint: `weights` contains NaN or Inf values for 1 particles, the first is particle 2"):
        torchpm.check()


def test_deferred_report_after_the_inputs_changed_names_op_and_argument(device, mode):
    mode("deferred")
    x = particles(device)
    torchpm.paint(x, None, SHAPE, **GEO)
    x[0, 1, 0] = 3.0  # in place: the call's positions are gone, so no particle is named
    with pytest.raises(ValueError) as error:
        torchpm.check()
    message = str(error.value)
    assert message.startswith(f"torchpm.paint: a call on {device.type}")
    assert "found 1 particles whose `positions` are non-finite or outside the mesh block" in message
    assert "set_error_checking(\"immediate\")" in message


def test_deferred_report_after_an_in_place_update_names_no_particle(device, mode):
    """torchpm's in-place updates bump the version counter, as torch's in-place ops do:
    a deferred report does not look for the bad particle in positions moved since."""
    mode("deferred")
    x = particles(device)  # particle 1 outside the block
    torchpm.readout(torch.zeros(1, *SHAPE, dtype=torch.float64, device=device), x, **GEO)
    shift = torch.tensor([[[3.0, 0.0, 0.0], [-3.0, 0.0, 0.0]]], dtype=torch.float64, device=device)
    torch.ops.torchpm._add_scaled_(x, shift, 1.0)  # particle 0 out (6.25), particle 1 in (3.5)
    with pytest.raises(ValueError) as error:
        torchpm.check()
    message = str(error.value)
    assert message.startswith(f"torchpm.readout: a call on {device.type}"), message
    assert "cannot be named" in message and "particle 0" not in message


def test_an_earlier_error_is_raised_before_the_next_op_runs(device, mode):
    mode("deferred")
    x = particles(device)
    field = torch.zeros(1, *SHAPE, dtype=torch.float64, device=device)
    torchpm.readout(field, x, **GEO)  # bad, returns
    settle(device)
    with pytest.raises(ValueError, match=r"^torchpm.readout: 1 of 2.*Reported late, by torchpm.paint"):
        torchpm.paint(x, None, SHAPE, **GEO)  # raises before painting: its own error never arises
    torchpm.check()


def test_switching_to_immediate_reports_what_deferred_calls_left(device, mode):
    mode("deferred")
    x = particles(device)
    torchpm.paint(x, None, SHAPE, **GEO)
    settle(device)
    mode("immediate")
    with pytest.raises(ValueError, match=r"^torchpm.paint.*Reported late, by torchpm.readout"):
        torchpm.readout(torch.zeros(1, *SHAPE, dtype=torch.float64, device=device), x[:, :1], **GEO)


def test_mode_setting_validates_and_returns_the_previous_mode(mode):
    mode("immediate")
    assert torchpm.set_error_checking("deferred") == "immediate"
    assert torchpm.get_error_checking() == "deferred"
    with pytest.raises(ValueError, match=r"`mode` must be \"auto\".*got \"later\""):
        torchpm.set_error_checking("later")
    with pytest.raises(TypeError, match="`mode` must be one of"):
        torchpm.set_error_checking(True)
    assert torchpm.get_error_checking() == "deferred"


def test_environment_variable_sets_the_mode():
    # one process (an import costs seconds): a bad value fails the import, naming the
    # variable; the mode is read on first use, so a corrected value then takes effect
    code = """
import os, torch
try:
    import torchpm
    print("imported")
except ValueError as error:
    print("error:", error)
os.environ["TORCHPM_ERROR_CHECKING"] = "deferred"
print("mode:", torch.ops.torchpm._error_checking())
"""
    env = dict(os.environ, TORCHPM_ERROR_CHECKING="sometimes")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("error:") and "TORCHPM_ERROR_CHECKING must be" in lines[0] and "sometimes" in lines[0]
    assert lines[-1] == "mode: deferred"


# --------------------------------------------------------------------------- CUDA graphs


def step(x, w, shape=(16, 16, 16)):
    rho = torchpm.paint(x, w, shape, order="cic")
    force = torch.stack([rho, 2 * rho, -rho], dim=1)
    return torchpm.readout(force, x, order="tsc")


def graph_inputs(device):
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(1, 4096, 3, generator=g) * 16).to(device)
    w = torch.rand(1, 4096, generator=g).to(device)
    return x, w


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
def test_cuda_graph_capture_of_paint_and_readout(device, mode):
    mode("auto")
    x, w = graph_inputs(device)
    expected = step(x, w)
    static_x, static_w = x.clone(), w.clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        for _ in range(3):
            step(static_x, static_w)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x, static_w)
    graph.replay()
    torch.cuda.synchronize(device)
    torch.testing.assert_close(static_out, expected, rtol=1e-4, atol=1e-5)
    torchpm.check()
    # a bad particle in a replay: the replay returns, torchpm.check() reports it once
    static_x[0, 5, 1] = float("nan")
    graph.replay()
    with pytest.raises(ValueError, match=r"^torchpm.paint: a call \(inside a CUDA graph.*`positions`"):
        torchpm.check()
    static_x.copy_(x)
    graph.replay()
    torchpm.check()
    torch.testing.assert_close(static_out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
def test_cuda_graph_replay_of_the_fused_step_names_both_ops(device, mode):
    """The fused readout + kicks + drift counts in the readout's slot: after a graph
    replay, the error names both ops that count there and what the fused one did."""
    mode("auto")
    x, _ = graph_inputs(device)
    field = torch.randn(1, 3, 16, 16, 16, generator=torch.Generator().manual_seed(4)).to(device)
    geometry = ([0, 0, 0], [True] * 3, 2)
    p = torch.zeros_like(x)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        torch.ops.torchpm._readout_kick_drift_(field, x.clone(), p.clone(), *geometry, [0.1], 0.0)
    torch.cuda.current_stream(device).wait_stream(side)
    torchpm.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.torchpm._readout_kick_drift_(field, x, p, *geometry, [0.1], 0.0)
    x[0, 7, 2] = float("nan")
    graph.replay()
    with pytest.raises(ValueError, match=r"^torchpm.readout \(or torchpm._readout_kick_drift_.*inside a CUDA graph"
                                         r".*Their momenta are NaN"):
        torchpm.check()
    assert torch.isnan(p[0, 7]).all() and torch.isfinite(p[0, 8]).all()


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
def test_torch_compile_reduce_overhead(device, mode):
    mode("auto")
    torch._dynamo.reset()
    x, w = graph_inputs(device)
    expected = step(x, w)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, recording, replays
        out = compiled(x, w).clone()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torchpm.check()
