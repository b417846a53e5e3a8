"""torchpm.nn: layers against independent references, identity corrections, gradients,
a short training run, safe weight files and torch.compile."""

from __future__ import annotations

import math
import os
import pickle
import re
import sys

import pytest
import torch

import torchpm
from torchpm.analysis import correlation_function, cross_correlation, cross_power, power_spectrum
from torchpm.nn import (
    CICPaint,
    CICReadout,
    CorrelationFunction,
    NeuralSplineCorrection,
    PGDCorrection,
    PowerSpectrum,
    load_weights,
    save_weights,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_force_correction as training  # noqa: E402

DTYPES = [torch.float32, torch.float64]


def _tiny(dtype=torch.float64, **options):
    settings = dict(n_particles=4, box_size=40.0, mesh_factor=1, a_start=0.2, steps=2, dtype=dtype)
    settings.update(options)
    return torchpm.Simulation(**settings)


def _corrections(dtype, device):
    return {
        "spline": NeuralSplineCorrection(k_max=1.0, knots=5, hidden=(6,), dtype=dtype, device=device),
        "pgd": PGDCorrection(k_long=0.1, k_short=0.5, dtype=dtype, device=device),
    }


# ----------------------------------------------------------------------------- identity


@pytest.mark.usefixtures("reproducible")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["spline", "pgd"])
def test_untrained_correction_reproduces_the_plain_run_bit_for_bit(kind, dtype, device):
    correction = _corrections(dtype, device)[kind]
    plain = _tiny(dtype, n_particles=8, box_size=64.0, mesh_factor=2, steps=4).to(device)
    corrected = _tiny(dtype, n_particles=8, box_size=64.0, mesh_factor=2, steps=4, force_correction=correction).to(device)
    noise = plain.white_noise(batch=2, seed=4)
    with torch.no_grad():
        a, b = plain(noise), corrected(noise)
    assert torch.equal(a.positions, b.positions) and torch.equal(a.momenta, b.momenta)
    # and the filter itself is exactly one everywhere
    k = corrected.kernels("force").k_magnitude
    assert bool((correction(k, torch.tensor(0.5, dtype=dtype, device=device)) == 1).all())


# ----------------------------------------------------------------------------- filters


def test_spline_reproduces_constants_and_lines():
    """Cubic B-splines sum to one and reproduce straight lines between the end knots."""
    module = NeuralSplineCorrection(k_max=2.0, knots=8, dtype=torch.float64)
    from torchpm.nn import _cubic_bspline

    k = torch.linspace(0, 3.0, 301, dtype=torch.float64)
    constant = torch.full((8,), 0.3, dtype=torch.float64)
    torch.testing.assert_close(_cubic_bspline(k, constant, 2.0), torch.full_like(k, 0.3), rtol=0, atol=1e-15)
    line = torch.linspace(0, 7, 8, dtype=torch.float64)  # control point j at k = 2 j / 7
    inside = (k >= 2.0 / 7) & (k <= 2.0 * 6 / 7)
    torch.testing.assert_close(_cubic_bspline(k, line, 2.0)[inside], (k * 3.5)[inside], rtol=0, atol=1e-12)
    assert module.control_points(0.5).shape == (8,)


def test_pgd_filter_by_hand():
    module = PGDCorrection(k_long=0.2, k_short=1.5, alpha=0.3, mu=0.7, dtype=torch.float64)
    k = torch.tensor([0.0, 0.1, 0.5, 2.0], dtype=torch.float64)
    a = 0.5
    expected = [1.0] + [1 + 0.3 * a**0.7 * math.exp(-((0.2 / q) ** 2) - (q / 1.5) ** 4) for q in (0.1, 0.5, 2.0)]
    torch.testing.assert_close(module(k, a), torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=0)


# ----------------------------------------------------------------------------- gradients


def _projection(state):
    generator = torch.Generator().manual_seed(7)
    u = torch.randn(state.positions.shape, generator=generator, dtype=torch.float64)
    return (u * state.positions).sum() + (u.flip(0) * state.momenta).sum()


@pytest.mark.parametrize("kind", ["spline", "pgd"])
def test_gradcheck_correction_parameters_through_the_simulation(kind):
    torch.manual_seed(1)
    if kind == "spline":  # small, so that gradcheck's finite differences stay cheap
        correction = NeuralSplineCorrection(k_max=1.0, knots=4, hidden=(3,), dtype=torch.float64)
    else:
        correction = _corrections(torch.float64, "cpu")[kind]
    with torch.no_grad():  # away from the identity, where some gradients vanish
        for parameter in correction.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, dtype=torch.float64))
    sim = _tiny(force_correction=correction)
    noise = sim.white_noise(seed=2)
    names = [name for name, _ in correction.named_parameters()]

    def run(*values):
        parameters = {f"force_correction.{name}": value for name, value in zip(names, values)}
        return _projection(torch.func.functional_call(sim, parameters, (noise,)))

    values = tuple(p.detach().clone().requires_grad_(True) for p in correction.parameters())
    assert torch.autograd.gradcheck(run, values, eps=1e-6, atol=1e-6, rtol=1e-4)
    # every parameter receives a non-zero gradient through backward()
    _projection(sim(noise)).backward()
    for name, parameter in correction.named_parameters():
        assert parameter.grad is not None and float(parameter.grad.abs().max()) > 0, name


# ----------------------------------------------------------------------------- layers


@pytest.mark.parametrize("dtype", DTYPES)
def test_power_spectrum_layer_matches_the_analysis_estimator(dtype, device):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(2, 8, 10, 6, generator=generator, dtype=torch.float64)
    b = torch.randn(2, 8, 10, 6, generator=generator, dtype=torch.float64)
    box = (80.0, 100.0, 60.0)
    for options in (dict(), dict(bins=5), dict(compensate_cic=True)):
        layer = PowerSpectrum((8, 10, 6), box, dtype=dtype, **options).to(device)
        expected = power_spectrum(a, box, **options)
        cross = cross_power(a, b, box, **options)
        tolerance = dict(rtol=1e-12, atol=0) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(layer(a.to(device, dtype)).double().cpu(), expected.power, **tolerance)
        torch.testing.assert_close(layer(a.to(device, dtype), b.to(device, dtype)).double().cpu(), cross.power, **tolerance)
        torch.testing.assert_close(layer.k.double().cpu(), expected.k, rtol=1e-6, atol=0)
        torch.testing.assert_close(layer.modes.double().cpu(), expected.modes, rtol=0, atol=0)
    assert layer.state_dict() == {} and "n_bins" in repr(layer)
    with pytest.raises(ValueError, match="field"):
        layer(a[0])


def test_power_spectrum_layer_takes_the_mesh_of_its_shape():
    """``mesh=`` a LocalMesh of the layer's shape is the one-device layer (the grid cases are in
    test_distributed_simulation.py); a mesh of another shape or another kind of object is refused."""
    field = torch.randn(2, 8, 10, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    box = (80.0, 100.0, 60.0)
    for options in (dict(), dict(bins=5), dict(compensate_cic=True)):
        plain = PowerSpectrum((8, 10, 6), box, dtype=torch.float64, **options)
        on_mesh = PowerSpectrum((8, 10, 6), box, dtype=torch.float64, mesh=torchpm.LocalMesh((8, 10, 6)), **options)
        assert torch.equal(on_mesh(field), plain(field)) and torch.equal(on_mesh.k, plain.k)
        assert torch.equal(on_mesh.modes, plain.modes)
    with pytest.raises(ValueError, match=r"`mesh` has the global shape \(8, 10, 7\)"):
        PowerSpectrum((8, 10, 6), box, mesh=torchpm.LocalMesh((8, 10, 7)))
    with pytest.raises(TypeError, match="`mesh` must be"):
        PowerSpectrum((8, 10, 6), box, mesh=(8, 10, 6))
    layer = PowerSpectrum((8, 10, 6), box)
    for field, message in ((torch.zeros(1, 8, 10, 6, dtype=torch.float16), "must be float32 or float64"),
                           (torch.zeros(0, 8, 10, 6), "holds no field")):  # (torch's FFT errors before)
        with pytest.raises(ValueError, match=message):
            layer(field)
    import numpy as np

    assert PowerSpectrum((8, 10, 6), box, compensate_cic=np.True_).compensate_cic is True
    for flag in ("no", 1):  # (bool("no") is True: it compensated)
        with pytest.raises(ValueError, match=r"`compensate_cic` must be true or false"):
            PowerSpectrum((8, 10, 6), box, compensate_cic=flag)


def test_power_spectrum_layer_gradcheck():
    layer = PowerSpectrum(4, 40.0, dtype=torch.float64)
    field = torch.randn(1, 4, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (field,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_correlation_layer_matches_the_analysis_estimator(dtype, device):
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(2, 8, 10, 6, generator=generator, dtype=torch.float64) + 0.2
    b = torch.randn(2, 8, 10, 6, generator=generator, dtype=torch.float64)
    box = (80.0, 100.0, 60.0)
    tolerance = dict(rtol=1e-12, atol=1e-15) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    for options in (dict(), dict(bins=4), dict(bins=[0.0, 12.0, 20.0, 45.0], ells=(0, 2, 4), axis="y"),
                    dict(window="tsc"), dict(window="cic", n_particles=300)):
        layer = CorrelationFunction((8, 10, 6), box, dtype=dtype, **options).to(device)
        expected = correlation_function(a, box, **options)
        torch.testing.assert_close(layer(a.to(device, dtype)).double().cpu(), expected.xi, **tolerance)
        if "n_particles" not in options:
            cross = cross_correlation(a, b, box, **options)
            torch.testing.assert_close(layer(a.to(device, dtype), b.to(device, dtype)).double().cpu(), cross.xi,
                                       **tolerance)
        torch.testing.assert_close(layer.r.double().cpu(), expected.r, rtol=1e-6, atol=0)
        torch.testing.assert_close(layer.lags.double().cpu(), expected.lags, rtol=0, atol=0)
    assert layer.state_dict() == {} and "n_particles=300" in repr(layer)
    with pytest.raises(ValueError, match="`field`"):
        layer(a[0])
    with pytest.raises(ValueError, match="`other`"):
        layer(a, b[:, :4])
    with pytest.raises(ValueError, match="`n_particles` needs `window=`"):
        CorrelationFunction(8, 80.0, n_particles=10)
    with pytest.raises(ValueError, match="`ells`"):
        CorrelationFunction(8, 80.0, ells=(1,))
    with pytest.raises(ValueError, match="CorrelationFunction.*`bins`"):
        CorrelationFunction(8, 80.0, bins=[2.0, 1.0])
    with pytest.raises(TypeError, match="CorrelationFunction: `dtype`"):
        CorrelationFunction(8, 80.0, dtype=torch.int64)
    with pytest.raises(ValueError, match="CorrelationFunction: `box_size`"):
        CorrelationFunction(8, -80.0)
    with pytest.raises(ValueError, match=r"`other` must be .*B = 2, as `field`"):
        CorrelationFunction((8, 10, 6), box)(a, b[:1])
    with pytest.raises(ValueError, match="`other` with `n_particles`"):
        layer(a, b)  # (the last layer subtracts one particle set's self-pairs)
    # Buffers only for what is used: a shell per cell, a byte per Fourier entry.
    plain = CorrelationFunction((8, 10, 6), box)
    buffers = dict(plain.named_buffers())
    assert buffers["_lag_index"].numel() == 8 * 10 * 6
    assert buffers["_k_zero"].dtype == torch.bool and buffers["_k_zero"].numel() == 8 * 10 * 4
    assert plain._filter is None and plain._noise is None and plain._lag_scale is None


def test_correlation_layer_gradcheck():
    layer = CorrelationFunction((4, 3, 6), (8.0, 6.0, 12.0), ells=(0, 2), window="cic", n_particles=20,
                                dtype=torch.float64)
    field = torch.randn(1, 4, 3, 6, dtype=torch.float64, requires_grad=True)
    other = torch.randn(1, 4, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (field,))
    assert torch.autograd.gradcheck(CorrelationFunction((4, 3, 6), (8.0, 6.0, 12.0), dtype=torch.float64),
                                    (field, other))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cic_layers(dtype, device, reproducible):
    generator = torch.Generator().manual_seed(3)
    positions = (torch.rand(2, 50, 3, generator=generator, dtype=torch.float64) * 6).to(device, dtype)
    mesh = torch.randn(2, 3, 6, 6, 6, generator=generator, dtype=torch.float64).to(device, dtype)
    paint, readout = CICPaint(6), CICReadout()
    torch.testing.assert_close(paint(positions), torchpm.cic_paint(positions, None, (6, 6, 6)))
    torch.testing.assert_close(readout(mesh, positions), torchpm.cic_readout(mesh, positions))
    # adjoint identity <paint(x, w), f> = <w, readout(f, x)>
    weights = torch.rand(2, 50, generator=generator, dtype=torch.float64).to(device, dtype)
    lhs = (paint(positions, weights) * mesh[:, 0]).sum()
    rhs = (weights * readout(mesh[:, 0], positions)).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-4 if dtype == torch.float32 else 1e-12, atol=0)
    assert "shape=(6, 6, 6)" in repr(paint)
    # mesh= a LocalMesh is the one-device layer (the grid cases are in
    # test_distributed_simulation.py, case_paint_layers).
    local = torchpm.LocalMesh(6)
    assert torch.equal(CICPaint(6, mesh=local)(positions, weights), paint(positions, weights))
    assert torch.equal(CICReadout(mesh=local)(mesh, positions), readout(mesh, positions))
    with pytest.raises(ValueError, match=r"CICPaint: `mesh` has the global shape \(6, 6, 6\) but `shape` is \(6, 6, 7\)"):
        CICPaint((6, 6, 7), mesh=local)
    # ids=: the slots of id -1 get no mass (a state's empty slots)
    ids = torch.arange(50, device=device).expand(2, -1).clone()
    ids[:, ::3] = -1
    keep = ids[0] >= 0
    torch.testing.assert_close(paint(positions, weights, ids=ids), paint(positions[:, keep], weights[:, keep]))
    with pytest.raises(ValueError, match=r"CICPaint: `ids` must be an integer \(B, N\) = \(2, 50\) tensor"):
        paint(positions, ids=ids[:, :7])
    # a mask or float ids are not ids (a bool mask's False would be >= 0: every slot painted)
    for wrong in (ids >= 0, ids.double()):
        with pytest.raises(ValueError, match=r"`ids` must be an integer \(B, N\)"):
            paint(positions, ids=wrong)
    # weights that do not match (B, N) are refused, not broadcast into N channels
    for bad in (weights[0], weights[:, :7], weights[..., None, None]):
        with pytest.raises(ValueError, match=r"CICPaint: `weights` must be \(B, N\) or \(B, N, C\) with \(B, N\) = "
                                             r"\(2, 50\), got " + re.escape(str(tuple(bad.shape)))):
            paint(positions, bad, ids=ids)
    for make in (lambda: CICPaint(6, mesh=(6, 6, 6)), lambda: CICReadout(mesh="cic")):
        with pytest.raises(TypeError, match="`mesh` must be"):
            make()


def test_module_conventions():
    spline = NeuralSplineCorrection(k_max=1.0, knots=5, hidden=(6,), conditions=2)
    assert all(p.dtype == torch.float32 for p in spline.parameters())
    spline64 = spline.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in spline64.parameters())
    assert spline64.condition_values.dtype == torch.float64
    spline64.set_conditions([0.3, 0.8])
    k = torch.linspace(0, 1, 5, dtype=torch.float64)
    assert spline64(k, 0.5).dtype == torch.float64
    assert "knots=5" in repr(spline64) and "conditions=2" in repr(spline64)
    assert set(spline64.state_dict()) == {"network.0.weight", "network.0.bias", "network.2.weight", "network.2.bias"}
    with pytest.raises(ValueError, match="expected 2 values"):
        spline64.set_conditions([0.3])
    with pytest.raises(ValueError, match="k_max"):
        NeuralSplineCorrection(k_max=-1.0)
    with pytest.raises(ValueError, match="knots"):
        NeuralSplineCorrection(k_max=1.0, knots=1)
    with pytest.raises(ValueError, match="k_short"):
        PGDCorrection(k_long=0.1, k_short=0.0)
    pgd = PGDCorrection(0.1, 0.5).double()
    assert pgd.alpha.dtype == torch.float64 and "alpha=0" in repr(pgd)
    # booleans, NaN, strings and non-float dtypes are refused by name (they were taken as
    # k_max = 1, alpha = nan, float('2') or failed inside torch)
    for make, message in (
            (lambda: NeuralSplineCorrection(True), "NeuralSplineCorrection: `k_max` must be a finite number > 0.0"),
            (lambda: NeuralSplineCorrection(1.0, hidden=32), "`hidden` must be a sequence"),
            (lambda: NeuralSplineCorrection(1.0, dtype=torch.int64), "`dtype` must be None or a real floating"),
            (lambda: PGDCorrection(True, 0.5), "PGDCorrection: `k_long` must be a finite number > 0.0"),
            (lambda: PGDCorrection(0.1, 0.5, alpha=float("nan")), "PGDCorrection: `alpha` must be a finite number"),
            (lambda: PGDCorrection(0.1, 0.5, mu=math.inf), "PGDCorrection: `mu` must be a finite number"),
            (lambda: PGDCorrection(0.1, 0.5, alpha="2"), "PGDCorrection: `alpha` must be a finite number"),
            (lambda: PGDCorrection(0.1, 0.5, dtype=torch.complex64), "`dtype` must be None or a real floating"),
            (lambda: spline64.set_conditions([float("nan"), 1.0]), "must be finite"),
            (lambda: spline64.set_conditions([True, False]), "must be real numbers"),
            (lambda: spline64(torch.tensor([0.1, float("nan")], dtype=torch.float64), 0.5), "`k` holds NaN"),
            (lambda: spline64(k, torch.tensor([0.5, 0.6])), "`a` must be one scale factor")):
        with pytest.raises(ValueError, match=re.escape(message)):
            make()
    # one-element tensors and numpy numbers stay numbers, as float() took them
    import numpy as np

    assert float(PGDCorrection(0.1, 0.5, alpha=torch.tensor(0.5), mu=np.float32(2.0)).mu) == 2.0


def test_compile_spline_correction():
    """The spline correction traces into one graph (no breaks), forward and backward."""
    module = NeuralSplineCorrection(k_max=1.0, knots=6, hidden=(8,), dtype=torch.float64)
    torch.nn.init.normal_(module.network[-1].weight)
    k = torch.rand(4, 4, 3, dtype=torch.float64)
    a = torch.tensor(0.5, dtype=torch.float64)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    eager = module(k, a)
    traced = compiled(k, a)
    torch.testing.assert_close(traced, eager, rtol=1e-14, atol=0)
    (grad_eager,) = torch.autograd.grad(eager.sum(), module.network[-1].weight)
    (grad_traced,) = torch.autograd.grad(compiled(k, a).sum(), module.network[-1].weight)
    torch.testing.assert_close(grad_traced, grad_eager, rtol=1e-13, atol=0)


def _compile_case(layer):
    """``(module, inputs, tensors to differentiate)`` for one layer, float64, tiny."""
    generator = torch.Generator().manual_seed(7)
    positions = (torch.rand(2, 20, 3, generator=generator, dtype=torch.float64) * 4).requires_grad_(True)
    weights = torch.rand(2, 20, generator=generator, dtype=torch.float64).requires_grad_(True)
    mesh = torch.rand(2, 2, 4, 4, 4, generator=generator, dtype=torch.float64).requires_grad_(True)
    field = torch.randn(2, 4, 4, 4, generator=generator, dtype=torch.float64).requires_grad_(True)
    if layer == "CICPaint":
        return CICPaint(4), (positions, weights), [positions, weights]
    if layer == "CICReadout":
        return CICReadout(), (mesh, positions), [mesh, positions]
    if layer == "PowerSpectrum":
        other = torch.randn(2, 4, 4, 4, generator=generator, dtype=torch.float64).requires_grad_(True)
        return PowerSpectrum(4, 40.0, compensate_cic=True), (field, other), [field, other]
    if layer == "CorrelationFunction":
        other = torch.randn(2, 4, 4, 4, generator=generator, dtype=torch.float64).requires_grad_(True)
        return (CorrelationFunction(4, 40.0, ells=(0, 2), window="cic", dtype=torch.float64), (field, other),
                [field, other])
    module = PGDCorrection(0.1, 0.8, alpha=0.3, mu=0.5, dtype=torch.float64)
    k = torch.rand(4, 4, 3, generator=generator, dtype=torch.float64)
    return module, (k, torch.tensor(0.5, dtype=torch.float64)), list(module.parameters())


@pytest.mark.parametrize("layer", ["CICPaint", "CICReadout", "PowerSpectrum", "CorrelationFunction", "PGDCorrection"])
def test_compile_layers_fullgraph(layer):
    """Every layer traces into one graph (fullgraph: a graph break is an error), forward
    and backward through AOTAutograd (the custom ops' fake kernels and registered
    backwards), and gives eager's numbers. The aot_eager backend skips the code
    generation, which adds minutes per graph on the CI machine and checks no torchpm code."""
    module, inputs, differentiated = _compile_case(layer)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    traced, eager = compiled(*inputs), module(*inputs)
    torch.testing.assert_close(traced, eager, rtol=1e-13, atol=1e-15)
    cotangent = torch.randn(eager.shape, generator=torch.Generator().manual_seed(8), dtype=eager.dtype)
    grads_traced = torch.autograd.grad(traced, differentiated, cotangent)
    grads_eager = torch.autograd.grad(eager, differentiated, cotangent)
    for a, b in zip(grads_traced, grads_eager):
        assert float(b.abs().max()) > 0
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_compile_inductor_paint_readout():
    """Under the default (inductor) backend the custom ops stay opaque nodes of the
    generated code, paint -> field -> readout forward and backward as in eager."""

    class PaintRead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.paint, self.readout = CICPaint(4), CICReadout()

        def forward(self, positions, weights):
            return self.readout(torch.sin(self.paint(positions, weights)), positions)

    _, (positions, weights), _ = _compile_case("CICPaint")
    module = PaintRead()
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    traced, eager = compiled(positions, weights), module(positions, weights)
    torch.testing.assert_close(traced, eager, rtol=1e-12, atol=1e-14)
    grads_traced = torch.autograd.grad(traced.sum(), [positions, weights])
    grads_eager = torch.autograd.grad(eager.sum(), [positions, weights])
    for a, b in zip(grads_traced, grads_eager):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- training


def test_short_training_run_lowers_the_loss():
    """A few seeded Adam steps of the example's training loop lower its loss."""
    torch.manual_seed(0)
    config = training.Config(**{**training.asdict(training.SIZES["tiny"]), "iterations": 6, "learning_rate": 0.05})
    data = training.reference_data(config, [0, 1])
    correction = training.make_correction(config)
    model = training.HybridLoss(config, training.make_simulation(config, reference=False, correction=correction))
    optimizer = torch.optim.Adam(correction.parameters(), lr=config.learning_rate)
    with torch.no_grad():
        initial = float(model(*data))
    for _ in range(config.iterations):
        training.train_step(model, optimizer, data)
    with torch.no_grad():
        final = float(model(*data))
    print(f"training loss {initial:.6f} -> {final:.6f}")
    assert final < 0.9 * initial


# ----------------------------------------------------------------------------- weight files


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_weights_round_trip(tmp_path, suffix):
    if suffix == ".safetensors":
        pytest.importorskip("safetensors", reason="safetensors is in the Makefile's deps")
    torch.manual_seed(0)
    trained = NeuralSplineCorrection(k_max=1.0, knots=5, hidden=(6,))
    torch.nn.init.normal_(trained.network[-1].weight)
    path = tmp_path / f"weights{suffix}"
    save_weights(trained, path)
    fresh = NeuralSplineCorrection(k_max=1.0, knots=5, hidden=(6,))
    load_weights(fresh, path)
    for (name, a), (_, b) in zip(trained.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    k = torch.linspace(0, 1, 7)
    assert torch.equal(trained(k, 0.5), fresh(k, 0.5))


class _Payload:
    """An arbitrary object: unpickling it would run code of the file's choosing."""

    def __reduce__(self):
        return (print, ("this must never run",))


def test_loading_refuses_pickled_objects(tmp_path):
    path = tmp_path / "weights.pt"
    with open(path, "wb") as f:
        pickle.dump({"network.0.weight": _Payload()}, f)
    with pytest.raises(ValueError, match="refused to unpickle"):
        load_weights(NeuralSplineCorrection(k_max=1.0), path)
    # a torch.save of a module (pickled code, not a state_dict) is refused too
    path = tmp_path / "module.pt"
    torch.save(NeuralSplineCorrection(k_max=1.0), path)
    with pytest.raises(ValueError, match="refused to unpickle") as refused:
        load_weights(NeuralSplineCorrection(k_max=1.0), path)
    assert "weights_only` set to `False`" not in str(refused.value)  # (torch's advice would run the code)
    # no file, and a file that is not safetensors, are named as such
    with pytest.raises(FileNotFoundError, match="load_weights: no file"):
        load_weights(NeuralSplineCorrection(k_max=1.0), tmp_path / "missing.pt")
    # a file object is read as torch.load reads it
    import io

    buffer = io.BytesIO()
    torch.save(PGDCorrection(0.1, 0.5, alpha=0.25).state_dict(), buffer)
    buffer.seek(0)
    loaded = PGDCorrection(0.1, 0.5)
    load_weights(loaded, buffer)
    assert float(loaded.alpha) == 0.25
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        load_weights(NeuralSplineCorrection(k_max=1.0), tmp_path / "broken.safetensors")


def test_training_loss_over_snapshots_is_the_mean_over_runs_stopped_there():
    """The example's loss over several snapshots (one trajectory of each run) equals the
    mean of the one-snapshot losses of runs stopped at each scale factor, and so does its
    gradient in the correction's weights (plain autograd through the stopped runs)."""
    config = training.Config(**{**training.asdict(training.SIZES["tiny"]), "snapshots": 2})
    times = training.snapshot_times(config)
    assert len(times) == 2 and times[-1] == 1.0
    noise, positions, powers = training.reference_data(config, [0, 1])
    assert positions.shape[:2] == (2, 2) and powers.shape[:2] == (2, 2)
    reference = training.make_simulation(config, reference=True)
    with torch.no_grad():
        for index, a in enumerate(times):
            assert torch.equal(reference(noise, until=a).positions, positions[:, index])
    torch.manual_seed(0)
    correction = training.make_correction(config)
    with torch.no_grad():  # off the identity, so every weight has a gradient
        for parameter in correction.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, dtype=parameter.dtype))
    model = training.HybridLoss(config, training.make_simulation(config, reference=False, correction=correction))
    loss = model(noise, positions, powers)
    grads = torch.autograd.grad(loss, list(correction.parameters()))
    expected = sum(model.score(model.simulation(noise, until=a).positions, positions[:, i], powers[:, i])
                   for i, a in enumerate(times)) / len(times)
    expected_grads = torch.autograd.grad(expected, list(correction.parameters()))
    assert abs(float(loss - expected)) <= 1e-12 * float(expected)
    for got, want in zip(grads, expected_grads):
        assert float((got - want).abs().max()) <= 1e-9 * max(float(want.abs().max()), 1e-30)
    with pytest.raises(ValueError, match="snapshots must be in"):
        training.snapshot_times(training.Config(**{**training.asdict(config), "snapshots": 9}))
