"""Benchmark of the PM simulation: time per FastPM step, 2LPT time, peak memory, and
where a step's time goes (paint, FFTs, Fourier kernels, readout, kicks and drift) for
particles in the order the simulation leaves them and in spatial order (issue 13), with
a STREAM-like bandwidth and the bytes-moved floor of a step, next to JaxPM run in the
same process on the same device when it is importable.

Usage::

    python benchmarks/bench_pm.py                      # CPU: 64^3 and 128^3
    python benchmarks/bench_pm.py --device cuda --sizes 512   # one size per process on a GPU (below)
    python benchmarks/bench_pm.py --no-jaxpm --threads 2
    python benchmarks/bench_pm.py --device cuda --sizes 256 512 --paint-method tiled

Particles = mesh cells (mesh factor 1), float32, Planck15, a from 0.1. A "step" is one
kick-drift-kick with one force evaluation (paint, rfftn, kernels, irfftn, the real-space
gradient, 3-channel readout) as ``Simulation.evolve`` takes it outside a graph: the
readout carries the step's second kick and the next step's first kick and drift
(``torchpm.pm.readout_kick_drift_``). Times are medians of ``--repeats`` runs after a warm-up; CUDA times are taken
after ``torch.cuda.synchronize``. Peak memory of one step, measured in a fresh child
process: CUDA ``max_memory_allocated`` above the baseline; on the CPU the peak resident
set size above the baseline, sampled every 0.5 ms by a thread, with glibc's mmap
threshold fixed so that freed blocks leave the resident set (for both codes).

JaxPM 0.1.6 has no FastPM integrator: its "step" here is the same kick-drift-kick
written with ``jaxpm.pm.pm_forces`` (one force evaluation) under ``jax.jit``, on float32
arrays; its 2LPT is ``jaxpm.pm.lpt(order=2)`` under ``jax.jit`` (it integrates its
growth table inside the call, while torchpm's growth table is built once per cosmology).
On a GPU run one size per process (``--sizes 512``): XLA keeps its memory pool, and
JaxPM's 2LPT at 512^3 ran out of memory on an 80 GB H100 after its 256^3 run in the
same process. JaxPM's GPU peak is XLA's ``peak_bytes_in_use`` above the baseline over
one step on a displaced lattice (XLA's peak cannot be reset, so its child skips the
2LPT); if its 2LPT runs out of memory, its step is timed on that lattice.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torchpm  # noqa: E402
from harness import FIXED_MMAP_THRESHOLD, ChildFailed, PeakMemory, Table, child_report, print_header  # noqa: E402
from harness import restorer, timed, timed_together  # noqa: E402
from torchpm.fourier import multiply_real, stack_products  # noqa: E402
from torchpm.pm import add_scaled_, readout_kick_drift_, step_factors  # noqa: E402


def stream_bandwidth(device, repeats, megabytes=256):
    """STREAM-like copy ``b = a`` and triad ``a = b + s c`` on float32 arrays far larger
    than the caches: ``{"copy": bytes/s, "triad": bytes/s}`` (bytes read + written)."""
    n = megabytes * 2**20 // 4
    a = torch.rand(n, device=device)
    b, c = torch.empty_like(a), torch.rand(n, device=device)
    timings = timed_together(
        {"copy": lambda: b.copy_(a), "triad": lambda: torch.add(b, c, alpha=0.5, out=a)}, device, repeats
    )
    medians = {name: timing.median for name, timing in timings.items()}
    return {"copy": 2 * 4 * n / medians["copy"], "triad": 3 * 4 * n / medians["triad"]}


# Bytes a step must move at least (float32; N particles, M cells), for the bandwidth floor:
# per particle: first kick (read p, F, write p: 36 B), drift (read x, p, write x: 36 B),
# paint (read x: 12 B), readout (read x, write F: 24 B), second kick (36 B);
# per cell: paint (write the density: 4 B), rfftn (read 4 B, write M/2 complex: 4 B),
# Fourier kernels (read 4 B, write the potential: 4 B), 1 irfftn (read 4 B, write 4 B),
# the real-space gradient (read 4 B, write 3 components: 12 B), readout (read 3
# components: 12 B). Each mesh once, each particle array once per use: no FFT pass
# counted beyond one read and one write, no cache misses of the stencils. (With the
# Fourier gradient, 3 spectra and 3 irfftn, it would be 64 B per cell.)
FLOOR_BYTES_PER_PARTICLE = 36 + 36 + 12 + 24 + 36
# With the second kick and the next first kick and drift in the readout's pass
# (readout_kick_drift_): paint (read x: 12 B), readout (read x, p, write x, p: 48 B).
FLOOR_BYTES_PER_PARTICLE_FUSED = 12 + 48
FLOOR_BYTES_PER_CELL = 4 + 8 + 8 + 8 + 16 + 12


def bench_torchpm(n, device, repeats, memory_only=False, late_steps=10):
    """Timings of one 128^3-style PM step (mesh = particles) and its parts.

    Two particle sets: ``lpt`` (the 2LPT particles at a = 0.1, Lagrangian order) and
    ``late`` (evolved to a = 1 in ``late_steps`` steps without sorting, so in the
    order the simulation leaves them on one device, clustered). Each is timed as it
    comes (``unsorted``) and in spatial order (``sorted``); ``step+sort`` is a step
    of sorted particles that sorts again after its drift (``sort_every=1``, steady
    state); ``sort`` that sort alone, ``first sort`` the sort of the unsorted set.
    """
    from torchpm.ordering import sort_particles

    sim = torchpm.Simulation(n_particles=n, box_size=float(2 * n), mesh_factor=1, a_start=0.1,
                             steps=late_steps, sort_every=0).to(device)
    noise = sim.white_noise(seed=0)
    out = {}
    with torch.no_grad():
        lpt = timed(lambda: sim.lpt(sim.linear_field(noise)), device, repeats)
        out["lpt"], (x, p, ids) = lpt.median, lpt.result
        table = sim.growth_table()
        factor = step_factors(table, torch.tensor([0.1, 0.19], dtype=torch.float64))[0]

        # The simulation's steady state outside a graph (Simulation.evolve from its second
        # step on): the force, with the second kick and the next step's first kick and
        # drift in its readout, on the particle arrays of the step before.
        (step_x, step_p), restore = restorer(x, p)

        def step():
            return sim._fused_step(step_x, step_p, ids, factor, factor)

        out["step"] = timed(step, device, repeats, setup=restore).median
        if memory_only:
            with PeakMemory(device) as memory:
                step()
            return {"memory": memory.peak}
        late_x, late_p, late_ids = sim.evolve(x, p, table, ids=ids)
        late_factor = step_factors(table, torch.tensor([0.91, 1.0], dtype=torch.float64))[0]
        mesh, kernels = sim.force_mesh, sim.kernels("force")
        # The limit of a scrambled order (on a process grid migration appends arrivals):
        # the late particles in random order.
        shuffle = torch.randperm(late_x.shape[1], generator=torch.Generator().manual_seed(1)).to(device).unsqueeze(0)
        random_x, random_p, random_ids = (torch.ops.torchpm._gather_rows(t.contiguous(), shuffle)
                                          for t in (late_x, late_p, late_ids))
        cases = {}
        for case, (cx, cp, cids, cfactor) in {"lpt": (x, p, ids, factor),
                                                "late": (late_x, late_p, late_ids, late_factor),
                                                "late, random order": (random_x, random_p, random_ids,
                                                                       late_factor)}.items():
            cforce = sim.forces(cx, cfactor.a_start)
            sx, sids, sp, sforce = sort_particles(mesh, cx, cids, cp, cforce)
            density = mesh.paint(cx)
            density_k = mesh.rfftn(density)
            potential = multiply_real(density_k, kernels.inverse_laplacian_pair, paired=True)
            if kernels.real_space_gradient:
                # "fd4": one inverse FFT of the potential, the stencil in real space.
                spectra = potential
                phi = mesh.irfftn(spectra)
                field = mesh.fd4_gradient(phi, [1.0 / c for c in kernels.cell_size])
            else:
                spectra = stack_products(potential, kernels.gradient)
                field = mesh.irfftn(spectra)
            # Steps as Simulation.evolve takes them after its first outside a graph: in place,
            # on arrays it owns, the updates in the force's readout.
            (ux, up), restore_unsorted = restorer(cx, cp)
            (ox, op), restore_sorted = restorer(sx, sp)
            kicks = [cfactor.second_kick, cfactor.first_kick]
            functions = {
                "step unsorted": (restore_unsorted, lambda: sim._fused_step(ux, up, cids, cfactor, cfactor)),
                "step sorted": (restore_sorted, lambda: sim._fused_step(ox, op, sids, cfactor, cfactor)),
                # the step with a graph: separate kicks and drift, each a new array
                "step sorted, out of place": lambda: sim._step(sx, sp, sforce, sids, cfactor),
                # sort_every=1 in its steady state: the particles were sorted one step ago.
                "step+sort": (restore_sorted, lambda: sim._fused_step(ox, op, sids, cfactor, cfactor, sort=True)),
                "sort": lambda: sort_particles(mesh, sx, sids, sp),
                "first sort": lambda: sort_particles(mesh, cx, cids, cp),
                "paint unsorted": lambda: mesh.paint(cx),
                "paint sorted": lambda: mesh.paint(sx),
                "readout x3 unsorted": lambda: mesh.readout(field, cx),
                "readout x3 sorted": lambda: mesh.readout(field, sx),
                # the same readout with two kicks and a drift in its pass (the steady-state step's)
                "readout+updates sorted": (restore_sorted, lambda: readout_kick_drift_(
                    mesh, field, ox, op, kicks, cfactor.drift)),
                "rfftn": lambda: mesh.rfftn(density),
                "kernels": (lambda: multiply_real(density_k, kernels.inverse_laplacian_pair, paired=True))
                if kernels.real_space_gradient else (lambda: stack_products(
                    multiply_real(density_k, kernels.inverse_laplacian_pair, paired=True), kernels.gradient)),
                # 1 channel (real-space gradient) or 3 (Fourier gradient)
                "irfftn": lambda: mesh.irfftn(spectra),
                "gradient": (lambda: mesh.fd4_gradient(phi, [1.0 / c for c in kernels.cell_size]))
                if kernels.real_space_gradient else (lambda: None),
                # the updates as separate passes, in place (torchpm.pm.add_scaled_)
                "kicks+drift": (restore_unsorted, lambda: (add_scaled_(up, cforce, cfactor.first_kick),
                                                           add_scaled_(ux, up, cfactor.drift),
                                                           add_scaled_(up, cforce, cfactor.second_kick))),
            }
            cases[case] = {name: timing.median for name, timing in timed_together(functions, device, repeats).items()}
        out["cases"] = cases
        out["stream"] = stream_bandwidth(device, repeats)
    return out


def import_jaxpm():
    """(jax, jnp, jaxpm.pm, jax_cosmo) or a reason string."""
    try:
        try:
            import pkg_resources  # noqa: F401 (only probing for it)
        except ImportError:
            # jax-cosmo 0.1.0 imports pkg_resources only to read its own version.
            import types

            shim = types.ModuleType("pkg_resources")
            shim.DistributionNotFound = type("DistributionNotFound", (Exception,), {})
            shim.get_distribution = lambda name: types.SimpleNamespace(version=importlib.metadata.version(name))
            sys.modules["pkg_resources"] = shim
        # On a GPU shared with torch XLA must not take 75% of the memory up front (the
        # memory children would find none).
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax
        import jax.numpy as jnp
        import jax_cosmo
        import jaxpm.pm as jpm

        return jax, jnp, jpm, jax_cosmo
    except Exception as error:  # ImportError or a broken jax install
        return f"{type(error).__name__}: {error}"


def bench_jaxpm(n, modules, repeats, factor, memory_only=False):
    jax, jnp, jpm, jc = modules
    shape = (n, n, n)
    box = (float(2 * n),) * 3
    grid = jnp.stack(jnp.meshgrid(*[jnp.arange(s, dtype=jnp.float32) for s in shape], indexing="ij"), axis=-1)
    first, drift, second = (float(v) for v in (factor.first_kick, factor.drift, factor.second_kick))
    cosmology = jc.Planck15()
    scale = float(1.5 * (cosmology.Omega_c + cosmology.Omega_b))

    @jax.jit
    def step(x, p, f):
        p = p + f * first
        x = x + p * drift
        f = jpm.pm_forces(x, mesh_shape=shape) * scale
        return x, p + f * second, f

    if memory_only and jax.devices()[0].platform != "cpu":
        # XLA's peak counter cannot be reset: nothing before the step may allocate more than
        # the step does, so the particles are a displaced lattice here, not the 2LPT's.
        x = grid + 0.25
        p = jnp.zeros_like(x)
        f0 = jnp.zeros_like(x)  # (an eager pm_forces here would set the peak itself)
        jax.block_until_ready(step(x, p, f0))  # compile outside the measurement
        device = jax.devices()[0]
        base = device.memory_stats()["bytes_in_use"]
        jax.block_until_ready(step(x, p, f0))
        return {"memory": device.memory_stats()["peak_bytes_in_use"] - base}

    k = jnp.logspace(-4, 1, 256)
    pk = jc.power.linear_matter_power(cosmology, k)

    def power(x):
        return jnp.interp(x.reshape(-1), k, pk).reshape(x.shape).astype(jnp.float32)

    delta = jpm.linear_field(shape, box, power, seed=jax.random.PRNGKey(0)).astype(jnp.float32)
    cosmology = jc.Planck15()  # fresh growth cache for JaxPM's own tables

    @jax.jit
    def lpt(delta):
        dx, p, f = jpm.lpt(cosmology, delta, particles=grid, a=0.1, order=2)
        return grid + dx, p, f

    def run_lpt():
        return jax.block_until_ready(lpt(delta))

    out = {}
    try:
        lpt_timing = timed(run_lpt, "cpu", repeats)  # "cpu": block_until_ready waits for the device
        out["lpt"], (x, p, _) = lpt_timing.median, lpt_timing.result
        x, p = x.astype(jnp.float32), p.astype(jnp.float32)
    except Exception as error:  # XLA's out-of-memory: the step is still timed
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        print(f"# JaxPM 2LPT at {n}^3 ran out of memory; its step is timed on a displaced lattice",
              file=sys.stderr, flush=True)
        out["lpt"] = float("nan")
        x, p = grid + 0.25, jnp.zeros_like(grid)
    f0 = jpm.pm_forces(x, mesh_shape=shape) * scale
    out["step"] = timed(lambda: jax.block_until_ready(step(x, p, f0)), "cpu", repeats).median
    if memory_only:
        with PeakMemory("cpu") as memory:
            jax.block_until_ready(step(x, p, f0))
        return {"memory": memory.peak}
    return out


def peak_memory(code, n, device, threads):
    """Peak memory (bytes) of one step of ``code`` at ``n^3``, measured in a fresh process.

    On the CPU the child runs with a fixed glibc mmap threshold, so that every large block
    goes back to the system when freed and the sampled resident set size follows live
    memory. (Timings are taken here, without it: fresh mmaps add page faults.)
    """
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the child needs the memory this process's allocator caches
    command = [sys.executable, os.path.abspath(__file__), "--memory-child", code, "--sizes", str(n),
               "--device", str(device), "--threads", str(threads), "--repeats", "1",
               "--paint-method", torchpm.ops.get_paint_method()]
    try:
        return child_report(command, FIXED_MMAP_THRESHOLD)["memory"]
    except ChildFailed as error:
        print(f"# {code} memory at {n}^3: {error}", file=sys.stderr)
        return float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="particles (= mesh) per side")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    parser.add_argument("--no-jaxpm", action="store_true")
    parser.add_argument("--paint-method", choices=["auto", "scatter", "tiled"], default="auto",
                        help="torchpm.ops.set_paint_method: how CUDA paints (the CPU always scatters)")
    parser.add_argument("--memory-child", choices=["torchpm", "jaxpm"], help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    device = torch.device(arguments.device)
    torchpm.ops.set_paint_method(arguments.paint_method)
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
        if arguments.threads == 1:
            # The same single-thread condition for XLA (read when jax is first imported).
            os.environ.setdefault(
                "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
            )
    sizes = arguments.sizes or ([256, 512] if device.type == "cuda" else [64, 128])
    if arguments.memory_child:
        import json

        n = arguments.sizes[0]
        if arguments.memory_child == "torchpm":
            print(json.dumps(bench_torchpm(n, device, 1, memory_only=True)))
        else:
            table = torchpm.cosmology.growth_table(torchpm.Planck15())
            factor = step_factors(table, torch.tensor([0.1, 0.19], dtype=torch.float64))[0]
            print(json.dumps(bench_jaxpm(n, import_jaxpm(), 1, factor, memory_only=True)))
        return
    jax_modules = None if arguments.no_jaxpm else import_jaxpm()
    jax_ok = isinstance(jax_modules, tuple)
    if jax_ok:
        jax_devices = {d.platform for d in jax_modules[0].devices()}
        if (device.type == "cuda") != ("gpu" in jax_devices or "cuda" in jax_devices):
            jax_ok, jax_modules = False, f"JaxPM would run on {sorted(jax_devices)}, not on {device.type}"

    print_header("PM benchmark", device, ["float32", f"paint method {torchpm.ops.get_paint_method()}",
                                          f"CPU kernels {torchpm.cpu_kernels()}"])
    if not jax_ok:
        print(f"# JaxPM: not run ({jax_modules if jax_modules else 'disabled'})")
    else:
        print(f"# JaxPM {importlib.metadata.version('jaxpm')}, jax {importlib.metadata.version('jax')}, "
              f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print()
    summary = Table(["N^3", "torchpm step [ms]", "JaxPM step [ms]", "ratio", "torchpm 2LPT [ms]", "JaxPM 2LPT [ms]",
                     "ratio", "torchpm peak [MiB]", "JaxPM peak [MiB]"])
    summary.print_header()
    breakdowns = []
    for n in sizes:
        ours = bench_torchpm(n, device, arguments.repeats)
        ours["memory"] = peak_memory("torchpm", n, device, torch.get_num_threads())
        breakdowns.append((n, ours))
        theirs = None
        if jax_ok:
            table = torchpm.cosmology.growth_table(torchpm.Planck15())
            factor = step_factors(table, torch.tensor([0.1, 0.19], dtype=torch.float64))[0]
            try:
                # The child first: once this process has run JaxPM, XLA's pool holds the memory.
                memory = peak_memory("jaxpm", n, device, torch.get_num_threads())
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # give XLA the memory torch's allocator caches
                theirs = bench_jaxpm(n, jax_modules, arguments.repeats, factor)
                theirs["memory"] = memory
            except Exception as error:  # report and go on with torchpm's numbers
                print(f"# JaxPM failed at {n}^3: {type(error).__name__}: {error}")

        def cell(key, scale=1e3):
            return f"{theirs[key] * scale:.1f}" if theirs else "-"  # memory: MiB

        def ratio(key):
            return f"{theirs[key] / ours[key]:.2f}x" if theirs else "-"

        summary.print_row(n, f"{ours['step'] * 1e3:.1f}", cell("step"), ratio("step"), f"{ours['lpt'] * 1e3:.1f}",
                          cell("lpt"), ratio("lpt"), f"{ours['memory'] / 2**20:.0f}", cell("memory", 2.0**-20))
    print()
    print("ratio = JaxPM time / torchpm time (above 1: torchpm faster).")
    print()
    print("torchpm step by particle order (each part timed alone, medians of interleaved repeats, ms):")
    print()
    parts = ["step unsorted", "step sorted", "step sorted, out of place", "step+sort", "sort", "first sort",
             "paint unsorted", "paint sorted", "readout x3 unsorted", "readout x3 sorted", "readout+updates sorted",
             "rfftn", "kernels", "irfftn", "gradient", "kicks+drift"]
    by_order = Table(["N^3", "particles"] + parts)
    by_order.print_header()
    for n, ours in breakdowns:
        for case, values in ours["cases"].items():
            by_order.print_row(n, case, *(f"{values[p] * 1e3:.1f}" for p in parts))
    print()
    for n, ours in breakdowns:
        stream = ours["stream"]
        bandwidth = max(stream.values())
        floor = (FLOOR_BYTES_PER_PARTICLE + FLOOR_BYTES_PER_CELL) * n**3 / bandwidth
        fused = (FLOOR_BYTES_PER_PARTICLE_FUSED + FLOOR_BYTES_PER_CELL) * n**3 / bandwidth
        print(f"{n}^3: STREAM copy {stream['copy'] / 1e9:.1f} GB/s, triad {stream['triad'] / 1e9:.1f} GB/s; "
              f"floor = ({FLOOR_BYTES_PER_PARTICLE} B/particle + {FLOOR_BYTES_PER_CELL} B/cell) x {n}^3 / "
              f"{bandwidth / 1e9:.1f} GB/s = {floor * 1e3:.1f} ms; with the updates in the readout "
              f"({FLOOR_BYTES_PER_PARTICLE_FUSED} B/particle) {fused * 1e3:.1f} ms")
        for case, values in ours["cases"].items():
            print(f"  {case}: unsorted/step+sort {values['step unsorted'] / values['step+sort']:.2f}x, "
                  f"unsorted/sorted {values['step unsorted'] / values['step sorted']:.2f}x; "
                  f"step+sort / floor {values['step+sort'] / floor:.2f}, sorted / floor "
                  f"{values['step sorted'] / floor:.2f}, sorted / fused floor {values['step sorted'] / fused:.2f}")

if __name__ == "__main__":
    main()
