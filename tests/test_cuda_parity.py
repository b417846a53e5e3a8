"""The code whose own tests run on the CPU only, run on CUDA: each result (and gradient)
on the GPU against the same call on the CPU, in float64.

The CPU results are the ones the other test files check against their oracles (numpy pair
sums, scipy, colossus, hand cases, finite differences); here the oracle is that a CUDA
tensor gives the same numbers. Covered: the spectra and multipoles, the two-point
correlation function and its linear theory, the bispectrum, the three statistics layers,
the density painting with interlacing and the redshift-space shift, friends-of-friends,
the halo catalogue, spherical-overdensity masses and the mass function (measured and
theory), the f_nl initial conditions,
the radial kernels, the torch.func transforms (vmap over the ops, grad and jacrev
through a run), and the command line's run with every output. Agreement is to 1e-9 relative: the CUDA paint sums with atomics in a
varying order, which changes the last bits only.
"""

from __future__ import annotations

import pytest
import torch

import torchpm
from conftest import DEVICES
from torchpm import analysis, halos
from torchpm.bispectrum import bispectrum

CUDA = [d for d in DEVICES if not isinstance(d, str)]  # the CUDA entry alone (skipped without a GPU)
RTOL = 1e-9
PARITY_DEVICE = "cuda"

SHAPE = (12, 10, 14)  # non-cubic: a transposed axis shows
BOX = (150.0, 120.0, 180.0)


@pytest.fixture(params=CUDA)
def device(request):
    """This file's tests run on CUDA only (their CPU twins are the oracle)."""
    return torch.device(request.param)


def _close(got, expected, rtol=RTOL, what="value", atol=1e-12):
    """Every tensor of (nested tuples of) results from CUDA equals the CPU one, entry by
    entry to ``rtol`` of itself, with a floor of ``atol`` times the largest entry (for
    entries near zero: a correlation function's crossing, a gradient's zeros)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), what
        got = got.detach().cpu()
        expected = expected.detach().cpu()
        assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} against {tuple(expected.shape)}"
        if not got.is_floating_point() and not got.is_complex():
            assert torch.equal(got, expected), what
            return
        assert torch.equal(torch.isnan(got), torch.isnan(expected)), f"{what}: NaNs differ"
        if not got.numel():
            return
        scale = float(expected.nan_to_num().abs().max())
        error = (got - expected).nan_to_num().abs()
        bound = rtol * expected.nan_to_num().abs() + atol * max(scale, 1e-300)
        worst = int(torch.argmax(error - bound))
        assert bool((error <= bound).all()), (
            f"{what}: difference {float(error.flatten()[worst]):.3g} at an entry of "
            f"{float(expected.flatten()[worst]):.3g} (largest {scale:.3g})")
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected), what
        for i, (g, e) in enumerate(zip(got, expected)):
            _close(g, e, rtol, f"{what}[{i}]", atol)
    else:
        assert got == expected, f"{what}: {got!r} against {expected!r}"


def _field(batch=2, shape=SHAPE, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *shape, generator=generator, dtype=torch.float64)


def _run(function, tensors, device):
    """``function`` of copies of ``tensors`` on ``device``: its result, and the gradients
    with respect to every input of a fixed random projection of its result tensors that
    carry a graph (None when none does)."""
    inputs = [t.to(device).requires_grad_() for t in tensors]
    result = function(*inputs)
    values = [v for v in (result if isinstance(result, tuple) else (result,))
              if isinstance(v, torch.Tensor) and v.requires_grad]
    if not values:
        return result, None
    generator = torch.Generator().manual_seed(99)
    loss = sum((v.nan_to_num() * torch.randn(v.shape, generator=generator, dtype=v.dtype).to(device)).sum()
               for v in values)
    return result, torch.autograd.grad(loss, inputs, allow_unused=True)


def _both(function, *tensors):
    return _run(function, tensors, "cpu"), _run(function, tensors, PARITY_DEVICE)


def test_spectra_and_multipoles(device):
    a, b = _field(seed=1), _field(seed=2)
    cases = {
        "power_spectrum": lambda x, y: analysis.power_spectrum(x, BOX, window="cic", n_particles=1000),
        "cross_power": lambda x, y: analysis.cross_power(x, y, BOX, compensate_cic=True),
        "correlation_coefficient": lambda x, y: analysis.correlation_coefficient(x, y, BOX),
        "transfer_function": lambda x, y: analysis.transfer_function(x, y, BOX, window="tsc"),
        "power_multipoles": lambda x, y: analysis.power_multipoles(x, BOX, ells=(0, 2, 4), axis=1, shot_noise=3.0),
        "cross_multipoles": lambda x, y: analysis.cross_multipoles(x, y, BOX, ells=(0, 2), axis="z"),
    }
    for name, function in cases.items():
        (cpu, cpu_grads), (gpu, gpu_grads) = _both(function, a, b)
        _close(tuple(gpu), tuple(cpu), what=name)
        _close(gpu_grads, cpu_grads, what=f"{name} gradient")


def test_correlation_function(device):
    a, b = _field(seed=3), _field(seed=4)
    cases = {
        "auto": lambda x, y: analysis.correlation_function(x, BOX),
        "multipoles, window, self-pairs": lambda x, y: analysis.correlation_function(
            x, BOX, ells=(0, 2), axis=0, window="cic", n_particles=500),
        "cross": lambda x, y: analysis.cross_correlation(x, y, BOX, bins=8, window="tsc"),
    }
    for name, function in cases.items():
        (cpu, cpu_grads), (gpu, gpu_grads) = _both(function, a, b)
        _close(tuple(gpu), tuple(cpu), what=name)
        _close(gpu_grads, cpu_grads, what=f"{name} gradient")


def test_correlation_from_power_and_aliased_window_power(device):
    r = torch.linspace(5.0, 200.0, 40, dtype=torch.float64)
    cosmology = torchpm.Planck15()
    cpu = analysis.correlation_from_power(r, lambda k: torchpm.linear_power(k, cosmology))
    gpu_cosmology = cosmology.to(device)
    gpu = analysis.correlation_from_power(r.to(device), lambda k: torchpm.linear_power(k.to(device), gpu_cosmology))
    _close(gpu, cpu, rtol=1e-8, what="correlation_from_power")
    generator = torch.Generator().manual_seed(5)
    wavevectors = [torch.rand(7, 1, 1, generator=generator, dtype=torch.float64) * 3 - 1.5,
                   torch.rand(1, 6, 1, generator=generator, dtype=torch.float64) * 3 - 1.5,
                   torch.rand(1, 1, 5, generator=generator, dtype=torch.float64) * 3]
    for order in ("ngp", "cic", "tsc", "pcs"):
        _close(analysis.aliased_window_power([w.to(device) for w in wavevectors], order),
               analysis.aliased_window_power(wavevectors, order), what=f"aliased_window_power {order}")


def test_bispectrum(device):
    field = _field(batch=1, shape=(12, 12, 12), seed=6)
    (cpu, cpu_grads), (gpu, gpu_grads) = _both(
        lambda x: bispectrum(x, 100.0, bins=4, window="cic", n_particles=2000), field)
    _close(tuple(gpu), tuple(cpu), what="bispectrum")
    _close(gpu_grads, cpu_grads, what="bispectrum gradient")


def test_statistics_layers(device):
    a, b = _field(seed=7), _field(seed=8)
    cube = (12, 12, 12)
    layers = {
        "PowerSpectrum": (lambda dev: torchpm.nn.PowerSpectrum(SHAPE, BOX, compensate_cic=True, dtype=torch.float64,
                                                             device=dev), True),
        "PowerSpectrum multipoles": (lambda dev: torchpm.nn.PowerSpectrum(
            SHAPE, BOX, ells=(0, 2), axis=1, dtype=torch.float64, device=dev), True),
        "CorrelationFunction": (lambda dev: torchpm.nn.CorrelationFunction(
            SHAPE, BOX, window="cic", n_particles=800, dtype=torch.float64, device=dev), False),
        "CorrelationFunction multipoles": (lambda dev: torchpm.nn.CorrelationFunction(
            SHAPE, BOX, ells=(0, 2), dtype=torch.float64, device=dev), True),
    }
    for name, (make, cross) in layers.items():
        cpu_layer, gpu_layer = make("cpu"), make(device)
        for other in ((False, True) if cross else (False,)):
            def run(layer):
                return lambda x, y: layer(x, y) if other else layer(x)
            cpu, cpu_grads = _run(run(cpu_layer), (a, b), "cpu")
            gpu, gpu_grads = _run(run(gpu_layer), (a, b), device)
            _close(gpu, cpu, what=f"{name} (other={other})")
            _close(gpu_grads, cpu_grads, what=f"{name} (other={other}) gradient")
        moved = make("cpu").to(device)  # built on the CPU, moved: its buffers travel
        _close(moved(a.to(device)), cpu_layer(a), what=f"{name} moved with .to")
    field = _field(batch=1, shape=cube, seed=9)
    cpu_layer = torchpm.nn.BispectrumEstimator(cube, 100.0, bins=4, window="tsc", dtype=torch.float64)
    gpu_layer = torchpm.nn.BispectrumEstimator(cube, 100.0, bins=4, window="tsc", dtype=torch.float64, device=device)
    cpu, cpu_grads = _run(cpu_layer, (field,), "cpu")
    gpu, gpu_grads = _run(gpu_layer, (field,), device)
    _close(gpu, cpu, what="BispectrumEstimator")
    _close(gpu_grads, cpu_grads, what="BispectrumEstimator gradient")


def _evolved(device, n=16, box=64.0, steps=6, on_device=True):
    """A run on the CPU and (``on_device``) the same run on ``device``."""
    sim = torchpm.Simulation(n, box, mesh_factor=1, a_start=0.1, steps=steps, dtype=torch.float64)
    noise = sim.white_noise(seed=11)
    with torch.no_grad():
        cpu = sim(noise)
        gpu = sim.to(device)(noise.to(device)) if on_device else None  # (Module.to moves in place)
    return cpu, gpu


def test_paint_density_and_redshift_space(device):
    # the default paints (atomic scatter; tiled for TSC and PCS), not the deterministic ones
    cpu, gpu = _evolved(device)
    # the same particles on both devices (the runs differ in the last bits)
    x = cpu.positions
    for order, interlacing in (("cic", False), ("tsc", True), ("pcs", True)):
        _close(analysis.paint_density(x.to(device), shape=(20, 18, 16), order=order, interlacing=interlacing),
               analysis.paint_density(x, shape=(20, 18, 16), order=order, interlacing=interlacing),
               what=f"paint_density {order} interlacing={interlacing}")
    cosmology = torchpm.Planck15()
    box = (64.0, 64.0, 64.0)
    _close(analysis.redshift_space(x.to(device), cpu.momenta.to(device), 0.5, cosmology.to(device), box, axis=1),
           analysis.redshift_space(x, cpu.momenta, 0.5, cosmology, box, axis=1), what="redshift_space")
    # the whole run, in float64, to the summation-order level (grown by the run's
    # sensitivity to its initial rounding: 1e-10 of the box)
    _close(gpu.positions, cpu.positions, rtol=1e-10, atol=1e-10, what="evolved positions")


def test_friends_of_friends_catalogue_and_mass_function(device):
    cpu, _ = _evolved(device, n=24, box=48.0, steps=10, on_device=False)
    positions = cpu.positions  # Mpc/h
    box = 48.0
    labels = halos.friends_of_friends(positions, box, 0.2, n_particles=24 ** 3)
    gpu_labels = halos.friends_of_friends(positions.to(device), box, 0.2, n_particles=24 ** 3)
    assert gpu_labels.device.type == device.type
    _close(gpu_labels, labels, what="friends_of_friends labels")
    assert int((torch.bincount(labels[0]) >= 5).sum()) >= 3, "the run must make some groups for this test"
    catalog = halos.halo_catalog(positions, labels, box, particle_mass=1e11, min_members=5)
    gpu_catalog = halos.halo_catalog(positions.to(device), gpu_labels, box, particle_mass=1e11, min_members=5)
    for name in ("labels", "members", "masses", "positions"):
        _close(getattr(gpu_catalog, name), getattr(catalog, name), what=f"halo_catalog.{name}")
    for reference in (catalog, gpu_catalog):
        assert bool((reference.labels >= 0).any())
    so = halos.spherical_overdensity(positions, catalog.positions, box, 200.0 * 24**3 / box**3,
                                     valid=catalog.labels >= 0, radius=0.5)
    gpu_so = halos.spherical_overdensity(positions.to(device), gpu_catalog.positions, box, 200.0 * 24**3 / box**3,
                                         valid=gpu_catalog.labels >= 0, radius=0.5)
    assert int(so.members.max()) > 0
    _close(tuple(gpu_so), tuple(so), what="spherical_overdensity")
    measured = halos.mass_function(catalog.masses, box)
    gpu_measured = halos.mass_function(gpu_catalog.masses, box)
    _close(tuple(gpu_measured), tuple(measured), what="mass_function")
    masses = torch.logspace(11, 15, 9, dtype=torch.float64)
    cosmology = torchpm.Planck15()
    for model in halos.MASS_FUNCTION_MODELS:
        _close(halos.mass_function_theory(masses.to(device), cosmology.to(device), 0.7, model=model),
               halos.mass_function_theory(masses, cosmology, 0.7, model=model), rtol=1e-8,
               what=f"mass_function_theory {model}")


def test_non_gaussian_initial_conditions(device):
    def make():
        return torchpm.Simulation(SHAPE, BOX, mesh_factor=1, steps=2, dtype=torch.float64,
                                  cosmology=torchpm.Planck15(f_nl=30.0))

    sim = make()
    noise = sim.white_noise(seed=12)
    gpu_sim = make().to(device)  # (Module.to moves in place)
    _close(gpu_sim.linear_field(noise.to(device)), sim.linear_field(noise), what="linear field with f_nl")
    f_nl = torch.tensor(30.0, dtype=torch.float64, requires_grad=True)
    gradients = []
    for simulation, dev in ((sim, "cpu"), (gpu_sim, device)):
        parameters = {key: value.to(dev) for key, value in torchpm.Planck15().parameters().items()}
        cosmology = torchpm.Cosmology(**dict(parameters, f_nl=f_nl.to(dev)))
        field = simulation.linear_field(noise.to(dev), cosmology)
        (gradient,) = torch.autograd.grad((field**3).sum(), f_nl)
        gradients.append(gradient)
    _close(gradients[1], gradients[0], what="gradient in f_nl")


def test_radial_kernels(device):
    from torchpm.fourier import FourierKernels
    from torchpm.ic import power_kernel
    from torchpm.mesh import LocalMesh

    cell = [b / n for b, n in zip(BOX, SHAPE)]
    cosmology = torchpm.Planck15()
    cpu = FourierKernels(LocalMesh(SHAPE), cell, dtype=torch.float64)
    gpu = FourierKernels(LocalMesh(SHAPE), cell, dtype=torch.float64, device=device)
    _close(gpu.radial(torch.sinc), cpu.radial(torch.sinc), what="radial")
    _close(power_kernel(gpu, BOX, lambda k, c: torchpm.linear_power(k, c), cosmology.to(device)),
           power_kernel(cpu, BOX, lambda k, c: torchpm.linear_power(k, c), cosmology), what="power_kernel")


def test_vmap_over_the_ops(device):
    """torchpm/ops/_vmap.py's rules on CUDA tensors: a vmapped call equals a loop of calls."""
    generator = torch.Generator().manual_seed(13)
    shape = (6, 5, 4)
    positions = (torch.rand(3, 2, 9, 3, generator=generator, dtype=torch.float64)
                 * torch.tensor(shape, dtype=torch.float64)).to(device)
    weights = torch.rand(3, 2, 9, generator=generator, dtype=torch.float64).to(device)
    mesh = torch.randn(2, *shape, generator=generator, dtype=torch.float64).to(device)
    for order in ("ngp", "cic", "tsc", "pcs"):
        got = torch.func.vmap(lambda x, w: torchpm.paint(x, w, shape, order=order))(positions, weights)
        expected = torch.stack([torchpm.paint(x, w, shape, order=order) for x, w in zip(positions, weights)])
        _close(got, expected, rtol=1e-12, what=f"vmap paint {order}")
        got = torch.func.vmap(lambda x: torchpm.readout(mesh, x, order=order))(positions)
        expected = torch.stack([torchpm.readout(mesh, x, order=order) for x in positions])
        _close(got, expected, rtol=1e-12, what=f"vmap readout {order}")

    def loss(x):
        return (torchpm.paint(x, None, shape, order="tsc") ** 2).sum() + (torchpm.readout(mesh[:1], x) ** 3).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss))(positions[:, :1])
    loop = torch.stack([torch.func.grad(loss)(x) for x in positions[:, :1]])
    _close(per_sample, loop, rtol=1e-12, what="vmap of grad")


def test_func_grad_and_jacrev_through_a_run(device):
    sim = torchpm.Simulation(8, 64.0, steps=2, dtype=torch.float64)
    noise = sim.white_noise(seed=14)
    results = {}
    for dev in ("cpu", device):
        simulation = sim.to(dev)
        n = noise.to(dev)

        def loss(x, simulation=simulation):
            return (simulation.density(simulation(x)) ** 2).sum()

        got = torch.func.grad(loss)(n)
        leaf = n.clone().requires_grad_()
        (expected,) = torch.autograd.grad(loss(leaf), leaf)
        _close(got, expected, rtol=1e-10, what=f"func.grad against autograd on {dev}")
        jacobian = torch.func.jacrev(
            lambda x, simulation=simulation: torch.stack([(simulation.density(simulation(x)) ** p).sum() for p in (2, 3)])
        )(n)
        results[dev] = (got, jacobian)
    _close(results[device][0], results["cpu"][0], rtol=1e-9, what="func.grad, CUDA against the CPU")
    _close(results[device][1], results["cpu"][1], rtol=1e-9, what="jacrev, CUDA against the CPU")


def _tables_and_datasets(folder):
    """Every number a CLI run wrote: each text table's data and each HDF5 dataset."""
    import h5py
    import numpy as np

    found = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".txt":
            found[path.name] = np.atleast_2d(np.loadtxt(path))
        elif path.suffix == ".hdf5":
            with h5py.File(path, "r") as handle:
                def visit(name, item, file=path.name):
                    if isinstance(item, h5py.Dataset):
                        found[f"{file}:{name}"] = item[...]
                handle.visititems(visit)
    return found


CLI_CONFIGS = {
    # snapshots, a batch, halos, redshift-space multipoles, densities, xi, f_nl
    "statistics": ('n_particles = 16\nbox_size = 32.0\nmesh_factor = 2\nsteps = 6\ndtype = "float64"\nseed = 2\n'
                   'batch = 2\nsnapshots = [0.55]\nhalos_linking_length = 0.2\nhalos_min_members = 5\n'
                   'redshift_space = "y"\nwrite_density = true\ncorrelation_function = true\nf_nl = 20.0\n'),
    # the light cone, its Born maps and C_ell
    "lensing": ('n_particles = [8, 8, 24]\nbox_size = [64.0, 64.0, 600.0]\nmesh_factor = 1\nsteps = 6\n'
                'dtype = "float64"\nseed = 5\nlensing_planes = 4\nlensing_pixels = 16\nlensing_field = 3.0\n'
                'lensing_sources = [0.1, 0.2]\n'),
}


@pytest.mark.parametrize("name", sorted(CLI_CONFIGS))
def test_the_command_line_run(device, name, tmp_path, monkeypatch):
    """`python -m torchpm run` with `device = "cuda"` writes the tables, snapshots,
    catalogues and maps of the same run on the CPU (float64; text tables to their printed
    digits)."""
    import numpy as np

    from torchpm.__main__ import main

    monkeypatch.chdir(tmp_path)
    outputs = []
    for label, where in (("reference", "cpu"), ("device", device.type)):
        config = tmp_path / f"{label}.toml"
        config.write_text(CLI_CONFIGS[name] + f'device = "{where}"\noutput = "{tmp_path / label}"\n')
        assert main(["run", str(config)]) == 0
        outputs.append(_tables_and_datasets(tmp_path / label))
    cpu, gpu = outputs
    assert sorted(gpu) == sorted(cpu)
    assert len(cpu) >= 5, sorted(cpu)
    for key, expected in cpu.items():
        got = gpu[key]
        assert got.shape == expected.shape, key
        if expected.dtype.kind in "iub":
            np.testing.assert_array_equal(got, expected, err_msg=key)
            continue
        # entry by entry; the tables print 7 digits (%.6e), whose last may round either way
        rtol, atol = (2e-6, 1e-9) if key.endswith(".txt") else (1e-9, 1e-10)
        if not expected.size:
            continue
        scale = np.nan_to_num(np.nanmax(np.abs(expected))) if not np.isnan(expected).all() else 0.0
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=key)
        error = np.nan_to_num(np.abs(got - expected))
        bound = rtol * np.nan_to_num(np.abs(expected)) + atol * max(scale, 1e-300)
        assert (error <= bound).all(), (key, float(error.max()))
