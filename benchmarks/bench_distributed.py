"""Benchmark of the distributed simulation: time per FastPM step on 1, 2, 4 ranks with
where it goes (paint, halo exchange, FFT, FFT transposes, readout, migration), and the
peak memory per rank.

Usage::

    python benchmarks/bench_distributed.py                     # gloo on the CPU: 64^3, 128^3 on 1, 2, 4 ranks
    python benchmarks/bench_distributed.py --ranks 1 2 --sizes 128 --repeats 7
    python benchmarks/bench_distributed.py --adjoint --sizes 64 --ranks 2 4   # forward + backward, adjoint method
    python benchmarks/bench_distributed.py --sizes 128 --ranks 2 4 --repeats 10 --sort-every 4   # with sorting
    python benchmarks/bench_distributed.py --halos --sizes 64 --ranks 1 2 4   # FoF and SO masses on a grid

Each configuration runs in ``R`` freshly spawned processes joined in one gloo process
group (a FileStore), one thread each unless ``--threads-per-rank`` says otherwise, on
a ``balanced_grid(R)`` process grid (2 ranks: 2 x 1 slabs; 4 ranks: 2 x 2 pencils).
Particles = mesh cells (mesh factor 1), float32, Planck15, 2LPT at a = 0.1 then steps
to a = 1. A step is one kick-drift-kick: drift, migration, one force evaluation
(paint + halo add, rfftn, kernels, irfftn of the potential, halo fill + the 4-point
gradient in real space, halo fill + 3-channel readout).
Times are medians over ``--repeats`` steps after a warm-up step; each repeat takes the
slowest rank. The breakdown times the pieces inside the steps (summed per step, slowest
rank, median over steps): "FFT local" is the FFT time without its transposes, "halo"
every halo exchange (the paint's add, the potential's fill before the 4-point gradient,
a readout's fill), "stencil" the 4-point gradient kernel itself.

``--halos``: a run of ``n^3`` particles in ``2 n`` Mpc/h (force mesh ``(2 n)^3``, 2LPT at
a = 0.05, 20 steps to a = 1), then ``find_halos`` (b = 0.2, at least 20 members) and
``spherical_overdensity_masses`` (200 times the mean density) of its catalogue, each
timed as the median over ``--repeats`` calls after a warm-up (the slowest rank's).

Peak memory per rank: the largest resident-set growth of any rank over the 2LPT and
one step, above its baseline after start-up (torch imported, process group made),
sampled every 0.5 ms, with glibc's mmap threshold fixed so that freed blocks leave
the resident set; in processes of their own, so the timed steps run with glibc's
default allocation (as a user's run does) rather than with a fresh mmap, and its page
faults, per large block. On a machine with fewer cores than ranks the ranks share
cores, so the times then measure overheads, not scaling.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from harness import PeakMemory, Table, fixed_mmap_threshold, print_header, time_call  # noqa: E402

PHASES = ["paint", "halo", "FFT local", "transposes", "stencil", "readout", "migration", "sort"]


class PhaseTimer:
    """Wall time spent in wrapped functions, per phase, outermost call only per phase."""

    def __init__(self):
        self.totals = collections.defaultdict(float)
        self.depth = collections.defaultdict(int)

    def wrap(self, owner, name, phase):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.depth[phase] += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth[phase] -= 1
                if self.depth[phase] == 0:
                    self.totals[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self):
        totals = dict(self.totals)
        self.totals.clear()
        return totals


def _timed_steps(sim, factors, positions, momenta, ids, sort_every):
    """Steps 2.. of the run as Simulation.evolve takes them outside a graph (the updates
    in the force's readout), each after a barrier, timed whole and by phase (PhaseTimer)."""
    import torch.distributed as dist
    from torchpm import simulation
    from torchpm.distributed import decomposition, fft, halo

    timer = PhaseTimer()
    timer.wrap(decomposition, "_paint", "paint")
    timer.wrap(decomposition, "_readout", "readout")
    timer.wrap(decomposition.PencilDecomposition, "readout_kick_drift_", "readout")  # with the kicks and drift
    timer.wrap(halo, "add_halo", "halo")
    timer.wrap(halo, "fill_halo", "halo")
    timer.wrap(fft, "transpose", "transposes")
    timer.wrap(fft, "rfftn", "FFT")
    timer.wrap(fft, "irfftn", "FFT")
    timer.wrap(torch.ops.torchpm, "_fd4_gradient", "stencil")  # the 4-point gradient, without its halo fill
    timer.wrap(decomposition.PencilDecomposition, "migrate", "migration")
    timer.wrap(simulation, "sort_particles", "sort")
    steps, breakdowns = [], []
    for index in range(1, len(factors)):
        number = index + 1
        sort = bool(sort_every) and number % sort_every == 0
        # every timed step carries a following step's first kick and drift, the last one too
        following = factors[min(index + 1, len(factors) - 1)]
        dist.barrier()
        timer.take()
        elapsed, (positions, momenta, ids) = time_call(
            lambda: sim._fused_step(positions, momenta, ids, factors[index], following, sort=sort, own_ids=True))
        steps.append(elapsed)
        breakdowns.append(timer.take())
    return {"steps": steps, "breakdowns": breakdowns, "particles": int((ids >= 0).sum())}


def _worker(rank, world, size, repeats, threads, store, result_path, sort_every=0, memory_only=False):
    """One rank: with ``memory_only`` the peak memory of the 2LPT and one step, else the
    timed steps (the two run in separate processes: see :func:`run`)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import torchpm
    from torchpm import simulation
    from torchpm.distributed import balanced_grid
    from torchpm.pm import add_scaled, step_factors

    grid = balanced_grid(world)
    sim = torchpm.Simulation(n_particles=size, box_size=size * 4.0, mesh_factor=1, a_start=0.1,
                             steps=repeats + 1, grid=grid if world > 1 else None)
    noise = sim.white_noise(seed=0)
    table = sim.growth_table()
    factors = step_factors(table, torch.tensor(sim.scale_factors, dtype=torch.float64))
    with torch.no_grad():
        with PeakMemory("cpu") if memory_only else contextlib.nullcontext() as memory:
            positions, momenta, ids = sim.lpt(sim.linear_field(noise), table)
            if sort_every:  # as Simulation.evolve: sorted at the start, then after every k-th migration
                positions, ids, momenta = simulation.sort_particles(sim.force_mesh, positions, ids, momenta)
            forces = sim.forces(positions, factors[0].a_start, ids)
            momenta = add_scaled(momenta, forces, factors[0].first_kick)
            positions = add_scaled(positions, momenta, factors[0].drift)
            del forces
            positions, momenta, ids = sim._fused_step(positions, momenta, ids, factors[0], factors[1],
                                                      sort=sort_every == 1)
        if memory_only:
            report = {"rank": rank, "peak": memory.peak}
        else:
            report = _timed_steps(sim, factors, positions, momenta, ids, sort_every)
            report.update(rank=rank, grid=list(grid))
    with open(result_path.format(rank=rank), "w") as handle:
        json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()


def _adjoint_worker(rank, world, size, repeats, threads, store, result_path, steps):
    """Forward and backward of a whole run (``steps`` steps from a = 0.1) with the adjoint
    method, loss = <density, fixed field>: seconds per forward, per backward, and the
    halo exchanges' share, each repeat's slowest rank."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import torchpm
    from torchpm.distributed import balanced_grid, halo

    grid = balanced_grid(world)
    sim = torchpm.Simulation(n_particles=size, box_size=size * 4.0, mesh_factor=1, a_start=0.1, steps=steps,
                             grid=grid if world > 1 else None, adjoint=True)
    noise = sim.white_noise(seed=0)
    field = torch.randn(sim.force_mesh.local_real_shape, generator=torch.Generator().manual_seed(rank))
    timer = PhaseTimer()
    timer.wrap(halo, "add_halo", "halo")
    timer.wrap(halo, "fill_halo", "halo")
    rows = []
    for _ in range(repeats + 1):  # the first is a warm-up
        leaf = noise.detach().requires_grad_(True)
        dist.barrier()
        timer.take()
        forward, loss = time_call(lambda: (sim.density(sim(leaf)) * field).sum())
        halo_forward = timer.take().get("halo", 0.0)
        backward, _ = time_call(loss.backward)
        rows.append([forward, backward, halo_forward, timer.take().get("halo", 0.0)])
    with open(result_path.format(rank=rank), "w") as handle:
        json.dump({"rank": rank, "rows": rows[1:], "grid": list(grid)}, handle)
    dist.barrier()
    dist.destroy_process_group()


def _halo_worker(rank, world, size, repeats, threads, store, result_path, steps):
    """Seconds per ``find_halos`` and per ``spherical_overdensity_masses`` call on an evolved
    state, each repeat's slowest rank, and the catalogue's size."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import torchpm
    from torchpm.distributed import balanced_grid
    from torchpm.halos import spherical_overdensity_masses

    grid = balanced_grid(world)
    sim = torchpm.Simulation(n_particles=size, box_size=size * 2.0, mesh_factor=2, a_start=0.05, steps=steps,
                             grid=grid if world > 1 else None)
    with torch.no_grad():
        state = sim(sim.white_noise(seed=0))
    rows = []
    for _ in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        fof, catalog = time_call(lambda: torchpm.find_halos(sim, state, min_members=20))
        dist.barrier()
        so, masses = time_call(lambda: spherical_overdensity_masses(sim, state, catalog))
        rows.append([fof, so])
    report = {"rank": rank, "rows": rows[1:], "grid": list(grid), "halos": int((catalog.labels >= 0).sum()),
              "so_members": int(masses.members.sum())}
    with open(result_path.format(rank=rank), "w") as handle:
        json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()


def _reports(worker, world, size, repeats, threads, steps):
    """The ranks' reports of ``worker`` (``_halo_worker``, ``_adjoint_worker``) in ``world``
    fresh processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "rank{rank}.json")
        mp.start_processes(worker, args=(world, size, repeats, threads, os.path.join(tmp, "store"), result_path, steps),
                           nprocs=world, join=True, start_method="spawn")
        reports = []
        for rank in range(world):
            with open(result_path.format(rank=rank)) as handle:
                reports.append(json.load(handle))
    return reports


def _slowest_medians(reports, repeats, columns):
    """Per column, the median over the repeats of the slowest rank's value."""
    return [statistics.median(max(r["rows"][i][k] for r in reports) for i in range(repeats)) for k in range(columns)]


def run_halos(size, world, repeats, threads, steps):
    reports = _reports(_halo_worker, world, size, repeats, threads, steps)
    return reports[0], _slowest_medians(reports, repeats, 2)


def run_adjoint(size, world, repeats, threads, steps):
    reports = _reports(_adjoint_worker, world, size, repeats, threads, steps)
    return reports[0]["grid"], _slowest_medians(reports, repeats, 4)


def _spawn(world, size, repeats, threads, sort_every, memory_only):
    """The ranks' reports of one run of :func:`_worker` in ``world`` fresh processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "rank{rank}.json")
        mp.start_processes(_worker, args=(world, size, repeats, threads, os.path.join(tmp, "store"), result_path,
                                          sort_every, memory_only),
                           nprocs=world, join=True, start_method="spawn")
        reports = []
        for rank in range(world):
            with open(result_path.format(rank=rank)) as handle:
                reports.append(json.load(handle))
    return reports


def run(size, world, repeats, threads, sort_every=0):
    """Peak memory from processes with a fixed glibc mmap threshold (every large block goes
    back to the system when freed, so the sampled resident set follows live memory), then
    the timings from processes without it (its fresh mmaps add page faults to every large
    allocation: 20-40 ms per migration at 128^3 on 2 ranks)."""
    with fixed_mmap_threshold():
        memory = _spawn(world, size, repeats, threads, sort_every, memory_only=True)
    reports = _spawn(world, size, repeats, threads, sort_every, memory_only=False)
    step = statistics.median(max(r["steps"][i] for r in reports) for i in range(repeats))
    late = statistics.median(max(r["steps"][i] for r in reports) for i in range(repeats // 2, repeats))
    breakdown = {}
    for phase in ("paint", "halo", "FFT", "transposes", "stencil", "readout", "migration", "sort"):
        breakdown[phase] = statistics.median(
            max(r["breakdowns"][i].get(phase, 0.0) for r in reports) for i in range(repeats))
    breakdown["FFT local"] = max(breakdown.pop("FFT") - breakdown["transposes"], 0.0)
    return {
        "size": size, "ranks": world, "grid": reports[0]["grid"], "step_s": step, "late_step_s": late,
        "breakdown": breakdown,
        "peak_bytes": max(r["peak"] for r in memory),
        "particles_per_rank": [r["particles"] for r in reports],
    }


def main():
    import torchpm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--adjoint", action="store_true",
                        help="time forward and backward of a whole run with the adjoint method instead")
    parser.add_argument("--steps", type=int, default=None, help="steps of the run (--adjoint: 5, --halos: 20)")
    parser.add_argument("--halos", action="store_true",
                        help="time find_halos and spherical_overdensity_masses on an evolved state instead")
    parser.add_argument("--sort-every", type=int, default=0,
                        help="sort the particles into spatial order after every k-th migration "
                             "(Simulation's sort_every; 0: never)")
    arguments = parser.parse_args()
    if arguments.halos:
        steps = 20 if arguments.steps is None else arguments.steps
        print_header("distributed halo finding", "cpu", [
            "gloo", f"{steps} steps to a = 1", f"{arguments.threads_per_rank} thread(s) per rank",
            f"median of {arguments.repeats} calls (slowest rank)"])
        table = Table(["size", "ranks", "grid", "halos", ("find_halos s", ".3f"), ("SO 200m s", ".3f"),
                       "SO members"])
        table.print_header()
        for size in arguments.sizes:
            for world in arguments.ranks:
                report, (fof, so) = run_halos(size, world, arguments.repeats, arguments.threads_per_rank, steps)
                table.print_row(f"{size}^3", world, "x".join(map(str, report["grid"])), report["halos"], fof, so,
                                report["so_members"])
        return
    if arguments.adjoint:
        print_header("distributed adjoint", "cpu", [
            "gloo", f"{5 if arguments.steps is None else arguments.steps} steps",
            f"{arguments.threads_per_rank} thread(s) per rank",
            f"median of {arguments.repeats} runs (slowest rank)"])
        table = Table(["size", "ranks", "grid", ("forward s", ".3f"), ("backward s", ".3f"),
                       ("halo in forward s", ".3f"), ("halo in backward s", ".3f")])
        table.print_header()
        for size in arguments.sizes:
            for world in arguments.ranks:
                grid, (forward, backward, halo_f, halo_b) = run_adjoint(
                    size, world, arguments.repeats, arguments.threads_per_rank,
                    5 if arguments.steps is None else arguments.steps)
                table.print_row(f"{size}^3", world, "x".join(map(str, grid)), forward, backward, halo_f, halo_b)
        return
    print_header("distributed PM step", "cpu", ["gloo", f"CPU kernels {torchpm.cpu_kernels()}"])
    print(f"# {arguments.threads_per_rank} thread(s) per rank, median of {arguments.repeats} steps (slowest rank); "
          f"sort_every {arguments.sort_every}; late steps = the second half of the run")
    table = Table(["size", "ranks", "grid", "step ms", "late steps ms"] + [f"{p} ms" for p in PHASES]
                  + ["peak MiB/rank", "vs 1 rank"])
    table.print_header()
    single = {}
    for size in arguments.sizes:
        for world in arguments.ranks:
            result = run(size, world, arguments.repeats, arguments.threads_per_rank, arguments.sort_every)
            peak = result["peak_bytes"] / 2**20
            if world == 1:
                single[size] = peak
            ratio = f"{peak / single[size]:.2f}x" if size in single and single[size] > 0 else "-"
            cells = [f"{size}^3", str(world), "x".join(map(str, result["grid"])), f"{result['step_s'] * 1e3:.1f}",
                     f"{result['late_step_s'] * 1e3:.1f}"]
            cells += [f"{result['breakdown'][p] * 1e3:.1f}" for p in PHASES]
            cells += [f"{peak:.0f}", ratio]
            table.print_row(*cells)


if __name__ == "__main__":
    main()
